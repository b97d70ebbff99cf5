# syntax=docker/dockerfile:1
# priority-sidecar image (the admission sidecar; Envoy runs from envoyproxy/envoy).
#   docker build -t priority-gate/sidecar:0.1.0 .

# ---- builder: build wheels for the project and all its dependencies
FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
RUN pip wheel --wheel-dir /wheels .

# ---- runtime: only the installed wheels, running as an unprivileged user
FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# xds-protos ships OTLP 0.9's modules under opentelemetry/proto/: opentelemetry-proto's files
# back on top, for the OTLP exporter (--otlp-endpoint).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links /wheels priority-gate \
 && pip install --no-index --find-links /wheels --force-reinstall --no-deps opentelemetry-proto \
 && python -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope' \
 && groupadd --system --gid 10001 smg \
 && useradd --system --uid 10001 --gid smg --no-create-home --shell /usr/sbin/nologin smg
# Numeric so Kubernetes runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
# gRPC (Envoy ext_authz/ALS/ext_proc) and HTTP (/metrics, /healthz, /readyz).
EXPOSE 9001 9090
ENTRYPOINT ["priority-sidecar"]
