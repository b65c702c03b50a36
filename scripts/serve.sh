#!/usr/bin/env bash
# Install specdec, then run it on the embedded default models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec specdec serve "$@"
