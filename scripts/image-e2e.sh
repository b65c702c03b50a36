#!/usr/bin/env bash
# The images' end-to-end check: build the CPU image (scripts/build-image.sh), start the compose stack's specdec
# services on it (read-only root filesystems, the model cache on a volume), send one /v1/completions request,
# scrape the gateway's /metrics (and the draft's and target's from inside the stack's network), then tear the
# stack down (`down -v`, on failure too). Prints the build time, the image size and the cold start (seconds
# from `up` to the first successful completion). tests/test_image_e2e.py runs it for real where a Docker engine
# answers, else against stand-in `docker`/`docker-compose` executables that check each command.
#   IMAGE             the tag compose runs (default specdec:latest, docker-compose.yml's)
#   SERVICES          the services started (default "target draft gateway": Prometheus and Grafana need images
#                     pulled from a registry)
#   SKIP_BUILD=1      use the image IMAGE as it is
#   BASE_IMAGE, ALL_MODELS, TORCH_INDEX_URL, PIP_*, SERVE_PORT   passed to scripts/build-image.sh (a local base:
#                     scripts/make-base-image.sh; the host's wheel folders in PIP_FIND_LINKS are served to the build)
#   STARTUP_TIMEOUT   seconds to wait for the first completion (default 900)
#   HTTP_PORT         the gateway's published HTTP port (default 8000)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-specdec:latest}"
SERVICES="${SERVICES:-target draft gateway}"
STARTUP_TIMEOUT="${STARTUP_TIMEOUT:-900}"
HTTP_PORT="${HTTP_PORT:-8000}"
PROJECT="${COMPOSE_PROJECT_NAME:-specdec-e2e}"
PYTHON="$(command -v python3 || command -v python)"
work="$(mktemp -d /tmp/specdec-e2e.XXXXXX)"
compose_up=0

# compose runs IMAGE for the specdec services (an override file; docker-compose.yml names specdec:latest)
cat >"$work/override.yml" <<EOF
version: "3.8"
services:
EOF
for svc in target draft gateway; do printf '  %s:\n    image: %s\n' "$svc" "$IMAGE" >>"$work/override.yml"; done
compose=(docker-compose --project-name "$PROJECT" -f docker-compose.yml -f "$work/override.yml")

cleanup() {
  local rc=$?
  if [ "$compose_up" = 1 ]; then
    if [ "$rc" != 0 ]; then "${compose[@]}" logs --tail 80 $SERVICES >&2 || true; fi
    "${compose[@]}" down -v --remove-orphans || true
  fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- build
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  start=$(date +%s)
  IMAGE="$IMAGE" DOCKERFILE=Dockerfile bash scripts/build-image.sh
  build_s=$(( $(date +%s) - start ))
  echo "e2e: build_seconds=$build_s"
fi
size="$(docker image inspect --format '{{.Size}}' "$IMAGE")"
echo "e2e: image=$IMAGE size_bytes=$size size_mb=$(( size / 1000000 ))"

# --- up, first completion
"${compose[@]}" config -q
start=$(date +%s)
compose_up=1
# shellcheck disable=SC2086
"${compose[@]}" up -d --no-build $SERVICES
probe="$work/probe.py"
cat >"$probe" <<'PY'
import json, sys, time, urllib.request
base, deadline = sys.argv[1], time.monotonic() + float(sys.argv[2])
last = None
while time.monotonic() < deadline:
    try:
        models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))
        body = {"model": models["data"][0]["id"], "prompt": "The capital of France is", "max_tokens": 16,
                "temperature": 0}
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        out = json.load(urllib.request.urlopen(req, timeout=300))
        text = out["choices"][0]["text"]
        if not text.strip():
            sys.exit(f"empty completion: {out}")
        print(f"e2e: completion {text!r} usage={out.get('usage')}")
        sys.exit(0)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        last = exc
        time.sleep(2)
sys.exit(f"no completion within {sys.argv[2]}s: {last!r}")
PY
"$PYTHON" "$probe" "http://127.0.0.1:$HTTP_PORT" "$STARTUP_TIMEOUT"
echo "e2e: cold_start_seconds=$(( $(date +%s) - start ))"
"${compose[@]}" ps

# --- metrics: the gateway's published /metrics, the draft's and target's inside the stack's network
"$PYTHON" - "http://127.0.0.1:$HTTP_PORT/metrics" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=30).read().decode()
names = sorted({line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("specdec_")})
if not names:
    sys.exit(f"no specdec_ metrics at {sys.argv[1]}")
print(f"e2e: gateway metrics: {len(names)} specdec_ series, e.g. {names[:3]}")
PY
for target in draft:9101 target:9102; do
  case " $SERVICES " in *" ${target%%:*} "*) ;; *) continue ;; esac
  "${compose[@]}" exec -T gateway python -c "
import urllib.request
text = urllib.request.urlopen('http://$target/metrics', timeout=30).read().decode()
n = sum(line.startswith('specdec_') for line in text.splitlines())
assert n, 'no specdec_ metrics at $target'
print('e2e: $target metrics:', n, 'specdec_ samples')"
done
echo "e2e: ok"
