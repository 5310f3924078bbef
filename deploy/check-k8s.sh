#!/usr/bin/env bash
# Validates the Kubernetes manifests and the monitoring objects without a cluster: yamllint (deploy/k8s/.yamllint),
# then deploy/check_k8s.py (they parse, and names, labels, ports, flags, limits and metric names agree across them,
# with the Dockerfile and with the metrics the server exports).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --deploy
yamllint --strict -c deploy/k8s/.yamllint deploy/k8s deploy/monitoring
echo "check-k8s: yamllint passed"
/usr/bin/python3 deploy/check_k8s.py deploy/k8s Dockerfile deploy/monitoring server/metrics.cc
