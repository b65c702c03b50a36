#!/usr/bin/env bash
# Build the services' one image (Dockerfile) and check that it starts: the `specdec` entrypoint answers
# --help and every package the containers run imports. tests/test_dockerfile.py runs this script (for real
# where a Docker engine answers, else against a stand-in `docker` that checks each command and its context).
#   IMAGE            the tag (default specdec:local)
#   BASE_IMAGE       the Python base image (default: the Dockerfile's python:3.11-slim)
#   TORCH_INDEX_URL  where pip finds torch (default: the Dockerfile's, the CPU wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-specdec:local}"
args=(build --network host --tag "$IMAGE" --file Dockerfile)
if [ -n "${BASE_IMAGE:-}" ]; then args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE"); fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"); fi
docker "${args[@]}" .
docker run --rm "$IMAGE" --help >/dev/null
docker run --rm --entrypoint python "$IMAGE" -c \
  "import specdec.entrypoints.healthcheck, specdec.entrypoints.cli, gateway.server, draft_service.server, target_service.server"
echo "built $IMAGE"
