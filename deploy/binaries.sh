# Sourced by the deploy tests: `deploy_binaries "$@"` sets server and client to the two arguments when given, else
# to build/bin/'s mha_server and mha_client (configured and built if missing). Run from the repository root.
deploy_binaries() {
  if [[ $# -ge 2 ]]; then
    server=$1 client=$2
  else
    [[ -f build/build.ninja ]] || deploy/build.sh
    cmake --build build --target mha_server mha_client
    server=$PWD/build/bin/mha_server client=$PWD/build/bin/mha_client
  fi
}
