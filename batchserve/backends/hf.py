"""`--model [name=]PATH`: any Hugging Face model folder served by task, no code (docs/backends.md, "Any model
from a folder"). The backend name is `hf`; `folder.inspect_folder` says the task:

- embeddings -> `FolderEmbedder` (/v1/embeddings), pooled and normalised as its sentence-transformers config says;
- reranking -> `FolderReranker`, a cross-encoder scoring (query, document) pairs (`pair_input`) for /v1/rerank;
- classification -> `FolderClassifier` (/v1/classify, /predict), every class's `{label, score, logit}`;
- generation -> the smollm2 backend's code on the folder's weights (`SmolLM2Backend.from_source`), served by
  the generation engine (`generation_folder`).

Tokenize once: each input's tokens are made by `tokenize` (the door's tokenizer stage, on a worker thread, one
batch call for every queued text) and kept (`token_cache.py`, bounded in bytes), then read both to cost it on the
event loop (`cost_of`, `bucket_of`) and to run it on the device thread (`batch`); a text that missed the stage is
tokenized where first needed. The tokenizer never sees more than `tokenizer_guard.char_bound` characters of an
input (one it cannot cut safely is refused, 413).
"""

from __future__ import annotations

import bisect
import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from batchserve import errors
from batchserve.backends import default_threads, onnx_runtime, pick_devices
from batchserve.backends.folder import FolderError, FolderModel, ModelConfig, inspect_folder
from batchserve.backends.token_cache import CACHE_BYTES, Kept, TokenCache, Tokens, TooLong
from batchserve.backends.tokenizer_guard import (
    CHARS_PER_TOKEN,
    TokenizerRefused,
    char_bound,
    check_tokenizer,
    safe_cut,
    too_long,
)
from batchserve.config import ModelSpec, Settings

log = logging.getLogger("batchserve.hf")

LENGTH_CLASSES = (16, 32, 64, 128)  # bucket_of: token counts up to each bound share a queue; longer, the last
CPU_PASS_TOKENS = 1024  # padded tokens per forward pass on a CPU (as minilm)
GPU_PASS_TOKENS = 65536
WARM_TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, again and again.",
    "Embeddings map text to vectors.",
] * 4


def finite(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else 0.0 for v in values]


def pair_input(query: str, document: str) -> str:
    """One reranker input: the pair as a JSON array of two strings (one text through the door, any content)."""
    return orjson.dumps([query, document]).decode()


def json_strings(text: str) -> list[str] | None:
    """The strings of the JSON array of strings an input spells, or None when it spells none."""
    if not text.startswith("["):
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def passes(order: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Split inputs sorted by length into forward passes of at most `budget` padded tokens each."""
    out: list[list[int]] = []
    for i in order:
        if not out or (len(out[-1]) + 1) * lengths[i] > budget:
            out.append([])
        out[-1].append(i)
    return out


@dataclass
class TokenModel:
    """What the folder models share: tokens kept per text, costs and buckets read from them, forward passes of
    like lengths, one model replica per device."""

    info: FolderModel
    devices: list[str]  # the plugin contract's device names
    threads: int = 0
    pass_tokens: int = 0
    group_by_length: bool = True
    chars_per_token: int = CHARS_PER_TOKEN  # an input is cut at max_tokens x this many characters before tokenizing
    cache_bytes: int = CACHE_BYTES  # the kept tokens' budget (token_cache.py)
    tokenizer: Any = None
    models: dict[str, Any] = field(default_factory=dict)
    tokenized_on_demand: int = 0  # texts tokenized outside the stage (the warm-up, a cache miss): for tests and logs
    onnx: onnx_runtime.OnnxPlan | None = None  # --runtime onnx: ONNX Runtime on the CPU in place of torch

    def __post_init__(self) -> None:
        try:  # truncation fixed once, so threads may encode with it at once
            self.tokenizer = check_tokenizer(self.info.path)
        except TokenizerRefused as exc:
            raise RuntimeError(str(exc)) from None
        self.tokenizer.enable_truncation(self.info.max_tokens, strategy="longest_first")
        self.kept = TokenCache(self.cache_bytes)  # text -> its tokens (or why it is refused)
        self.max_chars = char_bound(self.info.max_tokens, self.chars_per_token)
        self._types = False  # whether the model's forward takes token_type_ids (set in setup)

    # -- tokens ------------------------------------------------------------------------------------------
    def encode_many(self, texts: list[str]) -> list[Any]:
        return self.tokenizer.encode_batch([self.cut(t) for t in texts])

    def cut(self, text: str) -> str:
        """The text as the tokenizer is given it: its first `max_chars`, lowered for a `do_lower_case` embedder."""
        text = text if len(text) <= self.max_chars else text[: self.max_chars]
        return text.lower() if self.info.lower_case else text

    def whole(self, text: str, encoding: Any) -> bool:
        """Whether `encoding` holds the text's own first tokens: it was not cut, or the cut is safe."""
        return len(text) <= self.max_chars or safe_cut(encoding)

    def make(self, texts: list[str]) -> list[Kept]:
        """Each text's tokens, or a TooLong when its cut is not provably safe. Only ids and type ids are kept: an
        encoding holds every overflowing window of a long input."""
        return [
            Tokens(text, list(enc.ids), list(enc.type_ids))
            if self.whole(text, enc)
            else TooLong(text, too_long(len(text), self.max_chars, self.info.max_tokens))
            for text, enc in zip(texts, self.encode_many(texts))
        ]

    def tokenize(self, texts: list[str]) -> None:
        """The tokenizer stage (a worker thread): make what is not kept yet in one batch call, and keep it."""
        todo = list(dict.fromkeys(t for t in texts if t not in self.kept))
        if not todo:
            return
        for text, made in zip(todo, self.make(todo)):
            self.kept.put(text, made)

    def encoding(self, text: str) -> Tokens:
        """The text's kept tokens (made now on a miss); 413 for one too long to cut safely."""
        found = self.kept.get(text)
        if found is None:
            self.tokenized_on_demand += 1
            found = self.make([text])[0]
            self.kept.put(text, found)
        if isinstance(found, TooLong):
            raise errors.payload_too_large(found.message)
        return found

    def tokens(self, text: str) -> int:
        return len(self.encoding(text).ids)

    def cost_of(self, text: str) -> float:
        return float(self.tokens(text))

    def padded_cost(self, texts: list[str]) -> float:
        return float(len(texts) * max((self.tokens(t) for t in texts), default=1))

    def bucket_of(self, text: str) -> int:
        return bisect.bisect_left(LENGTH_CLASSES, self.tokens(text)) if self.group_by_length else 0

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [self.tokens(t) for t in texts]

    # -- device ------------------------------------------------------------------------------------------
    def load(self, device: str, dtype: Any) -> Any:
        raise NotImplementedError

    def setup(self, device: str) -> None:
        if self.onnx is not None:  # the graph takes the token type ids it has (onnx_runtime.OnnxModel)
            self._types = True
            self.models[device] = onnx_runtime.load(self.onnx, self, device)
            return
        import torch

        if device == "cpu":
            torch.set_num_threads(self.threads or default_threads())
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        model = self.load(device, dtype).to(device).eval()
        self._types = "token_type_ids" in inspect.signature(model.forward).parameters
        self.models[device] = model

    def head(self, outputs: Any, attention: Any, lengths: list[int]) -> list[Any]:
        """A forward pass's outputs as one value per row: the embedder's vectors, the reranker's scores, ..."""
        raise NotImplementedError

    def warm(self, device: str) -> dict[int, float]:
        """Two batches of different token counts, timed by batch cost."""
        timings: dict[int, float] = {}
        for texts in (self.warm_inputs()[:3], self.warm_inputs()):
            started = time.perf_counter()
            self.batch(texts, device)
            timings[round(self.padded_cost(texts))] = time.perf_counter() - started
        return timings

    def warm_inputs(self) -> list[str]:
        return list(WARM_TEXTS)

    def probe_inputs(self) -> list[str]:
        """The inputs an int8 graph is checked on against fp32 (onnx_runtime.check_int8)."""
        return list(onnx_runtime.PROBE_TEXTS)

    def batch(self, inputs: list[str], device: str) -> list[Any]:
        """`inputs` in forward passes of like lengths on `device`, each pass's outputs made one value per row by
        `head`; the values in input order."""
        import torch

        model = self.models[device]
        encodings = [self.encoding(t) for t in inputs]
        lengths = [max(1, len(e.ids)) for e in encodings]
        order = sorted(range(len(inputs)), key=lengths.__getitem__)
        budget = self.pass_tokens or (GPU_PASS_TOKENS if device.startswith("cuda") else CPU_PASS_TOKENS)
        out: list[Any] = [None] * len(inputs)
        with torch.inference_mode():
            for rows in passes(order, lengths, budget):
                width = lengths[rows[-1]]
                kept = [encodings[i] for i in rows]
                sizes = [len(e.ids) for e in kept]
                pads = [[0] * (width - n) for n in sizes]
                kwargs = {
                    "input_ids": torch.tensor([e.ids + pad for e, pad in zip(kept, pads)], device=device),
                    "attention_mask": torch.tensor([[1] * n + pad for n, pad in zip(sizes, pads)], device=device),
                }
                if self._types:
                    kwargs["token_type_ids"] = torch.tensor(
                        [e.type_ids + pad for e, pad in zip(kept, pads)], device=device
                    )
                values = self.head(model(**kwargs), kwargs["attention_mask"], sizes)
                for i, value in zip(rows, values):
                    out[i] = value
        return out


@dataclass
class FolderEmbedder(TokenModel):
    """A sentence-transformers embedder from its folder: `output_kind = "embedding"` (/v1/embeddings)."""

    output_kind: str = "embedding"

    def load(self, device: str, dtype: Any) -> Any:
        from transformers import AutoModel

        return AutoModel.from_pretrained(str(self.info.path), dtype=dtype)

    def head(self, outputs: Any, attention: Any, lengths: list[int]) -> list[list[float]]:
        import torch

        hidden = outputs.last_hidden_state.float()
        mode = self.info.pooling.mode
        weights = attention.unsqueeze(-1).to(hidden.dtype)
        if mode == "cls":
            pooled = hidden[:, 0]
        elif mode == "lasttoken":
            pooled = hidden[torch.arange(hidden.shape[0]), torch.tensor(lengths, device=hidden.device) - 1]
        elif mode == "max":
            pooled = hidden.masked_fill(weights == 0, -1e9).max(1).values
        else:
            summed = (hidden * weights).sum(1)
            count = weights.sum(1).clamp(min=1e-9)
            pooled = summed / (count.sqrt() if mode == "mean_sqrt_len_tokens" else count)
        if self.info.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().tolist()


@dataclass
class SequenceModel(TokenModel):
    """Cross-encoders and classifiers (`AutoModelForSequenceClassification`): each input one text or a
    `pair_input` pair, tokenized as the tokenizer's pair with each side cut alone."""

    output_kind: str = "json"
    singles = False  # (not a field) a classifier reads a JSON array of one string (`single_input`) as that string

    def sides(self, text: str) -> tuple[str, str] | str:
        """The (query, document) an input spells (`pair_input`), or the text itself when it is no pair."""
        strings = json_strings(text)
        if strings is not None and len(strings) == 2:
            return strings[0], strings[1]
        return strings[0] if strings is not None and len(strings) == 1 and self.singles else text

    def encode_many(self, texts: list[str]) -> list[Any]:
        """Each input as the pair it spells (`sides`), else as one text (a /v1/inference input, the warm-up)."""
        inputs: list[Any] = []
        for text in texts:
            seq = self.sides(text)
            inputs.append(self.cut(seq) if isinstance(seq, str) else (self.cut(seq[0]), self.cut(seq[1])))
        return self.tokenizer.encode_batch(inputs)

    def whole(self, text: str, encoding: Any) -> bool:
        """A pair's sides are cut alone, so each long side is checked on its own encoding (tokenizer_guard)."""
        seq = self.sides(text)
        if isinstance(seq, str):
            return super().whole(seq, encoding)
        long = [self.cut(side) for side in seq if len(side) > self.max_chars]
        return not long or all(safe_cut(e) for e in self.tokenizer.encode_batch(long))

    def activated(self, logits: Any) -> Any:
        """The logits through the folder's activation (`folder.reranker_activation`, `classifier_activation`)."""
        if self.info.activation == "softmax":
            return logits.softmax(-1)
        return logits.sigmoid() if self.info.activation == "sigmoid" else logits

    def load(self, device: str, dtype: Any) -> Any:
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification.from_pretrained(str(self.info.path), dtype=dtype)


@dataclass
class FolderReranker(SequenceModel):
    """A cross-encoder: each output the score CrossEncoder.predict gives (sigmoid of the logit by default)."""

    def warm_inputs(self) -> list[str]:
        return [pair_input("what is a vector?", t) for t in WARM_TEXTS]

    def probe_inputs(self) -> list[str]:
        """Each probe text paired with others (queries and documents of varied relevance)."""
        texts = onnx_runtime.PROBE_TEXTS
        return [pair_input(q, texts[(i * 7 + k) % len(texts)]) for i, q in enumerate(texts) for k in (0, 3)]

    def head(self, outputs: Any, attention: Any, lengths: list[int]) -> list[float]:
        return finite(self.activated(outputs.logits.float()[:, 0]).cpu().tolist())


def single_input(text: str) -> str:
    """One classifier input of one text: the text, or a one-string JSON array when it could read as a pair."""
    return orjson.dumps([text]).decode() if text.startswith("[") else text


def class_labels(config: ModelConfig | None, count: int) -> list[str]:
    """Class names in logit order: `id2label` (keyed by strings in config.json), else transformers' `LABEL_i`."""
    names = (config.id2label if config is not None else None) or {}
    return [str(names.get(str(i), f"LABEL_{i}")) for i in range(count)]


@dataclass
class FolderClassifier(SequenceModel):
    """A sequence classifier: each input a text (`single_input`) or a pair (`pair_input`), its output every
    class's `{label, score, logit}` in label order, scored as transformers' text-classification pipeline does
    (`folder.classifier_activation`)."""

    singles = True

    def head(self, outputs: Any, attention: Any, lengths: list[int]) -> list[list[dict[str, Any]]]:
        logits = outputs.logits.float()
        names = class_labels(self.info.config, logits.shape[-1])
        return [
            [{"label": name, "score": s, "logit": x} for name, s, x in zip(names, finite(row), finite(raw))]
            for row, raw in zip(self.activated(logits).cpu().tolist(), logits.cpu().tolist())
        ]


def model_of(spec: ModelSpec) -> FolderModel:
    try:
        return inspect_folder(spec.path, spec.task)
    except FolderError as exc:
        raise RuntimeError(str(exc)) from None


class HFModel:
    """The `hf` backend: builds the task's backend for the folder a [[models]] `path` (or `--model`) names."""

    @classmethod
    def from_settings(cls, spec: ModelSpec, settings: Settings) -> object:
        info = model_of(spec)
        options = {"threads": settings.torch_threads, **spec.options}
        devices = pick_devices(settings.devices)
        tasks = {"embeddings": FolderEmbedder, "reranking": FolderReranker, "classification": FolderClassifier}
        made: type[TokenModel] | None = tasks.get(info.task)
        if made is None:  # generation
            from batchserve.backends.smollm2 import SmolLM2Backend

            return SmolLM2Backend.from_source(str(info.path), settings)
        if settings.runtime == "onnx":
            options["onnx"] = onnx_runtime.plan_of(settings, devices)
        return made(info, devices, **options)

    @classmethod
    def shell(cls, settings: Settings, spec: ModelSpec) -> object:
        """The server's side of a model whose batches run elsewhere: a generation folder (the engine's stepper
        runs it), or the tokenizer side of an embedder or reranker (`--executor process`)."""
        if spec.task != "generation":
            return cls.from_settings(spec, settings)
        from batchserve.backends.smollm2 import SmolLM2Backend

        return SmolLM2Backend(devices=pick_devices(settings.devices), max_new_tokens=settings.max_new_tokens)


def generation_folder(settings: Settings) -> str:
    """The folder the generation engine serves: a `--model` folder, else `smollm2.source_dir`; "" when there is
    none (the engine then reads SmolLM2's GGUF)."""
    for spec in settings.models:
        if spec.backend == "hf" and spec.task == "generation":
            return spec.path
    from batchserve.backends.smollm2 import source_dir

    return source_dir(settings)


def folder_spec(arg: str, task: str = "") -> ModelSpec:
    """`--model [name=]PATH` as a model version: named `name`, else after the folder's last part."""
    name, sep, path = arg.partition("=")
    if not sep or "/" in name or not name:
        name, path = "", arg
    name = name or Path(path.rstrip("/")).name or "model"
    return ModelSpec(name, backend="hf", path=path, task=task)


def resolve_folders(settings: Settings) -> None:
    """Read each folder model's folder now (cheap: its JSON files): its task and its real path are fixed on the
    spec, and a folder that cannot be served raises ValueError (one line; the CLI exits 2 before the port
    opens). The generation endpoints take the generation folder's name unless --generation-model was given."""
    generators = []
    for spec in settings.models:
        if spec.backend != "hf":
            continue
        try:
            info = inspect_folder(spec.path, spec.task)
            check_tokenizer(info.path)  # a tokenizer that makes too much of a probe input is refused here
        except (FolderError, TokenizerRefused) as exc:
            raise ValueError(f"model {spec.name}: {exc}") from None
        spec.path, spec.task = str(info.path), info.task
        log.info("model %s: %s from %s (%s)", spec.name, info.task, info.path, info.architecture or info.model_type)
        if info.task == "generation":
            generators.append(spec)
    if len(generators) > 1:
        raise ValueError(
            f"models {', '.join(s.name for s in generators)}: one generation model per server (the "
            f"generation engine runs one)"
        )
    if any(s.backend == "smollm2" for s in settings.models) and generators:
        raise ValueError(f"model {generators[0].name}: one generation model per server, and smollm2 is served too")
    if generators and "generation_model" not in settings.given:
        settings.generation_model = generators[0].name
