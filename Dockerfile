# Shoal: one image for every service (`shoal up`, gateway, scheduler, node-agent; workers are
# spawned by the node agent inside its container).
#
#   docker build -t shoal .          CPU torch: serves on virtual GPUs (--gpus virtual:2x16GiB)
#   docker build -t shoal:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#                                    CUDA torch for NVIDIA hosts (--gpus nvml); pick the index
#                                    (cu126, cu128, ...) that matches the host driver. Run it with
#                                    the NVIDIA container toolkit (compose.yaml reserves the GPUs).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: `pip install .` then finds it satisfied instead of pulling
# the default wheel from PyPI. Its own layer, so code changes do not reinstall it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/shoal
COPY . .
RUN pip install . \
    && useradd --create-home --uid 10001 shoal \
    && mkdir -p /models \
    && chown shoal:shoal /models

USER shoal
WORKDIR /home/shoal
VOLUME ["/models"]
EXPOSE 8000

ENTRYPOINT ["shoal"]
CMD ["up", "--host", "0.0.0.0", "--port", "8000", "--models-root", "/models"]
