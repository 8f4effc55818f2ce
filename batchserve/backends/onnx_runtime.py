"""ONNX Runtime for the encoder models (`--runtime onnx`, `--quantize int8`; docs/backends.md): embedder,
reranker and classifier folders and minilm run their transformer as an ONNX graph on the CPU instead of torch.

- Exported once into the weights cache under `onnx/<key>/`, the key a hash of the folder's content and the task,
  so a copy of the folder reuses it and changed weights export anew. Torch's legacy exporter (`dynamo=False`:
  it needs only the `onnx` package), dynamic axes, checked against torch once when made.
- The graph ends where the model's own code ends (`last_hidden_state` or `logits`); pooling and scoring stay the
  torch backend's code (`hf.FolderEmbedder.head`, ...), so the two runtimes agree by construction.
- int8: `onnxruntime.quantization.quantize_dynamic` (per channel, MatMul only), saved beside the fp32 graph and
  compared with it on `PROBE_TEXTS` at every start: below `--quantize-cosine-floor` (see `agreement`) the start
  is refused in one line (exit status 2).
- The session's idle threads sleep rather than spin, as torch's do here: a spinning thread holds the event
  loop's core.
- CPU only: a host with CUDA devices refuses `--runtime onnx` rather than leave its GPUs idle (`plan_of`).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol, cast

from batchserve.backends import cache_root, default_threads
from batchserve.backends.content_key import file_digest, sha256_of
from batchserve.backends.folder import FolderModel
from batchserve.config import Settings

log = logging.getLogger("batchserve.onnx")

EXPORT_FORMAT = "1"  # part of the cache key: a change to what an export holds makes the old ones unused
OPSET = 17
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
FP32_FILE, INT8_FILE = "model.onnx", "model.int8.onnx"
EXPORT_TOLERANCE = 1e-3  # the largest difference from torch's outputs, relative to their scale, an export may show
# Varied inputs the int8 graph is checked on against fp32. One- and two-word inputs are left out: over a handful
# of tokens int8's noise averages out least, so they alone would decide every model's floor (docs/backends.md).
PROBE_TEXTS = (
    "Thanks, that works for me.",
    "A man is eating food.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog.",
    "How do I reset my password if I no longer have access to my email?",
    "Embeddings map text to vectors so that similar meanings lie close together.",
    "I loved this film: the acting, the music, the ending. Ten out of ten.",
    "Terrible service, cold food, and we waited an hour for the bill.",
    "def add(a, b):\n    return a + b",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;",
    "The meeting moved to 3:45 pm on 12 March 2027, room 4B.",
    "Temperatures will reach 31 degrees on Tuesday, with storms in the evening.",
    "1 2 3 4 5 6 7 8 9 10",
    "Le chat est assis sur le tapis.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "¿Dónde está la biblioteca más cercana?",
    "東京は日本の首都です。",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria is the powerhouse of the cell.",
    "Interest rates rose by a quarter point, the third increase this year.",
    "She plays the guitar in a small jazz band on Friday nights.",
    "Rain, rain, go away, come again another day.",
    "Error 503: the service is temporarily unavailable; retry after 30 seconds.",
    "Mix the flour and the butter, then add two eggs and a pinch of salt.",
    "The river floods the valley every spring when the snow melts in the mountains.",
    "Is it safe to take ibuprofen with coffee?",
    "buy cheap flights to new york",
    "a a a a a a a a a a a a a a a a",
    "Quantum computers use qubits, which can be in a superposition of states.",
    "The committee will review the proposal and publish its findings next month, after consulting the "
    "stakeholders, the regional councils and the independent auditors appointed last year.",
    "In 1969, Apollo 11 landed on the Moon; Neil Armstrong and Buzz Aldrin walked on its surface while "
    "Michael Collins orbited above in the command module.",
    "Where can I buy a cheap second-hand bicycle?",
    "Why is the sky blue during the day and red at sunset?",
    "Tokyo, Delhi, Shanghai, São Paulo and Mexico City are among the largest cities in the world.",
    "The patient reported mild headaches, fatigue and occasional dizziness over the past two weeks.",
)


class OnnxError(RuntimeError):
    """The ONNX graph cannot be made or opened: one line."""


class QuantizationRefused(RuntimeError):
    """The int8 graph is further from fp32 than `--quantize-cosine-floor` allows: one line."""


class Encoder(Protocol):
    """What this module needs of an embedder, reranker or classifier (`hf.TokenModel`)."""

    info: FolderModel
    threads: int
    models: dict[str, Any]

    def load(self, device: str, dtype: Any) -> Any: ...  # the torch model, as the torch runtime loads it

    def batch(self, inputs: list[str], device: str) -> Sequence[object]: ...

    def probe_inputs(self) -> list[str]: ...  # PROBE_TEXTS as this model's inputs


@dataclass(frozen=True)
class OnnxPlan:
    """How a model runs on ONNX Runtime: int8 or not, the floor int8 must reach, where exports are kept."""

    quantize: str = "none"  # "none" | "int8"
    cosine_floor: float = 0.98
    cache: Path | None = None  # the weights cache root; None: a temporary directory for this process


def plan_of(settings: Settings, devices: list[str]) -> OnnxPlan | None:
    """The plan `--runtime onnx` asks for (None for torch); refused, in one line, on CUDA devices."""
    if settings.runtime != "onnx":
        return None
    if any(d.startswith("cuda") for d in devices):
        raise OnnxError(
            f"--runtime onnx runs on the CPU (ONNX Runtime's CPU provider) and this host has CUDA devices "
            f"({', '.join(devices)}), where torch runs the model in float16: serve with --runtime torch, or "
            f"hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on the CPU"
        )
    return OnnxPlan(settings.quantize, settings.quantize_cosine_floor, cache_root(settings))


def content_files(folder: Path) -> list[Path]:
    """The files an export is made from: config.json and the weights (any shard), by name."""
    files = [p for p in folder.iterdir() if p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES)]
    return sorted((p for p in files if p.is_file()), key=lambda p: p.name)


def content_key(folder: Path, task: str, memo_dir: Path | None = None) -> str:
    """A hash of the task, the export format and each content file's name and bytes (not its time). With
    `memo_dir` each file's digest is kept there (`content_key.file_digest`), so a later start does not rehash."""
    digest = hashlib.sha256(f"batchserve-onnx {EXPORT_FORMAT} {task}\n".encode())
    for path in content_files(folder):
        sha = file_digest(str(path), str(memo_dir)) if memo_dir is not None else sha256_of(str(path))
        digest.update(f"{path.name} {sha}\n".encode())
    return digest.hexdigest()[:32]


def export_dir(plan: OnnxPlan, info: FolderModel) -> Path:
    """This folder's export directory: under the weights cache, else (unwritable) a temporary one, with a
    warning."""
    key = content_key(info.path, info.task, plan.cache if plan.cache is not None and plan.cache.is_dir() else None)
    if plan.cache is not None:
        target = plan.cache / "onnx" / key
        try:
            target.mkdir(parents=True, exist_ok=True)
            return target
        except OSError as exc:
            log.warning("the weights cache %s is not writable (%s): exporting into a temporary one", plan.cache, exc)
    tmp = Path(tempfile.mkdtemp(prefix="batchserve-onnx-"))
    atexit.register(shutil.rmtree, tmp, True)
    target = tmp / key
    target.mkdir()
    return target


def output_name(info: FolderModel) -> str:
    return "last_hidden_state" if info.task == "embeddings" else "logits"


def export(encoder: Encoder, target: Path) -> None:
    """Export the folder's torch model (fp32, CPU) to `target` atomically (no process reads half a graph), and
    check it against torch once."""
    import torch

    info = encoder.info
    model = encoder.load("cpu", torch.float32).to("cpu").eval()
    names = ["input_ids", "attention_mask"]
    if "token_type_ids" in inspect.signature(model.forward).parameters:
        names.append("token_type_ids")
    output = output_name(info)

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return getattr(self.model(**dict(zip(names, tensors))), output)

    def sample(rows: int, width: int) -> tuple[torch.Tensor, ...]:
        ids = torch.arange(rows * width).reshape(rows, width) % 90 + 5
        mask = torch.ones_like(ids)
        mask[-1, width // 2 :] = 0  # one padded row
        return (ids, mask, torch.zeros_like(ids))[: len(names)]

    axes = {name: {0: "batch", 1: "sequence"} for name in names}
    axes[output] = {0: "batch", 1: "sequence"} if output == "last_hidden_state" else {0: "batch"}
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    graph = Graph().eval()  # the exporter restores the module's mode afterwards: eval, not train
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():  # the tracer's warnings about Python branches it fixed; checked below
            warnings.simplefilter("ignore")
            torch.onnx.export(
                graph,
                sample(2, 8),
                str(partial),
                dynamo=False,
                input_names=names,
                output_names=[output],
                dynamic_axes=axes,
                opset_version=OPSET,
            )
        check_export(partial, graph, sample(3, 13), names, output)
        os.replace(partial, target)
    except (Exception, SystemExit) as exc:  # any exporter failure is the same one line
        partial.unlink(missing_ok=True)
        if isinstance(exc, OnnxError):
            raise
        raise OnnxError(
            f"exporting {info.path} to ONNX failed ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}): "
            f"serve it with --runtime torch"
        ) from None
    log.info("exported %s to ONNX in %.1f s: %s", info.path, time.perf_counter() - started, target)


def check_export(path: Path, graph: Any, inputs: tuple[Any, ...], names: list[str], output: str) -> None:
    """Check the graph against torch on another shape than traced, so a shape the tracer fixed shows here."""
    import numpy as np
    import torch

    with torch.inference_mode():
        want = graph(*inputs).float().numpy()
    session = open_session(path, 1)
    (got,) = session.run([output], {n: t.numpy() for n, t in zip(names, inputs)})
    if output == "last_hidden_state":  # padded positions are never read
        keep = inputs[1].numpy()[..., None].astype(bool)
        want, got = want * keep, got * keep
    scale = max(1.0, float(np.abs(want).max()))
    worst = float(np.abs(got - want).max()) / scale
    if worst > EXPORT_TOLERANCE:
        raise OnnxError(f"the ONNX export differs from torch's outputs by {worst:.2g}: serve it with --runtime torch")


def quantizer_chatter(record: logging.LogRecord) -> bool:
    """A log filter: drops what onnxruntime's quantizer logs below ERROR ("Ignore MatMul due to non constant B")."""
    return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname


def quantize(fp32: Path, target: Path) -> None:
    """Dynamic int8 weights (per output channel) for the MatMuls, saved atomically beside the fp32 graph."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    started = time.perf_counter()
    root = logging.getLogger()
    root.addFilter(quantizer_chatter)  # it logs a line per tensor it leaves alone, on the root logger
    try:
        quantize_dynamic(
            str(fp32), str(partial), per_channel=True, op_types_to_quantize=["MatMul"], weight_type=QuantType.QInt8
        )
        os.replace(partial, target)
    finally:
        root.removeFilter(quantizer_chatter)
        partial.unlink(missing_ok=True)
    log.info("quantized %s to int8 in %.1f s: %s", fp32, time.perf_counter() - started, target)


def open_session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its warnings about initializers are no news
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass
class OnnxModel:
    """An ONNX session called as the torch model is, so the batch path does not tell them apart. It feeds the
    inputs its graph has (missing token type ids are zeros)."""

    session: Any
    output: str
    path: Path

    def __post_init__(self) -> None:
        self.inputs = tuple(i.name for i in self.session.get_inputs())

    def __call__(self, **tensors: Any) -> SimpleNamespace:
        import numpy as np
        import torch

        arrays = {name: t.numpy() for name, t in tensors.items()}
        feed = {name: arrays[name] if name in arrays else np.zeros_like(arrays["input_ids"]) for name in self.inputs}
        (out,) = self.session.run([self.output], feed)
        return SimpleNamespace(**{self.output: torch.from_numpy(out)})  # where pooling and scoring read it


def load(plan: OnnxPlan, encoder: Encoder, device: str) -> OnnxModel:
    """The folder's ONNX graph (exported on first start), or with int8 the int8 graph once it passed the probe."""
    info = encoder.info
    where = export_dir(plan, info)
    fp32_path = where / FP32_FILE
    if fp32_path.exists():
        log.info("ONNX graph of %s from the cache: %s", info.path, fp32_path)
    else:
        export(encoder, fp32_path)
        files = [p.name for p in content_files(info.path)]
        (where / "source.json").write_text(json.dumps({"folder": str(info.path), "task": info.task, "files": files}))
    threads = encoder.threads or default_threads()
    output = output_name(info)
    fp32 = OnnxModel(open_session(fp32_path, threads), output, fp32_path)
    if plan.quantize != "int8":
        return fp32
    int8_path = where / INT8_FILE
    if int8_path.exists():
        log.info("int8 ONNX graph of %s from the cache: %s", info.path, int8_path)
    else:
        quantize(fp32_path, int8_path)
    int8 = OnnxModel(open_session(int8_path, threads), output, int8_path)
    check_int8(plan, encoder, device, fp32, int8)
    return int8


def agreement(task: str, reference: Sequence[object], other: Sequence[object]) -> float:
    """How close `other` is to `reference`: the lowest per-input cosine of vectors (embedder) or logits
    (classifier); a reranker's score correlation (one number each: a cosine says nothing)."""
    import numpy as np

    if task == "classification":
        reference, other = logits_of(reference), logits_of(other)
    a = np.asarray(reference, dtype=np.float64)
    b = np.asarray(other, dtype=np.float64)
    if task == "reranking":
        a, b = a - a.mean(), b - b.mean()
        if not a.any() or not b.any():
            return 1.0 if np.allclose(a, b) else 0.0
        return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
    return float(((a * b).sum(axis=1) / norms).min())


def logits_of(answers: Sequence[object]) -> list[list[float]]:
    """A classifier's answers (each every class's `{label, score, logit}`) as their logit vectors."""
    return [[float(c["logit"]) for c in cast(list[dict[str, float]], row)] for row in answers]


def measure_name(task: str) -> str:
    return {"reranking": "score correlation", "classification": "lowest logit cosine"}.get(task, "lowest cosine")


def check_int8(plan: OnnxPlan, encoder: Encoder, device: str, fp32: OnnxModel, int8: OnnxModel) -> None:
    """Run the probe set through both graphs (the model's own batch path) and refuse int8 below the floor."""
    info = encoder.info
    inputs = encoder.probe_inputs()
    answers = []
    for model in (fp32, int8):
        encoder.models[device] = model
        answers.append(encoder.batch(inputs, device))
    encoder.models.pop(device, None)
    value = agreement(info.task, answers[0], answers[1])
    measure = measure_name(info.task)
    if value < plan.cosine_floor:
        raise QuantizationRefused(
            f"int8 {measure} {value:.6f} against fp32 over {len(inputs)} probe inputs is below "
            f"--quantize-cosine-floor {plan.cosine_floor}: serve {info.path} with --quantize none, or lower the floor"
        )
    log.info(
        "int8 of %s: %s %.6f against fp32 over %d probe inputs (--quantize-cosine-floor %s)",
        info.path,
        measure,
        value,
        len(inputs),
        plan.cosine_floor,
    )
