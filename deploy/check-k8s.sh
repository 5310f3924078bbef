#!/usr/bin/env bash
# Validates the Kubernetes manifests without a cluster: yamllint (deploy/k8s/.yamllint), then deploy/check_k8s.py
# (they parse, and names, labels, ports, flags and limits agree across them and with the Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --deploy
yamllint --strict -c deploy/k8s/.yamllint deploy/k8s
echo "check-k8s: yamllint passed"
/usr/bin/python3 deploy/check_k8s.py deploy/k8s Dockerfile
