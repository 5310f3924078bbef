#!/usr/bin/env bash
# Makes the local base image localhost/debian:bookworm for the Dockerfile (BASE_IMAGE) where no registry is
# reachable: debootstrap --variant=minbase from this machine's own Debian mirror, with its apt sources and settings,
# then podman import. Does nothing when the image exists. Uses podman's settings from the environment
# (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF), as the podman commands after it will.
#   deploy/base-image.sh            (about a minute, once)
set -euo pipefail
base_image=localhost/debian:bookworm
if podman image exists "$base_image"; then
  echo "base-image: $base_image exists"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "base-image: needs debootstrap (deploy/install-deps.sh --container)"; exit 1; }
work=$(mktemp -d)
cleanup() {
  if [[ -d "$work/rootfs" ]]; then rm -rf --one-file-system "$work/rootfs"; fi
  rm -rf "$work"
}
trap cleanup EXIT

mirror=$(apt-get indextargets --no-release-info --format '$(RELEASE) $(COMPONENT) $(REPO_URI)' |
  awk '$1 == "bookworm" && $2 == "main" { print $3; exit }')
[[ -n "$mirror" ]] || { echo "base-image: no bookworm main mirror in the apt sources"; exit 1; }
echo "base-image: debootstrap --variant=minbase bookworm from $mirror"
debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 ||
  { tail -30 "$work/debootstrap.log"; exit 1; }
# The host's Debian sources (those whose keyrings the new system has) in place of debootstrap's one line, and the
# host's apt acquisition settings, so that apt-get inside the image reaches the same mirror the same way.
mkdir "$work/sources"
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [[ -s "$f" ]] || continue
  keyrings_present=1
  for key in $(grep -ohE '(Signed-By: *|signed-by=)[^] ]+' "$f" | sed -E 's/^(Signed-By: *|signed-by=)//' || true); do
    [[ -e "$work/rootfs$key" ]] || keyrings_present=0
  done
  if [[ $keyrings_present -eq 1 ]]; then cp --parents "$f" "$work/sources/"; fi
done
if [[ -n "$(ls -A "$work/sources")" ]]; then
  rm -f "$work/rootfs/etc/apt/sources.list"
  cp -r "$work/sources/etc/apt/." "$work/rootfs/etc/apt/"
fi
apt-config dump | grep -E '^Acquire::(Check-Valid-Until|Check-Date|https?::Proxy) ' \
  >"$work/rootfs/etc/apt/apt.conf.d/99host-acquire" || true
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
tar -C "$work/rootfs" -c . | podman import - "$base_image" >/dev/null
echo "base-image: made $base_image"
