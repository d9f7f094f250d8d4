# Shoal: one image for every service (`shoal up`, gateway, scheduler, node-agent; workers are
# spawned by the node agent inside its container). Two variants, chosen with VARIANT:
#
#   docker build -t shoal .          cpu (the default): python:3.11-slim and CPU torch; serves on
#                                    virtual GPUs (--gpus virtual:2x16GiB).
#   docker build -t shoal:cuda --build-arg VARIANT=cuda .
#                                    cuda: for NVIDIA hosts (--gpus nvml). A CUDA *devel* image
#                                    (CUDA_IMAGE, with nvcc), the host compiler and Python headers,
#                                    CUDA torch (TORCH_CUDA) and the `cuda` extra (ninja): what
#                                    torch.utils.cpp_extension needs to build Shoal's KV kernels
#                                    (kernels/csrc), which a worker does when it starts on a GPU
#                                    (about a minute the first time, then cached by torch under
#                                    ~/.cache/torch_extensions; mount a volume there to keep it).
#                                    nvcc's CUDA must match torch's: CUDA_IMAGE 12.8 with
#                                    TORCH_CUDA=cu128 (the defaults); change both together, e.g.
#                                    --build-arg CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04
#                                    --build-arg TORCH_CUDA=cu126, to what the host driver supports.
#                                    Run it with the NVIDIA container toolkit (compose.yaml reserves
#                                    the GPUs).
#
# TORCH_INDEX_URL, when set, overrides the torch index of either variant. Needs BuildKit (the
# default builder since Docker 23): only the chosen variant's base stage is built.

ARG VARIANT=cpu
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04

FROM python:3.11-slim AS base-cpu

FROM ${CUDA_IMAGE} AS base-cuda
# The devel image has nvcc; torch.utils.cpp_extension also needs a host C++ compiler and
# Python's headers. A virtual environment, because the distribution's Python refuses pip
# installs into itself (PEP 668).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    CUDA_HOME=/usr/local/cuda

FROM base-${VARIANT}

ARG VARIANT
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG TORCH_INDEX_URL=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: `pip install .` then finds it satisfied instead of pulling
# the default wheel from PyPI. Its own layer, so code changes do not reinstall it.
RUN if [ "$VARIANT" = cuda ]; then index="https://download.pytorch.org/whl/${TORCH_CUDA}"; \
    else index="https://download.pytorch.org/whl/cpu"; fi \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL:-$index}"

WORKDIR /opt/shoal
COPY . .
# The cuda variant adds the `cuda` extra: ninja, which torch.utils.cpp_extension builds with.
RUN if [ "$VARIANT" = cuda ]; then pip install ".[cuda]"; else pip install .; fi \
    && useradd --create-home --uid 10001 shoal \
    && mkdir -p /models \
    && chown shoal:shoal /models

USER shoal
WORKDIR /home/shoal
VOLUME ["/models"]
EXPOSE 8000

ENTRYPOINT ["shoal"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000", "--models-root", "/models"]
