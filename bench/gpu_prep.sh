#!/usr/bin/env bash
# Prepare, on this machine, what bench/gpu_check.sh needs on the GPU machine (issue 13). That machine receives
# only this repository (64 MiB at most, plus the folders named in `carry`) and reaches no package registry, so:
#   .whl/          wheels (Python 3.12, manylinux x86-64) of what it lacks or has too old: starlette, uvicorn,
#                  orjson, httptools, ijson (the server), transformers 5.24 and regex (the StaticCache API the static
#                  decoder is written against; the machine had 5.17); the versions installed here (~15 MB)
#   .gpu/smollm2/  SmolLM2's tokenizer, chat template and config read from the GGUF (~4 MB); no weights: the
#                  GPU check serves SmolLM2's architecture with random weights (--smollm2-dir)
# Both folders are git-ignored. Needs this repo's venv with the model extra (the GGUF) and access to PyPI.
#
#   bash bench/gpu_prep.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl && mkdir -p .whl
pins=()
for pkg in starlette uvicorn orjson httptools ijson transformers regex; do pins+=("$pkg==$(version "$pkg")"); done
echo "wheels: ${pins[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
"$PY" -m bench.gpu_prep .gpu/smollm2
du -sh .whl .gpu
echo
echo "device call: run(command=\"COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- batchserve bench || echo +dirty) bash bench/gpu_check.sh\", carry=[\".whl\", \".gpu\"], timeout_s=370)"
echo "second call (process executor, generation over HTTP): run(command=\"COMMIT=$(git rev-parse --short HEAD) PARTS=process,cbhttp bash bench/gpu_check.sh\", carry=[\".whl\", \".gpu\"], timeout_s=300)"
