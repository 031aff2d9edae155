# syntax=docker/dockerfile:1
# kvoffload admin service on the built-in workload.
#
#   docker build -t kvoffload .                          # CPU torch (default)
#   docker build -t kvoffload:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_SPEC="torch==2.13.0" .             # CUDA torch from PyPI
#   docker run -p 127.0.0.1:8000:8000 -e KVOFFLOAD_ADMIN_TOKEN=... kvoffload
#
# The service refuses to listen beyond loopback without KVOFFLOAD_ADMIN_TOKEN.
ARG BASE_IMAGE=python:3.11.13-slim-bookworm
FROM ${BASE_IMAGE}

# What `pip install` gets for torch: the default is the CPU build.
ARG TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Python >= 3.11 in a virtual environment. The python base images have it; a CUDA
# base image (Ubuntu 24.04: Python 3.12) gets it from apt.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && groupadd --system --gid 10001 kvoffload \
    && useradd --system --uid 10001 --gid kvoffload --create-home \
        --home-dir /home/kvoffload --shell /usr/sbin/nologin kvoffload

WORKDIR /src

# Dependencies first, in their own layers: torch, then everything pyproject.toml
# names for the service (OTLP over gRPC included), installed through a stub of
# the package so that editing the source does not invalidate them. TORCH_SPEC
# is split into words on purpose (SC2086); versions come from TORCH_SPEC and
# pyproject.toml, which hadolint cannot see (DL3013).
# hadolint ignore=SC2086,DL3013
RUN pip install ${TORCH_SPEC}
COPY pyproject.toml ./
# hadolint ignore=DL3013
RUN mkdir -p kvoffload app \
    && touch README.md LICENSE kvoffload/__init__.py app/__init__.py \
    && echo '__version__ = "0.0.0"' > kvoffload/_version.py \
    && pip install ".[app,otlp-grpc]" \
    && pip uninstall -y kvoffload \
    && rm -rf /src/*

# The source (see .dockerignore for what stays out). The C extensions (the
# block table, kvoffload/_table.c, and the row copier,
# kvoffload/transfer/_rows.c) need a compiler at build time only; the build
# fails if either did not build (pip would fall back to slower pure Python). The check imports the installed package: `-P` keeps /src, whose
# kvoffload/ has no built extension, off the import path.
COPY . .
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-deps . \
    && python -P -c "import kvoffload._table, kvoffload.transfer._rows" \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* /src/*

USER 10001:10001
WORKDIR /home/kvoffload
# all interfaces, as a container must (the port mapping decides who reaches
# it); set in the environment, not as a flag, so `-e KVOFFLOAD_HOST=...` still wins
ENV KVOFFLOAD_HOST=0.0.0.0 \
    KVOFFLOAD_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/livez' % os.environ.get('KVOFFLOAD_PORT', '8000'), timeout=4)"]
CMD ["kvoffload", "serve"]
