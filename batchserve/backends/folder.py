"""A Hugging Face model folder (or a hub id in the local cache), read without loading it: what task it serves
(embeddings, generation, reranking, classification) and how (`--model [name=]PATH`, `[[models]] path = ...`;
docs/backends.md, "Any model from a folder").

Read from the folder's own files, as sentence-transformers and transformers would:
- `modules.json` naming a Pooling module (sentence-transformers' embedder format) -> embeddings, pooled and
  normalised as its `*_Pooling/config.json` and a Normalize module say, up to `max_seq_length` tokens;
- `config.json` whose `architectures` has a `*ForCausalLM` -> generation, on the generation engine's slot stepper
  (decoder-only models of the Llama family only: `GENERATION_TYPES`);
- `*ForSequenceClassification` with one label -> reranking (a cross-encoder: one score per (query, document));
  with more -> classification (a label's score each, softmax or sigmoid as transformers' pipeline applies them).
`--task` overrides the guess. Everything that cannot be served is a `FolderError`: one line, said before the port
opens (the CLI exits 2), never a stack trace from transformers minutes later.

Each JSON file is decoded into msgspec Structs holding only the members the server reads, so a file of the wrong
shape is refused naming the file and the member, never with a traceback.

A name that is not a directory is taken as a hub id and looked up in the local Hugging Face cache only
(`huggingface_hub.snapshot_download(local_files_only=True)`): the server never downloads at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

TASKS = ("embeddings", "generation", "reranking", "classification")
# model_type of the causal LMs the slot stepper runs (the Llama family's attention and cache interface); others
# are refused at start with this list in the message
GENERATION_TYPES = ("llama", "mistral", "qwen2", "qwen3")
POOLING_MODES = ("mean", "cls", "lasttoken", "max", "mean_sqrt_len_tokens")
# sentence-transformers' module types (old `sentence_transformers.models.X` and 6.x's module paths) by role
ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE = "Transformer", "Pooling", "Normalize"
UNBOUNDED_LENGTH = 1_000_000  # a tokenizer's model_max_length this large means "not set" (transformers' 1e30)
DEFAULT_POSITIONS = 512  # a config.json without max_position_embeddings

Positive = Annotated[int, msgspec.Meta(gt=0)]


class FolderError(ValueError):
    """A folder that cannot be served, in one line."""


# -- the shapes of the files read (what the server reads of each; unknown members are ignored) ---------------
class CrossEncoderSaved(msgspec.Struct):
    """config.json's `sentence_transformers` member, as CrossEncoder saves it."""

    activation_fn: str | None = None


class ModelConfig(msgspec.Struct):
    """config.json. `model_type` is required: transformers' AutoConfig cannot load a folder without it."""

    model_type: str
    architectures: list[str] | None = None
    max_position_embeddings: Positive | None = None
    num_labels: int | None = None
    id2label: dict[str, Any] | None = None
    problem_type: str | None = None
    sentence_transformers: CrossEncoderSaved | None = None


class StModule(msgspec.Struct):
    """One entry of sentence-transformers' modules.json."""

    type: str
    path: str = ""


class PoolingConfig(msgspec.Struct):
    """`*_Pooling/config.json`: 6.x's `pooling_mode`, or the older booleans."""

    pooling_mode: str | None = None
    pooling_mode_cls_token: bool = False
    pooling_mode_mean_tokens: bool = False
    pooling_mode_max_tokens: bool = False
    pooling_mode_mean_sqrt_len_tokens: bool = False
    pooling_mode_lasttoken: bool = False
    pooling_mode_weightedmean_tokens: bool = False


class SentenceBertConfig(msgspec.Struct):
    """sentence_bert_config.json."""

    max_seq_length: Positive | None = None
    do_lower_case: bool = False


class TokenizerConfig(msgspec.Struct):
    """tokenizer_config.json (1e30, transformers' "not set", is a float)."""

    model_max_length: float | None = None


class GenerationConfig(msgspec.Struct):
    """generation_config.json: the sampling defaults the decoding engine reads (`build.sampling_defaults`)."""

    temperature: float | None = None
    top_p: float | None = None


Shape = TypeVar("Shape")


def read_as(path: Path, shape: type[Shape]) -> Shape:
    """The JSON file at `path` decoded as `shape`; FolderError naming the file and what is wrong with it."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=shape)
    except OSError as exc:
        raise FolderError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except msgspec.ValidationError as exc:
        raise FolderError(f"{path}: malformed: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FolderError(f"{path}: not valid JSON ({exc})") from None


def read_if_there(path: Path, shape: type[Shape]) -> Shape:
    """`read_as`, or the shape's defaults when the file is absent."""
    return read_as(path, shape) if path.exists() else shape()


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
    config: ModelConfig | None = field(default=None, repr=False, compare=False)  # what was read of config.json


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


# older sentence-transformers' pooling booleans (`pooling_mode_<flag>`): a mode, or an alias of one
POOLING_FLAGS = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "lasttoken", "weightedmean_tokens")
POOLING_ALIASES = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max", "last": "lasttoken"}


def read_pooling(path: Path) -> str:
    """The pooling mode of a sentence-transformers Pooling config (6.x's or the older booleans)."""
    config = read_as(path, PoolingConfig)
    mode = config.pooling_mode
    if mode is None:
        chosen = [POOLING_ALIASES.get(f, f) for f in POOLING_FLAGS if getattr(config, f"pooling_mode_{f}")]
        if len(chosen) != 1:
            raise FolderError(
                f"{path}: pooling {'+'.join(chosen) or 'none'} is not supported (one of {', '.join(POOLING_MODES)})"
            )
        mode = chosen[0]
    mode = POOLING_ALIASES.get(mode, mode)
    if mode not in POOLING_MODES:
        raise FolderError(f"{path}: pooling {mode!r} is not supported (one of {', '.join(POOLING_MODES)})")
    return mode


def positions_cut(folder: Path, positions: int) -> int:
    """Tokens per input: the model's positions, or fewer when the tokenizer's model_max_length says so."""
    n = read_if_there(folder / "tokenizer_config.json", TokenizerConfig).model_max_length
    return min(positions, int(n)) if n is not None and 1 <= n < UNBOUNDED_LENGTH else positions


def st_pipeline(folder: Path) -> Pooling:
    """The Pooling (and Normalize) of modules.json; FolderError for a module this server cannot run."""
    listed = folder / "modules.json"
    mode: str | None = None
    normalize = False
    for i, module in enumerate(read_as(listed, list[StModule])):
        role = module.type.rsplit(".", 1)[-1]
        if role == ST_TRANSFORMER and i == 0:
            continue
        if role == ST_POOLING and mode is None:
            mode = read_pooling(folder / module.path / "config.json")
        elif role == ST_NORMALIZE:
            normalize = True
        else:
            raise FolderError(
                f"{listed}: module {i} ({module.type}) is not supported "
                f"here (a Transformer, then Pooling, then optionally Normalize)"
            )
    if mode is None:
        raise FolderError(f"{listed}: no Pooling module")
    return Pooling(mode, normalize)


def guess_task(folder: Path, architecture: str, config: ModelConfig) -> str:
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


def labels(config: ModelConfig) -> int:
    if config.num_labels is not None:
        return config.num_labels
    return len(config.id2label or {"0": "LABEL_0"})


def reranker_activation(config: ModelConfig) -> str:
    """The activation CrossEncoder applies to the one logit: what it saved in config.json, else sigmoid."""
    saved = (config.sentence_transformers or CrossEncoderSaved()).activation_fn or ""
    return "identity" if saved.endswith("Identity") else "sigmoid"


def classifier_activation(config: ModelConfig) -> str:
    """What transformers' text-classification pipeline applies to a classifier's logits by default."""
    if config.problem_type == "regression":
        return "identity"
    if config.problem_type == "multi_label_classification" or labels(config) == 1:
        return "sigmoid"
    return "softmax"


def inspect_folder(name: str, task: str = "") -> FolderModel:
    """Read a folder (or a cached hub id) and decide what it serves; FolderError (any error at all) says why not."""
    if task and task not in TASKS:
        raise FolderError(f"task {task!r} is not one of {', '.join(TASKS)}")
    folder = resolve_path(name)
    try:
        return _inspect(folder, task)
    except FolderError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        raise FolderError(
            f"{folder}: its files are not as transformers writes them ({type(exc).__name__}: {exc})"
        ) from None


def _inspect(folder: Path, task: str) -> FolderModel:
    if not (folder / "config.json").exists():
        raise FolderError(f"{folder}: no config.json (a Hugging Face model folder, as save_pretrained writes it)")
    config = read_as(folder / "config.json", ModelConfig)
    architecture = config.architectures[0] if config.architectures else ""
    task = task or guess_task(folder, architecture, config)
    if not (folder / "tokenizer.json").exists():
        raise FolderError(f"{folder}: no tokenizer.json (a fast tokenizer, as save_pretrained writes it)")
    positions = config.max_position_embeddings or DEFAULT_POSITIONS
    model = FolderModel(folder, task, architecture, config.model_type, positions, config=config)
    if task == "embeddings":
        if not (folder / "modules.json").exists():  # --task embeddings on a bare encoder: mean + normalise
            return replace(model, max_tokens=positions_cut(folder, positions))
        pooling = st_pipeline(folder)
        st = read_if_there(folder / "sentence_bert_config.json", SentenceBertConfig)
        length = min(st.max_seq_length or positions_cut(folder, positions), positions)
        return replace(model, max_tokens=length, pooling=pooling, lower_case=st.do_lower_case)
    if task == "reranking":
        if not architecture.endswith("ForSequenceClassification") or labels(config) != 1:
            raise FolderError(
                f"{folder}: reranking needs a *ForSequenceClassification with one label (a "
                f"cross-encoder), not {architecture or 'unknown'} with {labels(config)} label(s)"
            )
        return replace(model, max_tokens=positions_cut(folder, positions), activation=reranker_activation(config))
    if task == "classification":
        if not architecture.endswith("ForSequenceClassification"):
            raise FolderError(
                f"{folder}: classification needs a *ForSequenceClassification, not {architecture or 'unknown'}"
            )
        return replace(model, max_tokens=positions_cut(folder, positions), activation=classifier_activation(config))
    if not architecture.endswith("ForCausalLM") or config.model_type not in GENERATION_TYPES:
        raise FolderError(
            f"{folder}: architecture {architecture or 'unknown'} ({config.model_type}) "
            f"cannot run on the generation engine's slot stepper (decoder-only models of type "
            f"{', '.join(GENERATION_TYPES)})"
        )
    read_if_there(folder / "generation_config.json", GenerationConfig)  # the engine's sampling defaults
    return model
