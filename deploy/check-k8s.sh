#!/usr/bin/env bash
# Validates the Kubernetes manifests and the monitoring objects without a cluster: yamllint (deploy/k8s/.yamllint;
# also over deploy/gateway, the Gateway API example, which needs CRDs this checks nothing else of),
# then deploy/check_k8s.py (they parse, and names, labels, ports, flags, limits and metric names agree across them,
# with the Dockerfile and with the metrics the server exports), for the base (deploy/k8s) and for the GPU overlay
# (deploy/k8s-gpu) as it patches the base. Where kubectl is installed (it is no Debian package; install-deps does
# not add it), `kubectl kustomize` must build both, and its rendering of the overlay must equal check_k8s.py's.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install-deps.sh --deploy
yamllint --strict -c deploy/k8s/.yamllint deploy/k8s deploy/k8s-gpu deploy/monitoring deploy/gateway
echo "check-k8s: yamllint passed"
rendered=()
if command -v kubectl >/dev/null; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  for dir in deploy/k8s deploy/monitoring; do
    kubectl kustomize "$dir" >/dev/null || { echo "check-k8s: kubectl kustomize $dir failed"; exit 1; }
  done
  kubectl kustomize deploy/k8s-gpu >"$work/gpu.yaml" ||
    { echo "check-k8s: kubectl kustomize deploy/k8s-gpu failed"; exit 1; }
  rendered=("$work/gpu.yaml")
  echo "check-k8s: kubectl kustomize built deploy/k8s, deploy/monitoring and deploy/k8s-gpu"
else
  echo "check-k8s: no kubectl here: the overlay is checked as check_k8s.py renders it, not against kustomize"
fi
/usr/bin/python3 deploy/check_k8s.py deploy/k8s Dockerfile deploy/monitoring server/metrics/metrics.cc deploy/k8s-gpu \
  "${rendered[@]}"
