"""A Hugging Face model folder (or a hub id in the local cache), read without loading it: what task it serves
(embeddings, generation, reranking,
classification) and how (`--model [name=]PATH`, `[[models]] path = ...`; docs/backends.md,
"Any model from a folder").

Read from the folder's own files, as sentence-transformers and transformers would:
- `modules.json` naming a Pooling module (sentence-transformers' embedder format) -> embeddings, pooled and
  normalised as its `*_Pooling/config.json` and a Normalize module say, up to `max_seq_length` tokens;
- `config.json` whose `architectures` has a `*ForCausalLM` -> generation, on the generation engine's slot stepper
  (decoder-only models of the Llama family only: `GENERATION_TYPES`);
- `*ForSequenceClassification` with one label -> reranking (a cross-encoder: one score per (query, document));
  with more -> classification (a label's score each, softmax or sigmoid as transformers' pipeline applies them).
`--task` overrides the guess. Everything that cannot be served is a `FolderError`: one line, said before the port
opens (the CLI exits 2), never a stack trace from transformers minutes later.

A name that is not a directory is taken as a hub id and looked up in the local Hugging Face cache only
(`huggingface_hub.snapshot_download(local_files_only=True)`): the server never downloads at start.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASKS = ("embeddings", "generation", "reranking", "classification")
# model_type of the causal LMs the slot stepper runs (the Llama family's attention and cache interface); others
# are refused at start with this list in the message
GENERATION_TYPES = ("llama", "mistral", "qwen2", "qwen3")
POOLING_MODES = ("mean", "cls", "lasttoken", "max", "mean_sqrt_len_tokens")
# sentence-transformers' module types (old `sentence_transformers.models.X` and 6.x's module paths) by role
ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE = "Transformer", "Pooling", "Normalize"
UNBOUNDED_LENGTH = 1_000_000  # a tokenizer's model_max_length this large means "not set" (transformers' 1e30)


class FolderError(ValueError):
    """A folder that cannot be served, in one line."""


@dataclass(frozen=True)
class Pooling:
    """How token vectors become the sentence's vector, and whether it is L2-normalised after."""

    mode: str = "mean"
    normalize: bool = True


@dataclass(frozen=True)
class FolderModel:
    """What a folder serves and how: its task, the transformers architecture, and the task's settings."""

    path: Path
    task: str
    architecture: str
    model_type: str
    max_tokens: int  # tokens per input after truncation (max_seq_length for an embedder, the model's for others)
    pooling: Pooling = field(default_factory=Pooling)  # embeddings only
    lower_case: bool = False  # embeddings: sentence-transformers' do_lower_case (the text is lowered first)
    activation: str = "sigmoid"  # reranking: applied to the one logit (CrossEncoder's default for one label);
    # classification: softmax, sigmoid or identity over the logits (`classifier_activation`)
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise FolderError(f"{path}: cannot read it as JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict | list):
        raise FolderError(f"{path}: not a JSON object")
    return data  # type: ignore[return-value]


def resolve_path(name: str) -> Path:
    """The folder `name` names: a directory, else a hub id found in the local Hugging Face cache (offline)."""
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise FolderError(f"{name} is a file, not a model folder")
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        raise FolderError(f"{name}: no such folder (a hub id is written owner/name)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, local_files_only=True))
    except ImportError:
        raise FolderError(
            f"{name}: no such folder, and huggingface_hub is not installed to look in its cache"
        ) from None
    except Exception:  # noqa: BLE001 - not in the cache, whatever the hub's exception class
        raise FolderError(
            f"{name}: no such folder, and not in the local Hugging Face cache (the server does not "
            f"download: fetch it first, e.g. `hf download {name}`)"
        ) from None


def st_role(module_type: str) -> str:
    return module_type.rsplit(".", 1)[-1]


def read_pooling(path: Path, config: dict[str, Any]) -> Pooling:
    """The pooling mode of a sentence-transformers Pooling config (6.x's `pooling_mode`, or the older
    `pooling_mode_*_token(s)` booleans)."""
    mode = config.get("pooling_mode")
    if mode is None:
        chosen = [
            m
            for m, key in (
                ("cls", "pooling_mode_cls_token"),
                ("mean", "pooling_mode_mean_tokens"),
                ("max", "pooling_mode_max_tokens"),
                ("mean_sqrt_len_tokens", "pooling_mode_mean_sqrt_len_tokens"),
                ("lasttoken", "pooling_mode_lasttoken"),
                ("weightedmean", "pooling_mode_weightedmean_tokens"),
            )
            if config.get(key)
        ]
        if len(chosen) != 1:
            raise FolderError(
                f"{path}: pooling {'+'.join(chosen) or 'none'} is not supported (one of {', '.join(POOLING_MODES)})"
            )
        mode = chosen[0]
    mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "last": "lasttoken"}.get(mode, mode)
    if mode not in POOLING_MODES:
        raise FolderError(f"{path}: pooling {mode!r} is not supported (one of {', '.join(POOLING_MODES)})")
    return Pooling(mode=mode)


def tokenizer_max_length(folder: Path) -> int | None:
    tok_config = folder / "tokenizer_config.json"
    if not tok_config.exists():
        return None
    n = read_json(tok_config).get("model_max_length")
    return int(n) if isinstance(n, int | float) and 0 < n < UNBOUNDED_LENGTH else None


def embedder_settings(folder: Path, positions: int) -> tuple[Pooling, int, bool]:
    """(pooling, max_seq_length, do_lower_case) from sentence-transformers' files; FolderError for a module
    this server cannot run (a Dense layer, a second transformer...)."""
    modules = read_json(folder / "modules.json")
    if not isinstance(modules, list):
        raise FolderError(f"{folder / 'modules.json'}: not a list of modules")
    pooling: Pooling | None = None
    normalize = False
    for i, module in enumerate(modules):
        role = st_role(str(module.get("type", "")))
        where = folder / str(module.get("path", ""))
        if role == ST_TRANSFORMER and i == 0:
            continue
        if role == ST_POOLING and pooling is None:
            pooling = read_pooling(where / "config.json", read_json(where / "config.json"))
        elif role == ST_NORMALIZE:
            normalize = True
        else:
            raise FolderError(
                f"{folder / 'modules.json'}: module {i} ({module.get('type')}) is not supported "
                f"here (a Transformer, then Pooling, then optionally Normalize)"
            )
    if pooling is None:
        raise FolderError(f"{folder / 'modules.json'}: no Pooling module")
    st_config = folder / "sentence_bert_config.json"
    st = read_json(st_config) if st_config.exists() else {}
    length = st.get("max_seq_length") or tokenizer_max_length(folder) or positions
    return Pooling(pooling.mode, normalize), int(min(length, positions)), bool(st.get("do_lower_case", False))


def guess_task(folder: Path, architecture: str, config: dict[str, Any]) -> str:
    if (folder / "modules.json").exists() and "ForSequenceClassification" not in architecture:
        return "embeddings"
    if architecture.endswith("ForCausalLM"):
        return "generation"
    if architecture.endswith("ForSequenceClassification"):
        return "reranking" if labels(config) == 1 else "classification"
    raise FolderError(
        f"{folder}: cannot tell what to serve: architecture {architecture or 'unknown'!r} "
        f"(embeddings need sentence-transformers' modules.json, generation a *ForCausalLM, "
        f"reranking a *ForSequenceClassification with one label, classification one with more); say it with --task"
    )


def labels(config: dict[str, Any]) -> int:
    if isinstance(config.get("num_labels"), int):
        return int(config["num_labels"])
    return len(config.get("id2label") or {"0": "LABEL_0"})


def reranker_activation(config: dict[str, Any]) -> str:
    """The activation CrossEncoder applies to the one logit: what it saved in config.json, else sigmoid."""
    saved = str((config.get("sentence_transformers") or {}).get("activation_fn") or "")
    return "identity" if saved.endswith("Identity") else "sigmoid"


def classifier_activation(config: dict[str, Any]) -> str:
    """What transformers' text-classification pipeline applies to a classifier's logits by default: none for
    regression, sigmoid for multi-label (or one label), else softmax."""
    problem = config.get("problem_type")
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or labels(config) == 1:
        return "sigmoid"
    return "softmax"


def inspect_folder(name: str, task: str = "") -> FolderModel:
    """Read a folder (or a cached hub id) and decide what it serves; FolderError says why it cannot."""
    folder = resolve_path(name)
    if not (folder / "config.json").exists():
        raise FolderError(f"{folder}: no config.json (a Hugging Face model folder, as save_pretrained writes it)")
    config = read_json(folder / "config.json")
    architectures = config.get("architectures") or []
    architecture = str(architectures[0]) if architectures else ""
    model_type = str(config.get("model_type", ""))
    if task and task not in TASKS:
        raise FolderError(f"task {task!r} is not one of {', '.join(TASKS)}")
    task = task or guess_task(folder, architecture, config)
    if not (folder / "tokenizer.json").exists():
        raise FolderError(f"{folder}: no tokenizer.json (a fast tokenizer, as save_pretrained writes it)")
    positions = int(config.get("max_position_embeddings") or 512)
    if task == "embeddings":
        if not (folder / "modules.json").exists():  # --task embeddings on a bare encoder: mean + normalise
            return FolderModel(
                folder,
                task,
                architecture,
                model_type,
                min(positions, tokenizer_max_length(folder) or positions),
                config=config,
            )
        pooling, length, lower = embedder_settings(folder, positions)
        return FolderModel(folder, task, architecture, model_type, length, pooling, lower, config=config)
    if task == "reranking":
        if not architecture.endswith("ForSequenceClassification") or labels(config) != 1:
            raise FolderError(
                f"{folder}: reranking needs a *ForSequenceClassification with one label (a "
                f"cross-encoder), not {architecture or 'unknown'} with {labels(config)} label(s)"
            )
        return FolderModel(
            folder,
            task,
            architecture,
            model_type,
            min(positions, tokenizer_max_length(folder) or positions),
            activation=reranker_activation(config),
            config=config,
        )
    if task == "classification":
        if not architecture.endswith("ForSequenceClassification"):
            raise FolderError(
                f"{folder}: classification needs a *ForSequenceClassification, not {architecture or 'unknown'}"
            )
        return FolderModel(
            folder,
            task,
            architecture,
            model_type,
            min(positions, tokenizer_max_length(folder) or positions),
            activation=classifier_activation(config),
            config=config,
        )
    if not architecture.endswith("ForCausalLM") or model_type not in GENERATION_TYPES:
        raise FolderError(
            f"{folder}: architecture {architecture or 'unknown'} ({model_type or 'no model_type'}) "
            f"cannot run on the generation engine's slot stepper (decoder-only models of type "
            f"{', '.join(GENERATION_TYPES)})"
        )
    return FolderModel(folder, task, architecture, model_type, positions, config=config)
