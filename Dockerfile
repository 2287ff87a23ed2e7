# The rlstream image: one image for every rlstream service (topics-init, streams, learner, rollout, sync).
#   docker build -t rlstream:latest .                          # CUDA torch from PyPI (GPU learner)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t rlstream:cpu .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    RLSTREAM_STREAMS__DATA_DIR=/data/streams

RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential curl \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# dependencies first, so source edits do not rebuild the torch layer
COPY pyproject.toml README.md ./
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; else pip install torch; fi
COPY rlstream ./rlstream
RUN pip install ".[streams,learner,gateway,rocksdb]" && rlstream --help > /dev/null

RUN useradd --create-home --uid 1000 rlstream && mkdir -p /data /weights && chown rlstream /data /weights
USER rlstream
# Prometheus endpoints of streams and learner (see docker-compose.yml)
EXPOSE 9101 9102
CMD ["rlstream", "--help"]
