#!/usr/bin/env bash
# The GPU check (issues 13 and 25): ONE device call of at most 6 minutes, agreement first, each table added to
# $OUT/check.md as soon as its stage ends, each stage under its own timeout and all of them under one budget
# (BUDGET_S, default 340 s), so one slow stage cannot eat the rest. SmolLM2-135M's exact architecture with random
# weights (the GGUF cannot travel); all-MiniLM-L6-v2's real weights in fp16 (.gpu/minilm-fp16.zip).
#
#   agree      first, as wrong tokens would make every figure after it moot: the static decoder and the slot
#              stepper with CUDA graphs (and eagerly on CUDA) against the same code eager on the CPU
#              (bench/gpu_agree.py). Goal: every greedy request identical, 90 % of the sampled ones.
#   paths      the server at 3 offered rates up to overload (500, 1,000, 2,000 req/s x 64 new tokens), for
#              /v1/inference on the slot stepper and then on the static batch path (bench/inference_paths.py,
#              issue 25 item 1's script): answered/s, p95, 503s at the door, seconds to ready (the stepper's
#              slots sized from free memory, so their capture is part of it). Goal: >= 1,000 req/s (H200; 800 on
#              an H100) at p95 <= 1 s, overload answered with 503. Without that script in the copy, the
#              `server` stage runs in its place.
#   rows       the slot stepper at 256, 512 and 1,024 rows (bench/cb_compare.py, 6,144 requests, 80 % x 16 and
#              20 % x 256 tokens). Goal: >= 80,000 output tokens/s at 1,024.
#   server     `batchserve serve --backend smollm2 --generation on` at 400, 800 and 1,400 req/s
#              (bench/executor_bench.py; the static path's batch time in the server vs offline).
#   embed      minilm served vs sentence-transformers offline on the same GPU (bench/gpu_embed.py, the fp16 copy
#              unzipped and named with $BATCHSERVE_MINILM_DIR). Goal: in-server >= 0.9 x offline.
# Older parts, by PARTS only: static (offline batch time by size vs the anchor), cbmix (slots vs transformers'
# manager on 384 requests), process (the process executor at 300/s), cbhttp (generation over HTTP).
#
# What comes back: at most 8 files from $OUT, so the stages write into a work folder and after each one the
# script appends its markdown to $OUT/check.md and re-packs every table, JSON and server log into
# $OUT/tables.tgz (a call cut short still returns what was done); the whole output also goes to $OUT/check.log.
#
# Prepare here first:  bash bench/gpu_prep.sh   (wheels into .whl/, SmolLM2's tokenizer + config and the minilm
#                                                fp16 zip into .gpu/; it prints the exact device call)
# Device run (bench/README.md):
#   run(command="COMMIT=<short hash> bash bench/gpu_check.sh", carry=[".whl", ".gpu"], timeout_s=370)
# CPU dry run of every stage in its tiny mode (~3 minutes on 2 busy cores):  bash bench/gpu_check.sh --cpu-smoke
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# $OUT: what comes back from the GPU machine; without it a temporary folder, never the checkout.
out=${OUT:-$(mktemp -d -t gpu-check.XXXXXX)}
mkdir -p "$out"
work=$(mktemp -d -t gpu-check-work.XXXXXX)
minilm_dir=""
trap 'rm -rf "$work" ${minilm_dir:+"$minilm_dir"}' EXIT  # all of $work is in $out/tables.tgz by then
cpu=0
case "${1:-}" in --cpu|--tiny|--cpu-smoke) cpu=1 ;; esac
budget=${BUDGET_S:-340}
[[ $cpu == 1 ]] && budget=${BUDGET_S:-600}
end=$((SECONDS + budget))
exec > >(tee -a "$out/check.log") 2>&1
echo "tables in $out/check.md and $out/tables.tgz (work folder $work)"
if [[ $cpu == 0 ]] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "# GPU check"
  echo
  echo '```'
  "$PY" -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))' 2>&1
  # The GPU machine's copy has no .git: the caller passes COMMIT (bench/gpu_prep.sh prints the call).
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; cores $(nproc); $(date -u +%FT%TZ)"
  [[ $cpu == 0 ]] && nvidia-smi -L 2>&1
  echo '```'
} > "$out/check.md"
cat "$out/check.md"

# stage NAME SECONDS COMMAND...: run under min(SECONDS, what the budget has left); then add its tables to
# check.md and re-pack the work folder. A stage with under 15 s left is skipped, and says so.
stage() {
  local name=$1 limit=$2 left rc
  shift 2
  left=$((end - SECONDS))
  (( limit > left )) && limit=$left
  if (( limit < 15 )); then
    echo "## $name: skipped, the budget has ${left} s left" | tee -a "$out/check.md"
    return
  fi
  echo "== $name (at most ${limit} s): $*"
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@"
  rc=$?
  {
    echo
    echo "## $name ($((SECONDS - t0)) s, exit $rc$([[ $rc == 124 || $rc == 137 ]] && echo ': timed out'))"
    echo
    for f in "$work/$name"*.md "$work/$name"/*.md; do [[ -f $f ]] && cat "$f" && echo; done
  } >> "$out/check.md"
  tar -czf "$out/tables.tgz.tmp" -C "$work" . 2>/dev/null && mv "$out/tables.tgz.tmp" "$out/tables.tgz"
}

smol=.gpu/smollm2
if [[ -f .gpu/minilm-fp16.zip ]]; then
  minilm_dir=$(mktemp -d -t minilm-fp16.XXXXXX)  # not in $work: it is packed into tables.tgz
  mkdir -p "$minilm_dir" && (cd "$minilm_dir" && unzip -q -o "$OLDPWD/.gpu/minilm-fp16.zip") || minilm_dir=""
fi
paths_script=bench/inference_paths.py
default_parts=agree,paths,rows,embed  # paths is the server under load, both /v1/inference paths
[[ -f $paths_script ]] || default_parts=agree,paths,rows,server,embed
IFS=, read -ra parts <<< "${PARTS:-$default_parts}"
if [[ $cpu == 1 ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
  [[ -f $smol/config.json ]] || echo "no $smol: carry .gpu (made by bash bench/gpu_prep.sh); the server stages will fail"
fi
for part in "${parts[@]}"; do
  case $part:$cpu in
    agree:0) stage agree 45 "$PY" bench/gpu_agree.py --out "$work/agree.md" ;;
    agree:1) stage agree 60 "$PY" bench/gpu_agree.py --device cpu --tiny --slots 8 --requests 16 --out "$work/agree.md" ;;
    paths:*)
      if [[ -f $paths_script ]]; then
        if [[ $cpu == 0 ]]; then
          stage paths 140 "$PY" "$paths_script" --device cuda --smollm2-dir "$smol" --paths stepper,static \
            --rates 500,1000,2000 --duration 4 --start-timeout-s 70 --out "$work/paths"
        else
          stage paths 150 "$PY" "$paths_script" --device cpu --tiny --out "$work/paths"
        fi
      else
        echo "## paths: skipped, no $paths_script (issue 25 item 1's static vs stepper bench) in this copy" \
          | tee -a "$out/check.md"
      fi ;;
    rows:0) stage rows 70 "$PY" bench/cb_compare.py --random --device cuda --requests 6144 --batch 256 \
        --cb-seqs 512,1024 --kv-tokens 2097152 --skip-static --engines slots --out "$work/rows.md" ;;
    rows:1) stage rows 90 "$PY" bench/cb_compare.py --random --tiny --device cpu --requests 24 --batch 4 --long 32 \
        --cb-seqs 8,16 --kv-tokens 4096 --skip-static --engines slots --out "$work/rows.md" ;;
    server:0) stage server 110 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors thread --generation on \
        --rates 400,800,1400 --duration 5 --sizes 1,32,100 --repeats 1 --max-new-tokens 64 --slo-ms 1000 \
        --timeout-s 30 --start-timeout-s 75 --out "$work/server.md" ;;
    server:1)
      if [[ -f $smol/config.json ]]; then
        stage server 90 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors thread --generation on --rates 2,6 \
          --duration 3 --sizes 1,2 --repeats 1 --max-new-tokens 2 --start-timeout-s 60 --out "$work/server.md"
      else
        echo "## server: skipped, no $smol (bash bench/gpu_prep.sh makes it)" | tee -a "$out/check.md"
      fi ;;
    embed:0) stage embed 60 "$PY" -m bench.gpu_embed --device cuda ${minilm_dir:+--minilm-dir "$minilm_dir"} \
        --texts 20000 --inputs 1,32 --concurrency 256 --seconds 5 --start-timeout-s 40 --out "$work/embed" \
        --name embed ;;
    embed:1) stage embed 90 "$PY" -m bench.gpu_embed --device cpu --tiny ${minilm_dir:+--minilm-dir "$minilm_dir"} \
        --out "$work/embed" --name embed ;;
    static:0) stage static 80 "$PY" bench/gpu_static_bench.py --sizes 100,64,1 --repeats 2 --out "$work/static.md" ;;
    static:1) stage static 30 "$PY" bench/gpu_static_bench.py --device cpu --tiny --sizes 1,4 --repeats 1 \
        --new-tokens 8 --out "$work/static.md" ;;
    cbmix:0) stage cbmix 70 "$PY" bench/cb_compare.py --random --device cuda --requests 384 --batch 64 \
        --cb-seqs 256 --kv-tokens 131072 --skip-static --engines slots,manager --cuda-graphs on --sampling ours \
        --out "$work/cbmix.md" ;;
    cbmix:1) stage cbmix 60 "$PY" bench/cb_compare.py --random --tiny --device cpu --requests 10 --batch 4 --long 32 \
        --cb-seqs 8 --kv-tokens 2048 --skip-static --engines slots,manager --sampling ours --out "$work/cbmix.md" ;;
    process:0) stage process 120 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors process \
        --rates 300 --duration 6 --sizes 1,8,16,32,64,100 --repeats 2 --max-new-tokens 64 --slo-ms 1000 \
        --timeout-s 30 --start-timeout-s 90 --out "$work/process.md" ;;
    cbhttp:0) stage cbhttp 150 "$PY" -m bench.stepper_host --http --real-model "$smol" --repeats 1 \
        --start-timeout-s 100 --out "$work/cbhttp" ;;
    *) echo "## $part: unknown here (agree, paths, rows, server, embed; static, cbmix, process, cbhttp on a GPU)" \
         | tee -a "$out/check.md" ;;
  esac
done
echo "done in $SECONDS s: $out/check.md, $out/tables.tgz"
exit 0
