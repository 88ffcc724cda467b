# syntax=docker/dockerfile:1
# streamvqa: one image for every service (`streamvqa ingest|encoder|qa|worker|ask|...`).
#
#   docker build -t streamvqa:0.1.0 .                              # CUDA 12.8 build of torch; the tag
#                                                                  # is pyproject's version, as compose.yaml
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 -t streamvqa .
#
# No CUDA base image: the torch wheels carry the CUDA runtime, cuBLAS, cuDNN and NCCL as pip
# packages, and the NVIDIA container toolkit mounts the host driver in at run time (cu128 needs
# driver >= 570, cu130 >= 580). FFmpeg comes inside the PyAV wheel. Two stages: the runtime
# image holds Python and the virtual environment, no build context and no pip cache.

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


FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
RUN groupadd --gid 10001 streamvqa \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/streamvqa \
        --shell /usr/sbin/nologin streamvqa \
    && mkdir -p /var/lib/streamvqa/segments /var/lib/streamvqa/transcripts /var/lib/streamvqa/frames \
        /home/streamvqa/.cache/huggingface /etc/streamvqa \
    && chown -R 10001:10001 /var/lib/streamvqa /home/streamvqa
COPY --from=build /opt/venv /opt/venv
# Named volumes mounted on these directories start with their owner (streamvqa), so the
# non-root services can write the segment store, transcripts, the frames log and the Hugging Face cache.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HOME=/home/streamvqa/.cache/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /var/lib/streamvqa
# Prometheus metrics (SVQA_METRICS_PORT) as compose.yaml sets them: ingest, encoder, qa, worker, recorder.
EXPOSE 9101 9102 9103 9104 9105
# compose.yaml defines the healthchecks (each service's /health/ready on its metrics port).
HEALTHCHECK NONE
ENTRYPOINT ["streamvqa"]
CMD ["worker"]
