"""Static vs continuous batching on one model and one mixed workload. Needs only torch and transformers.

Why: a static batch runs until its longest member is done, so a short reply waits for the longest one in its
batch and a finished sequence frees nothing. Continuous batching (transformers' `ContinuousBatchingManager`)
schedules per step. This measures both on the same requests: output tokens/s and the short requests' p50 latency.

Workload: `requests` requests arrive together (t = 0), in a fixed shuffled order; 80 % ask for 16 tokens and 20 %
for 256 (exactly, EOS ignored), all over prompts of the same length. Static: batches of `batch` in arrival
order, each a greedy `generate` running to its longest member (the others are cut to their own length); a
request's latency is its batch's end. Continuous: every request is queued at t = 0 with its own max_new_tokens,
at most `batch` sequences at once (the same concurrency, so the same KV memory) unless --cb-seqs says otherwise.

Needs only torch and transformers (and, with `--sampling ours`, this repository's batchserve package): the GPU
check runs it with a LlamaForCausalLM of SmolLM2-135M's exact architecture and random weights (`--random`),
prompts of random ids.

    python bench/cb_compare.py --random --device cuda --requests 320 --batch 64 --out result.md
    python bench/cb_compare.py --random --tiny          # a CPU smoke test, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

SMOLLM2_135M = dict(  # HuggingFaceTB/SmolLM2-135M-Instruct
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
TINY_VOCAB = 4096  # random_model(vocab=...): the token-for-token checks on the CPU (tests, gpu_agree --tiny)


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]  # per request, in arrival order
    short: int
    long: int

    @classmethod
    def mixed(
        cls, prompts: list[list[int]], short: int = 16, long: int = 256, long_share: float = 0.2, seed: int = 0
    ) -> Workload:
        n = len(prompts)
        n_long = round(n * long_share)
        lengths = [long] * n_long + [short] * (n - n_long)
        random.Random(seed).shuffle(lengths)
        return cls(prompts, lengths, short, long)

    @property
    def tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Result:
    mode: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    latencies: list[float] = field(repr=False)
    max_tokens: list[int] = field(repr=False)
    short: int = 16
    ttft: list[float] = field(default_factory=list, repr=False)  # slots: each request's first token, from t = 0
    graphs: int = 0  # slots: CUDA graphs captured
    step_ms: float = float("nan")  # slots: a step of every slot at warm-up

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def p50(self, which: str) -> float:
        picked = [lat for lat, mt in zip(self.latencies, self.max_tokens) if (mt == self.short) == (which == "short")]
        return statistics.median(picked) if picked else float("nan")

    def row(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "short_p50_s": round(self.p50("short"), 3),
            "long_p50_s": round(self.p50("long"), 3),
            "ttft_p50_s": round(statistics.median(self.ttft), 3) if self.ttft else "",
            "ttft_p95_s": round(statistics.quantiles(self.ttft, n=20)[-1], 3) if len(self.ttft) > 1 else "",
            "graphs": self.graphs,
            "full_step_ms": round(self.step_ms, 2),
        }


def random_model(
    device: str, dtype: torch.dtype, tiny: bool = False, layers: int | None = None, vocab: int | None = None
) -> Any:
    """SmolLM2-135M's architecture (or TINY's) with random weights. `vocab`: fewer tokens than SmolLM2's 49,152,
    for the decoders' CPU checks (TINY_VOCAB): a 64-wide model spends most of a step on the vocabulary's logits,
    argmax and nucleus sort, which take the same code path at any size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    arch = {**SMOLLM2_135M, **(TINY if tiny else {})}
    if layers:
        arch["num_hidden_layers"] = layers
    if vocab:
        arch["vocab_size"] = vocab
    torch.manual_seed(0)
    config = LlamaConfig(**arch)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    for p in model.parameters():  # keep random logits from saturating: small weights, well-spread argmax
        p.data.normal_(0, 0.02)
    return model


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run_static(model: Any, work: Workload, batch: int, pad_id: int) -> Result:
    """Batches in arrival order; each runs to its longest member (the batchstring path's `generate`)."""
    device = str(model.device)
    latencies = [0.0] * len(work.prompts)
    started = time.perf_counter()
    for lo in range(0, len(work.prompts), batch):
        idx = list(range(lo, min(lo + batch, len(work.prompts))))
        width = max(len(work.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding: generation continues from the right edge
            p = work.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        longest = max(work.max_tokens[i] for i in idx)
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad_id,
        )
        sync(device)
        done = time.perf_counter() - started
        for i in idx:
            latencies[i] = done
    seconds = time.perf_counter() - started
    return Result("static", batch, len(work.prompts), work.tokens, seconds, latencies, work.max_tokens, work.short)


def tristate(value: str) -> bool | None:
    return {"on": True, "off": False}.get(value)


def make_manager(
    model: Any,
    max_seqs: int,
    page_size: int,
    kv_tokens: int,
    max_batch_tokens: int | None,
    cuda_graphs: str = "auto",
    async_batching: str = "auto",
    sampling: str = "library",
) -> Any:
    """`cuda_graphs`/`async_batching`: on, off or auto (the library decides); `sampling`: library (plain greedy)
    or ours (batchserve's per-request processors, sync-free on CUDA: what the server's engine runs)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=-1, pad_token_id=0)
    # transformers >= 5.18 calls it page_size (block_size before); the GPU machine may hold either
    size_field = (
        "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"
    )
    cb = ContinuousBatchingConfig(
        **{size_field: page_size},
        num_blocks=-(-kv_tokens // page_size) if kv_tokens else None,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs,
        safety_margin=0.0,
        max_memory_percent=None if model.device.type == "cpu" else 0.5,
        **({"use_cuda_graph": tristate(cuda_graphs)} if cuda_graphs != "auto" else {}),
        **({"use_async_batching": tristate(async_batching)} if async_batching != "auto" else {}),
        **({"per_request_processors": True} if sampling == "ours" else {}),
    )
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    if sampling == "ours":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from batchserve.decoding import sampling as ours

        manager.logit_processor = ours.processors(sync_free=model.device.type != "cpu")
    manager.warmup()
    return manager


def run_continuous(
    model: Any,
    work: Workload,
    max_seqs: int,
    page_size: int = 64,
    kv_tokens: int = 0,
    max_batch_tokens: int | None = None,
    **options: str,
) -> Result:
    """Every request queued at t = 0 with its own max_new_tokens; at most `max_seqs` decode at once.

    Not under inference_mode: transformers 5.17 (the GPU machine's) builds tensors in warmup() that its thread,
    outside inference mode, then updates in place; the library applies no_grad itself."""
    manager = make_manager(model, max_seqs, page_size, kv_tokens, max_batch_tokens, **options)
    manager.start()
    try:
        warm = manager.add_request(work.prompts[0], request_id="warm", max_new_tokens=4, eos_token_id=-1)
        while not ((r := manager.get_result(warm, timeout=1)) and r.is_finished()):
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread died (see its log above)")
        order = {f"r{i}": i for i in range(len(work.prompts))}
        latencies = [0.0] * len(work.prompts)
        tokens = 0
        started = time.perf_counter()
        for rid, i in order.items():
            manager.add_request(work.prompts[i], request_id=rid, max_new_tokens=work.max_tokens[i], eos_token_id=-1)
        left = len(order)
        while left:
            out = manager.get_result(timeout=1)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous batching thread died (see its log above)")
                continue
            if out.request_id in order and out.is_finished():
                if out.error:
                    raise RuntimeError(f"{out.request_id} failed: {out.error}")
                latencies[order[out.request_id]] = time.perf_counter() - started
                tokens += len(out.generated_tokens)
                left -= 1
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=30)
    return Result("manager", max_seqs, len(order), tokens, seconds, latencies, work.max_tokens, work.short)


def run_slots(
    model: Any,
    work: Workload,
    max_seqs: int,
    max_context: int = 2048,
    max_prefill_tokens: int = 0,
    cuda_graphs: str = "auto",
) -> Result:
    """batchserve's slot stepper (the server's default generation engine) on the same requests: every request
    handed to the stepper at t = 0, at most `max_seqs` in slots at once, tokens delivered to an event loop."""
    import asyncio

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from batchserve.decoding.slot_decoder import SlotDecoder
    from batchserve.decoding.slot_stepper import SlotStepper
    from batchserve.decoding.stepper import SamplingParams, TokenUpdate

    on_gpu = model.device.type == "cuda"
    graphs = on_gpu and cuda_graphs != "off"
    slot_tokens = max(max_context, max(map(len, work.prompts)) + max(work.max_tokens))
    started = time.perf_counter()
    decoder = SlotDecoder(
        model,
        max_seqs,
        slot_tokens,
        eos_ids=[],
        pad_id=0,
        use_graphs=graphs,
        prefill_tokens=max_prefill_tokens or (8192 if on_gpu else 512),
    )
    step_s = decoder.warm()
    graphs_made = len(decoder.graphs) + len(decoder.prefill_graphs) + len(decoder.chunk_graphs)
    print(
        f"slots: {max_seqs} x {slot_tokens} tokens, {graphs_made} graphs captured in "
        f"{time.perf_counter() - started:.1f} s, a full step {step_s * 1000:.2f} ms",
        flush=True,
    )
    stepper = SlotStepper(decoder, step_s)
    latencies = [0.0] * len(work.prompts)
    first_token = [0.0] * len(work.prompts)
    counted = [0]

    async def main() -> float:
        done = asyncio.Event()
        left = [len(work.prompts)]

        def deliver(updates: list[TokenUpdate]) -> None:
            now = time.perf_counter()
            for u in updates:
                if u.error:
                    raise RuntimeError(f"{u.seq_id} failed: {u.error}")
                if u.tokens and not first_token[int(u.seq_id)]:
                    first_token[int(u.seq_id)] = now - t0
                counted[0] += len(u.tokens)
                if u.finished:
                    latencies[int(u.seq_id)] = now - t0
                    left[0] -= 1
            if not left[0]:
                done.set()

        stepper.start(asyncio.get_running_loop(), deliver)
        t0 = time.perf_counter()
        for i, prompt in enumerate(work.prompts):
            stepper.add(str(i), prompt, SamplingParams(max_tokens=work.max_tokens[i], temperature=0, ignore_eos=True))
        await done.wait()
        return time.perf_counter() - t0

    try:
        seconds = asyncio.run(main())
    finally:
        stepper.stop(30)
    if counted[0] != work.tokens:
        raise RuntimeError(f"{counted[0]} tokens came back, {work.tokens} were asked for")
    return Result(
        "slots",
        max_seqs,
        len(work.prompts),
        counted[0],
        seconds,
        latencies,
        work.max_tokens,
        work.short,
        first_token,
        graphs_made,
        step_s * 1000,
    )


def markdown(rows: list[dict[str, Any]], base: dict[str, Any]) -> str:
    first = "static" if base["mode"] == "static" else "first row"
    head = [
        "mode",
        "concurrency",
        "requests",
        "output_tokens",
        "seconds",
        "tokens_per_s",
        "short_p50_s",
        "long_p50_s",
        "ttft_p50_s",
        "ttft_p95_s",
        "full_step_ms",
        f"tokens/s vs {first}",
        f"short p50 {first} / this",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        speed = r["tokens_per_s"] / base["tokens_per_s"]
        short = base["short_p50_s"] / r["short_p50_s"] if r["short_p50_s"] else float("nan")
        lines.append("| " + " | ".join(str(r.get(h, "")) for h in head[:-2]) + f" | {speed:.2f}x | {short:.2f}x |")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import subprocess

        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info["commit"] = info.get("commit") or os.environ.get("COMMIT", "")  # the GPU machine's copy has no .git
    return info


def save(out: str, header: str, rows: list[dict[str, Any]], info: dict[str, Any], settings: dict[str, Any]) -> None:
    """The table as markdown at `out` and the rows as JSON beside it (nothing when `out` is empty)."""
    if not out:
        return
    with open(out, "w") as f:
        f.write(
            header
            + "\n"
            + markdown(rows, rows[0])
            + "\n\n```\n"
            + json.dumps({"machine": info, "settings": settings}, indent=1, default=str)
            + "\n```\n"
        )
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"machine": info, "settings": settings, "rows": rows}, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", action="store_true", help="SmolLM2-135M architecture, random weights (required)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model: a smoke test")
    ap.add_argument("--layers", type=int, default=0, help="override the number of layers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="", help="bfloat16 on CUDA, float32 on CPU by default")
    ap.add_argument("--requests", type=int, default=320)
    ap.add_argument("--batch", type=int, default=64, help="static batch size, and continuous max sequences")
    ap.add_argument("--cb-seqs", default="", help="extra continuous rows with these max sequences, e.g. 256")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--short", type=int, default=16)
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-tokens", type=int, default=0, help="KV-cache capacity (0 = the library sizes it)")
    ap.add_argument("--out", default="", help="also write the table (markdown) and a .json beside it")
    ap.add_argument("--skip-static", action="store_true", help="continuous rows only (ratios to the first)")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--async-batching", default="auto", choices=("auto", "on", "off"))
    ap.add_argument(
        "--sampling",
        default="library",
        choices=("library", "ours"),
        help="manager: ours = batchserve's per-request sampling processors (as --generation-engine manager runs them)",
    )
    ap.add_argument(
        "--engines",
        default="manager",
        help="continuous rows to run, in order: slots (batchserve's slot stepper, the server's "
        "default) and/or manager (transformers'), e.g. slots,manager",
    )
    ap.add_argument("--max-context", type=int, default=2048, help="slots: tokens per slot (the server's default)")
    args = ap.parse_args(argv)
    if not args.random:
        ap.error("only --random is supported here (bench/generation_bench.py runs the real weights)")
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    model = random_model(args.device, dtype, tiny=args.tiny, layers=args.layers or None)
    prompts = random_prompts(args.requests, args.prompt_len, model.config.vocab_size)
    work = Workload.mixed(prompts, args.short, args.long)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings["architecture"] = {
        k: getattr(model.config, k)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
        )
    }
    header = (
        f"Static vs continuous batching, {args.requests} requests (80 % x {args.short} tokens, 20 % x "
        f"{args.long}), prompts of {args.prompt_len} random ids, random weights, {args.device} {dtype}\n"
    )
    info = machine()
    results = []
    if not args.skip_static:
        # warm the static path once (kernels, allocator) so neither mode pays start-up in its timing
        run_static(model, Workload.mixed(prompts[: min(4, len(prompts))], 2, 2), 4, pad_id=0)
        results.append(run_static(model, work, args.batch, pad_id=0).row())
        print(f"static: {results[-1]}", flush=True)
        save(args.out, header, results, info, settings)
    options = {"cuda_graphs": args.cuda_graphs, "async_batching": args.async_batching, "sampling": args.sampling}
    for engine in args.engines.split(","):
        for seqs in [args.batch, *(int(s) for s in args.cb_seqs.split(",") if s)]:
            if engine == "slots":
                result = run_slots(model, work, seqs, args.max_context, cuda_graphs=args.cuda_graphs)
            elif engine == "manager":
                result = run_continuous(
                    model, work, seqs, page_size=args.page_size, kv_tokens=args.kv_tokens, **options
                )
            else:
                ap.error(f"unknown engine {engine!r} (slots or manager)")
            results.append(result.row())
            print(f"{engine}: {results[-1]}", flush=True)
            save(args.out, header, results, info, settings)  # after every row: a timeout leaves the rows so far
            del result
            gc.collect()  # the last row's slot cache and graph pool go before the next row's (KV of 1,024 slots
            if torch.cuda.is_available():  # of 2,048 tokens is 48 GB: two rows' at once would not fit an H100)
                torch.cuda.empty_cache()
    print("\n" + header + "\n" + markdown(results, results[0]) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
