#!/usr/bin/env bash
# Issue 13's GPU check: one call, about 6 minutes at most (each part under its own timeout), every table written
# to $OUT as soon as it has a row. SmolLM2-135M's exact architecture with random weights (the GGUF cannot travel).
#
#   0. agree.md   first, as wrong tokens would make every figure after it moot: the static decoder and the slot
#                 stepper with CUDA graphs (and eagerly on CUDA) against the same code eager on the CPU, on mixed
#                 prompts, EOS part-way, more requests than slots, greedy and seeded sampling (bench/gpu_agree.py;
#                 4 layers, float32). Goal: every greedy request identical, 90 % of the sampled ones.
#   1. static.md  offline batch time by batch size (100 first, then 64 and 1; 32-id prompts x 64 new tokens, EOS
#                 ignored): transformers generate (the old path), our static decoder eager and with CUDA graphs
#                 (the new path), and the shared anchor's graph loop (bench/anchor/, a verbatim copy).
#                 Goal: graph <= 1.3 x anchor at 100.
#   2. cb.md      continuous batching, 384 requests (80 % x 16 tokens, 20 % x 256), prompts of 64 random ids, at
#                 most 64 and 256 sequences: batchserve's slot stepper (the server's default generation engine:
#                 slot KV cache, CUDA-graph steps, sampling on the device), then transformers' manager with CUDA
#                 graphs and batchserve's sampling processors (--generation-engine manager). Output tokens/s.
#                 cb-steady.md: the slot stepper on 1,536 such requests, so 256 sequences run most of the time
#                 (with 384, 77 long ones make most of the run). Goal: >= 20,000 tokens/s at 256.
#   3. server.md  `batchserve serve --backend smollm2 --smollm2-dir .gpu/smollm2` (static decode, thread
#                 executor) under open-loop load at 100, 200 and 300 requests/s: achieved rate, p95 (client
#                 and server), mean batch, batch time in the server vs offline, server CPU, /healthz latency
#                 during the load, seconds to ready. Goals: in-server within 1.1 x offline; >= 300/s
#                 at p95 <= 3 x the batch time.
#
# PARTS picks and orders the parts (default "agree,static,cb,server"); each runs under its own timeout, so the
# whole call stays within about 6 minutes. A second call, PARTS=process,cbhttp (~4.5 minutes), measures the
# process executor alone at 300/s, and generation end to end: `bench/stepper_host.py --http --real-model` (a
# live server with --generation on, the cb-steady work as OpenAI completions, streamed and whole;
# stepper-host-*.md).
# Prepare here first:  bash bench/gpu_prep.sh          (wheels into .whl/, tokenizer + config into .gpu/)
# Device run (see bench/README.md): command "COMMIT=<short hash> bash bench/gpu_check.sh", carry [".whl", ".gpu"],
# timeout_s 370 (bench/gpu_prep.sh prints it with the current commit)
# CPU smoke test of this same script (tiny sizes, ~80 s):  bash bench/gpu_check.sh --cpu
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Tables go to $OUT (on the GPU machine, what comes back); without it to a temporary folder, never the checkout.
out=${OUT:-$(mktemp -d -t gpu-check.XXXXXX)}
mkdir -p "$out"
echo "tables in $out"
cpu=0
[[ "${1:-}" == "--cpu" || "${1:-}" == "--tiny" ]] && cpu=1
if [[ $cpu == 0 ]] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  "$PY" -c 'import platform, torch, transformers; print("python", platform.python_version(), "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  # The GPU machine's copy has no .git: the caller passes COMMIT (bench/gpu_prep.sh prints the call).
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nproc; [[ $cpu == 0 ]] && nvidia-smi -L
} 2>&1 | tee "$out/info.txt"
smol=.gpu/smollm2
if [[ $cpu == 1 ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  timeout 60 "$PY" bench/gpu_agree.py --device cpu --tiny --slots 8 --requests 16 --out "$out/agree.md" \
    || echo "agreement check failed, found a difference or timed out (exit $?)"
  timeout 30 "$PY" bench/gpu_static_bench.py --device cpu --tiny --sizes 1,4 --repeats 1 --new-tokens 8 \
    --out "$out/static.md" || echo "static bench failed or timed out (exit $?)"
  if [[ -f $smol/config.json ]]; then
    timeout 60 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors thread --rates 2 --duration 4 \
      --sizes 1,2 --repeats 1 --max-new-tokens 2 --start-timeout-s 50 --out "$out/server.md" \
      || echo "server bench failed or timed out (exit $?)"
  else
    echo "no $smol (run bash bench/gpu_prep.sh): server part skipped"
  fi
  timeout 60 "$PY" bench/cb_compare.py --random --tiny --device cpu --requests 10 --batch 4 --long 32 --cb-seqs 8 \
    --kv-tokens 2048 --skip-static --engines slots,manager --sampling ours --out "$out/cb.md" \
    || echo "continuous batching bench failed (exit $?)"
  exit 0
fi
[[ -f $smol/config.json ]] || echo "no $smol: carry .gpu (made by bash bench/gpu_prep.sh); the server part will fail"
IFS=, read -ra parts <<< "${PARTS:-agree,static,cb,server}"
[[ ${CB:-1} == 0 ]] && parts=(static server)  # CB=0: the continuous-batching part is skipped (older calls)
for part in "${parts[@]}"; do
  case $part in
    agree)  # tokens before timings: graphs and eager on CUDA against the CPU (exit 1: a request differs)
      timeout 60 "$PY" bench/gpu_agree.py --out "$out/agree.md" \
        || echo "agreement check failed, found a difference or timed out (exit $?)" ;;
    static)
      timeout 80 "$PY" bench/gpu_static_bench.py --sizes 100,64,1 --repeats 2 --out "$out/static.md" \
        || echo "static bench failed or timed out (exit $?)" ;;
    cb)  # steady state first (1,536 requests keep 256 slots full), then slots vs manager on 384
      timeout 40 "$PY" bench/cb_compare.py --random --device cuda --requests 1536 --batch 256 --skip-static \
        --engines slots --out "$out/cb-steady.md" || echo "steady continuous batching failed or timed out (exit $?)"
      timeout 70 "$PY" bench/cb_compare.py --random --device cuda --requests 384 --batch 64 --cb-seqs 256 \
        --kv-tokens 131072 --skip-static --engines slots,manager --cuda-graphs on --sampling ours \
        --out "$out/cb.md" || echo "continuous batching bench failed or timed out (exit $?)" ;;
    server)
      timeout 100 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors thread \
        --rates 100,200,300 --duration 6 --sizes 1,8,16,32,64,100 --repeats 2 \
        --max-new-tokens 64 --slo-ms 1000 --timeout-s 30 --start-timeout-s 60 --out "$out/server.md" \
        || echo "server bench failed or timed out (exit $?)" ;;
    cbhttp)  # generation end to end: a live server's /v1/completions on the model, 1,536 requests at once
      timeout 150 "$PY" -m bench.stepper_host --http --real-model "$smol" --repeats 1 --start-timeout-s 100 \
        --out "$out" || echo "continuous batching over HTTP failed or timed out (exit $?)" ;;
    process)  # the process executor alone at 300 requests/s (its start did not fit beside the thread rows)
      timeout 120 "$PY" -m bench.executor_bench --smollm2-dir "$smol" --executors process --rates 300 \
        --duration 6 --sizes 1,8,16,32,64,100 --repeats 2 --max-new-tokens 64 --slo-ms 1000 --timeout-s 30 \
        --start-timeout-s 90 --out "$out/process.md" || echo "process executor bench failed or timed out (exit $?)" ;;
    *) echo "unknown part $part (agree, static, cb, server, process, cbhttp)" ;;
  esac
done
