# Sourced by the shell tests: throwaway certificates made with openssl.
#   make_test_certs DIR EXT NAME...   a CA (DIR/ca.EXT, DIR/ca.key) and, for each NAME, DIR/NAME.EXT and DIR/NAME.key
#                                     signed by it, for localhost and 127.0.0.1 (P-256, valid 2 days)
make_test_certs() {
  local dir=$1 ext=$2 name
  shift 2
  mkdir -p "$dir"
  echo "subjectAltName=DNS:localhost,IP:127.0.0.1" >"$dir/san.ext"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 -subj /CN=ca \
    -keyout "$dir/ca.key" -out "$dir/ca.$ext" 2>/dev/null
  for name in "$@"; do
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj /CN=localhost \
      -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
    openssl x509 -req -days 2 -in "$dir/$name.csr" -CA "$dir/ca.$ext" -CAkey "$dir/ca.key" -CAcreateserial \
      -extfile "$dir/san.ext" -out "$dir/$name.$ext" 2>/dev/null
  done
}
