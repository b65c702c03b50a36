#!/usr/bin/env bash
# Make a local base image for the Dockerfile where no image registry is reachable (air-gapped machines, CI
# runners with only package mirrors): a minimal Debian bookworm from an apt mirror (debootstrap), with python3
# and its venv module, imported into the engine with `docker import`. Then:
#   BASE_IMAGE=specdec-base:bookworm bash scripts/image-e2e.sh      (or scripts/build-image.sh)
# Needs root, debootstrap and a Docker engine.
#   BASE_IMAGE  the tag to make (default specdec-base:bookworm)
#   MIRROR      the apt mirror (default: the host's first Debian URI, else http://deb.debian.org/debian)
#   SUITE       the Debian release (default bookworm: python3.11, the cp311 wheels)
#   EXTRA_CA_DIR  CA certificates (*.crt) the image trusts beside Debian's, e.g. a TLS-intercepting proxy's
#               (default: the host's /usr/local/share/ca-certificates); pip is pointed at the bundle (PIP_CERT)
set -euo pipefail
BASE_IMAGE="${BASE_IMAGE:-specdec-base:bookworm}"
SUITE="${SUITE:-bookworm}"
if [ -z "${MIRROR:-}" ]; then
  MIRROR="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)"
  MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi
if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && [ "${FORCE:-0}" != "1" ]; then
  echo "base image $BASE_IMAGE exists (FORCE=1 remakes it)"
  exit 0
fi
rootfs="$(mktemp -d /tmp/specdec-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
# minbase: dpkg, apt and essentials only. python3-venv: the Dockerfile installs into a venv (Debian's python
# refuses system-wide pip installs, PEP 668); ca-certificates: pip's HTTPS.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$MIRROR"
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
EOF
EXTRA_CA_DIR="${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}"
if compgen -G "$EXTRA_CA_DIR/*.crt" >/dev/null; then
  cp "$EXTRA_CA_DIR"/*.crt "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates
fi
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
tar -C "$rootfs" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$BASE_IMAGE"
docker run --rm "$BASE_IMAGE" python3 -c "import venv, ensurepip, ssl; print('python3 ok')"
echo "made $BASE_IMAGE"
