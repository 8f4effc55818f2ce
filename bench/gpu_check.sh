#!/usr/bin/env bash
# Issue 6 GPU check: static vs continuous batching on CUDA, one call, about 2-3 minutes on an H100 (capped:
# 90 s for the batch-time sweep + 190 s for the comparison, under 5 minutes in all).
#
# A LlamaForCausalLM of SmolLM2-135M-Instruct's exact architecture with random weights (the weights cannot travel
# there) and prompts of random token ids; 384 requests at t = 0, 80 % x 16 tokens and 20 % x 256 (EOS ignored).
# Rows: static batches of 64 (`generate` to each batch's longest member), continuous batching with at most 64
# sequences (same concurrency), and with 256 (KV-bound, the point of continuous batching). Needs python3 with
# torch and transformers only (bench/cb_compare.py imports nothing else, never the GGUF loader).
#
#   bash bench/gpu_check.sh           # on the GPU machine: prints the table, writes it to $OUT (only if set)
#   bash bench/gpu_check.sh --tiny    # CPU smoke test of this same script (a 2-layer model, seconds)
#   OUT=bench/results bash bench/gpu_check.sh   # record into the checkout
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-}
if [[ -n "$out" ]]; then mkdir -p "$out"; fi
to() { if [[ -n "$out" ]]; then echo --out "$out/$1"; fi; }  # --out FILE only when $OUT is set

"$PY" -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'

if [[ "${1:-}" == "--tiny" ]]; then
  args=(--tiny --device cpu --requests 10 --batch 4 --long 32 $(to gpu-check-tiny.md))
  sweep=(--tiny --device cpu --sizes 1,4 --repeats 1 $(to gpu-sweep-tiny.md))
else
  sweep=(--device cuda $(to gpu-sweep.md))
  nvidia-smi -L || true
  args=(--device cuda --requests 384 --batch 64 --cb-seqs 256 --kv-tokens 131072 $(to gpu-check.md))
fi
# The static batchstring path's batch time by batch size (what the batcher learns as S), then the comparison.
timeout 90 "$PY" bench/gpu_batch_sweep.py "${sweep[@]}" || echo "batch sweep failed or timed out (exit $?)"
timeout 190 "$PY" bench/cb_compare.py --random "${args[@]}"
