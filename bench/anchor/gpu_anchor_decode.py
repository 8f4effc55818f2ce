# The measuring stick for the real model's batch time on a GPU (issue 13): a decode loop written apart from
# batchserve, kept unchanged below this header so its figures stay comparable across runs. Do not edit it.
# bench/gpu_static_bench.py imports MiniLlama/run_mini from here; bench/gpu_check.sh runs it beside our decoder.

"""Anchor for the real-model batch time on a GPU: how long one batch of B prompts x N greedy new tokens takes
on SmolLM2-135M's architecture (random weights, bf16), three ways, on the same machine in one run:

  hf       transformers `generate` (what the project's smollm2 backend calls)
  eager    a minimal Llama decode loop with a static KV cache, plain PyTorch ops
  graph    the same decode step captured once in a CUDA graph and replayed N times

The graph row is the practical floor a batchstring on this model can reach without custom kernels.
Prints one JSON line per row and a markdown table.
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

H, L, NH, NKV, D, I, V, THETA = 576, 30, 9, 3, 64, 1536, 49152, 100000.0


def rms(x, w, eps=1e-5):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * w


class MiniLlama:
    def __init__(self, dev, dtype, B, Lmax):
        g = torch.Generator(device="cpu").manual_seed(0)

        def p(*shape):
            return (torch.randn(*shape, generator=g) * 0.02).to(dev, dtype)

        self.emb = p(V, H)
        self.layers = []
        for _ in range(L):
            self.layers.append(dict(
                ln1=torch.ones(H, device=dev, dtype=dtype), ln2=torch.ones(H, device=dev, dtype=dtype),
                qkv=p(H, (NH + 2 * NKV) * D), o=p(NH * D, H), gu=p(H, 2 * I), down=p(I, H)))
        self.norm = torch.ones(H, device=dev, dtype=dtype)
        inv = 1.0 / (THETA ** (torch.arange(0, D, 2, device=dev).float() / D))
        t = torch.arange(Lmax, device=dev).float()
        fr = torch.outer(t, inv)
        emb = torch.cat([fr, fr], -1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.k = [torch.zeros(B, NKV, Lmax, D, device=dev, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(B, NKV, Lmax, D, device=dev, dtype=dtype) for _ in range(L)]
        self.ar = torch.arange(Lmax, device=dev)
        self.Lmax = Lmax

    @staticmethod
    def rope(x, cos, sin):
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, ids, pos):
        """ids [B, T]; pos: LongTensor [T] of absolute positions. Writes K/V at pos; returns logits of last token."""
        B, T = ids.shape
        x = F.embedding(ids, self.emb)
        cos = self.cos.index_select(0, pos)[None, None]
        sin = self.sin.index_select(0, pos)[None, None]
        if T == 1:
            mask = (self.ar <= pos[0])[None, None, None, :]
        else:
            mask = (self.ar[None, :] <= pos[:, None])[None, None]
        for i, ly in enumerate(self.layers):
            h = rms(x, ly["ln1"])
            qkv = h @ ly["qkv"]
            q, k, v = qkv.split([NH * D, NKV * D, NKV * D], -1)
            q = q.view(B, T, NH, D).transpose(1, 2)
            k = k.view(B, T, NKV, D).transpose(1, 2)
            v = v.view(B, T, NKV, D).transpose(1, 2)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, NH * D) @ ly["o"]
            h = rms(x, ly["ln2"])
            g, u = (h @ ly["gu"]).chunk(2, -1)
            x = x + (F.silu(g) * u) @ ly["down"]
        x = rms(x[:, -1], self.norm)
        return x @ self.emb.t()


def run_mini(dev, dtype, B, P, N, graph, reps):
    m = MiniLlama(dev, dtype, B, P + N + 1)
    prompt = torch.randint(3, V, (B, P), device=dev)
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    out = torch.zeros(B, N, dtype=torch.long, device=dev)
    step = torch.zeros(1, dtype=torch.long, device=dev)

    def decode_step():
        logits = m.forward(ids, pos)
        tok = logits.argmax(-1)
        out.index_copy_(1, step, tok[:, None])
        ids.copy_(tok[:, None])
        pos.add_(1)
        step.add_(1)

    g = None
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                pos.fill_(P); step.zero_(); decode_step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        pos.fill_(P); step.zero_()
        with torch.cuda.graph(g):
            decode_step()

    def once():
        logits = m.forward(prompt, torch.arange(P, device=dev))
        ids.copy_(logits.argmax(-1)[:, None])
        pos.fill_(P); step.zero_()
        for _ in range(N):
            if g is not None:
                g.replay()
            else:
                decode_step()
        torch.cuda.synchronize()

    with torch.inference_mode():
        once()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); once(); times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_hf(dev, dtype, B, P, N, reps):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=NKV,
                      intermediate_size=I, vocab_size=V, tie_word_embeddings=True, rope_theta=THETA,
                      max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev, dtype).eval()
    ids = torch.randint(3, V, (B, P), device=dev)
    att = torch.ones_like(ids)

    def once():
        model.generate(input_ids=ids, attention_mask=att, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       pad_token_id=2)
        torch.cuda.synchronize()

    with torch.inference_mode():
        once()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter(); once(); times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,32,100,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        r = {"B": B, "prompt": a.prompt, "new": a.new}
        r["graph_ms"] = 1000 * run_mini(dev, dtype, B, a.prompt, a.new, True, a.reps)
        r["eager_ms"] = 1000 * run_mini(dev, dtype, B, a.prompt, a.new, False, a.reps)
        if not a.skip_hf:
            r["hf_ms"] = 1000 * run_hf(dev, dtype, B, a.prompt, a.new, a.reps)
        print(json.dumps(r), flush=True)
        rows.append(r)
    print("| batch | hf generate ms | eager static-cache ms | CUDA graph ms | hf / graph | graph tokens/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        hf = r.get("hf_ms", math.nan)
        print(f"| {r['B']} | {hf:.1f} | {r['eager_ms']:.1f} | {r['graph_ms']:.1f} | {hf / r['graph_ms']:.1f}x | "
              f"{r['B'] * r['new'] / r['graph_ms'] * 1000:.0f} |")


if __name__ == "__main__":
    main()
