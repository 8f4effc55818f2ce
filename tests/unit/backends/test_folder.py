"""What `--model PATH` reads from a folder without loading it (backends/folder.py, backends/hf.py, cli.py): the
task from its files, pooling and length from sentence-transformers' config (6.x and older formats), a reranker's
activation, the architectures the slot stepper runs, names and `--task`, the `[[models]]` table, and one-line
errors for what cannot be served. Folders of JSON files only: no weights, nothing loaded."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import pytest

from batchserve.backends.folder import FolderError, Pooling, inspect_folder
from batchserve.backends.hf import folder_spec, generation_folder, resolve_folders
from batchserve.cli import build_parser, settings_from
from batchserve.config import Settings
from batchserve.config_file import load


def tokenizer() -> dict[str, object]:
    """The smallest tokenizer.json the tokenizers library reads (one word, one unknown token)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    return json.loads(Tokenizer(WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).to_str())


TOKENIZER = tokenizer()


def write(folder: Path, files: dict[str, object]) -> Path:
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return folder


def bert(folder: Path, **config: object) -> dict[str, object]:
    return {
        "config.json": {"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512, **config},
        "tokenizer.json": TOKENIZER,
    }


ST6 = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"},
    {
        "idx": 1,
        "name": "1",
        "path": "1_Pooling",
        "type": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
    },
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.base.modules.normalize.Normalize"},
]
OLD = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
]


def test_a_sentence_transformers_6_folder_is_an_embedder(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            **bert(tmp_path),
            "modules.json": ST6,
            "1_Pooling/config.json": {"pooling_mode": "cls"},
            "tokenizer_config.json": {"model_max_length": 128},
        },
    )
    info = inspect_folder(str(tmp_path))
    assert (info.task, info.pooling, info.max_tokens) == ("embeddings", Pooling("cls", True), 128)


def test_an_older_folder_with_sentence_bert_config(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            **bert(tmp_path),
            "modules.json": OLD,
            "1_Pooling/config.json": {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
            "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": True},
            "tokenizer_config.json": {"model_max_length": 1e30},
        },
    )
    info = inspect_folder(str(tmp_path))
    assert (info.pooling, info.max_tokens, info.lower_case) == (Pooling("mean", False), 256, True)


@pytest.mark.parametrize(
    "modules,pooling,says",
    [
        (
            OLD + [{"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
            {"pooling_mode_mean_tokens": True},
            "not supported here",
        ),
        (
            OLD,
            {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
            r"pooling mean\+max is not supported",
        ),
        (OLD[:1], {}, "no Pooling module"),
    ],
)
def test_embedder_folders_it_cannot_serve(tmp_path: Path, modules: list, pooling: dict, says: str) -> None:
    write(tmp_path, {**bert(tmp_path), "modules.json": modules, "1_Pooling/config.json": pooling})
    with pytest.raises(FolderError, match=says):
        inspect_folder(str(tmp_path))


def test_causal_lms_and_cross_encoders(tmp_path: Path) -> None:
    lm = write(
        tmp_path / "lm",
        {"config.json": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, "tokenizer.json": TOKENIZER},
    )
    assert inspect_folder(str(lm)).task == "generation"
    ce = write(
        tmp_path / "ce",
        {
            "config.json": {
                "architectures": ["BertForSequenceClassification"],
                "model_type": "bert",
                "id2label": {"0": "LABEL_0"},
            },
            "tokenizer.json": TOKENIZER,
        },
    )
    assert (inspect_folder(str(ce)).task, inspect_folder(str(ce)).activation) == ("reranking", "sigmoid")
    write(
        ce,
        {
            "config.json": {
                "architectures": ["BertForSequenceClassification"],
                "model_type": "bert",
                "num_labels": 1,
                "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"},
            }
        },
    )
    assert inspect_folder(str(ce)).activation == "identity"
    three = write(
        tmp_path / "nli",
        {
            "config.json": {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "num_labels": 3},
            "tokenizer.json": TOKENIZER,
        },
    )
    assert (inspect_folder(str(three)).task, inspect_folder(str(three)).activation) == ("classification", "softmax")
    with pytest.raises(FolderError, match="one label"):
        inspect_folder(str(three), "reranking")
    gpt2 = write(
        tmp_path / "gpt2",
        {"config.json": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "tokenizer.json": TOKENIZER},
    )
    with pytest.raises(FolderError, match="cannot tell what to serve"):
        inspect_folder(str(gpt2))
    with pytest.raises(FolderError, match="cannot run on the generation engine's slot stepper"):
        inspect_folder(str(gpt2), "generation")
    falcon = write(
        tmp_path / "falcon",
        {"config.json": {"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, "tokenizer.json": TOKENIZER},
    )
    with pytest.raises(FolderError, match="llama, mistral, qwen2, qwen3"):
        inspect_folder(str(falcon))


def test_a_classifier_takes_the_pipelines_activation(tmp_path: Path) -> None:
    """More than one label is classification, scored as transformers' text-classification pipeline scores it:
    softmax, sigmoid for a multi-label folder, the logits for regression; a head of one label stays a reranker
    unless --task says classification (then sigmoid, as the pipeline)."""

    def folder(name: str, **config: object) -> str:
        body = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", **config}
        return str(write(tmp_path / name, {"config.json": body, "tokenizer.json": TOKENIZER}))

    labels = {"0": "neg", "1": "neu", "2": "pos"}
    assert inspect_folder(folder("nli", id2label=labels)).activation == "softmax"
    multi = folder("multi", id2label=labels, problem_type="multi_label_classification")
    assert (inspect_folder(multi).task, inspect_folder(multi).activation) == ("classification", "sigmoid")
    regression = folder("reg", num_labels=2, problem_type="regression")
    assert inspect_folder(regression).activation == "identity"
    one = folder("one", id2label={"0": "LABEL_0"})
    assert inspect_folder(one).task == "reranking"
    assert (inspect_folder(one, "classification").task, inspect_folder(one, "classification").activation) == (
        "classification",
        "sigmoid",
    )
    encoder = write(
        tmp_path / "enc",
        {"config.json": {"architectures": ["BertModel"], "model_type": "bert"}, "tokenizer.json": TOKENIZER},
    )
    with pytest.raises(FolderError, match="classification needs a \\*ForSequenceClassification"):
        inspect_folder(str(encoder), "classification")


def test_names_the_cli_and_one_generation_model(tmp_path: Path) -> None:
    lm = write(
        tmp_path / "tiny",
        {"config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "tokenizer.json": TOKENIZER},
    )
    assert folder_spec(f"chat={lm}").name == "chat" and folder_spec(str(lm) + "/").name == "tiny"
    parser, _ = build_parser()
    s = settings_from(parser.parse_args(["serve", "--model", str(lm)]), environ={})
    assert [(m.name, m.backend, m.task) for m in s.models] == [("tiny", "hf", "generation")]
    assert s.generation_model == "tiny" and generation_folder(s) == str(lm.resolve())
    assert s.models[0].generates
    kept = settings_from(parser.parse_args(["serve", "--backend", "sim", "--model", f"a={lm}"]), environ={})
    assert [m.name for m in kept.models] == ["sim", "a"]
    twice = Settings(models=[folder_spec(f"a={lm}"), folder_spec(f"b={lm}")])
    with pytest.raises(ValueError, match="one generation model per server"):
        resolve_folders(twice)
    from_env = settings_from(parser.parse_args(["serve"]), environ={"BATCHSERVE_MODEL": f"x={lm}"})
    assert from_env.models[0].name == "x"


def test_the_config_file_takes_a_path(tmp_path: Path) -> None:
    config = tmp_path / "bs.toml"
    config.write_text('[[models]]\nname = "bge"\npath = "/models/bge"\ntask = "embeddings"\n')
    spec = load(str(config)).models[0]
    assert (spec.backend, spec.path, spec.task) == ("hf", "/models/bge", "embeddings")
    config.write_text('[[models]]\nname = "bge"\npath = "/models/bge"\ntask = "embed"\n')
    with pytest.raises(ValueError, match=r"bs.toml:4: models\[0\].task: expected one of embeddings"):
        load(str(config))
    config.write_text('[[models]]\nname = "x"\nbackend = "sim"\npath = "/models/bge"\n')
    with pytest.raises(ValueError, match="path is for a model folder"):
        load(str(config))


def test_a_hub_id_resolves_through_the_local_cache_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """owner/name found in the Hugging Face cache's layout (refs/main -> snapshots/<rev>), offline; one that is
    not there is refused in one line, nothing fetched."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-lm"
    snapshot = write(
        repo / "snapshots" / "abc123",
        {"config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "tokenizer.json": TOKENIZER},
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    info = inspect_folder("acme/tiny-lm")
    assert info.path == snapshot and info.task == "generation"
    with pytest.raises(FolderError, match="not in the local Hugging Face cache"):
        inspect_folder("acme/absent")


def test_torch_threads_reach_a_folder_model_unless_its_options_set_them(monkeypatch: Any, tmp_path: Path) -> None:
    from batchserve.backends import hf
    from batchserve.backends.folder import FolderModel
    from batchserve.config import ModelSpec

    def built(kind: str) -> Any:  # the backend's keyword arguments, without loading a tokenizer
        return lambda info, devices, **options: (kind, options)

    monkeypatch.setattr(hf, "FolderEmbedder", built("embedder"))
    monkeypatch.setattr(hf, "FolderReranker", built("reranker"))
    for task, kind in (("embeddings", "embedder"), ("reranking", "reranker")):
        info = FolderModel(path=tmp_path, task=task, architecture="BertModel", model_type="bert", max_tokens=8)
        monkeypatch.setattr(hf, "model_of", lambda spec, info=info: info)
        spec = ModelSpec("m", backend="hf")
        assert hf.HFModel.from_settings(spec, Settings(torch_threads=2)) == (kind, {"threads": 2})
        assert hf.HFModel.from_settings(spec, Settings()) == (kind, {"threads": 0})  # 0: cores - 1, at setup
        own = ModelSpec("m", backend="hf", options={"threads": 1, "pass_tokens": 64})
        assert hf.HFModel.from_settings(own, Settings(torch_threads=2)) == (kind, {"threads": 1, "pass_tokens": 64})


def test_torch_threads_reach_the_causal_lm_batch_backend(monkeypatch: Any) -> None:
    import torch

    from batchserve.backends import smollm2

    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(smollm2, "load_tokenizer", lambda source: None)
    monkeypatch.setattr(smollm2, "load_model", lambda device, source: None)
    monkeypatch.setattr(smollm2.SmolLM2Backend, "__init__", lambda self, **kw: None)
    smollm2.SmolLM2Backend.from_source("", Settings(torch_threads=2, decode="generate"))
    assert set_to == [2]


LM = {"config.json": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "tokenizer.json": TOKENIZER}
ST = {"modules.json": OLD, "1_Pooling/config.json": {"pooling_mode": "mean"}}


@pytest.mark.parametrize(
    "files,file,says",
    [
        ({"config.json": [1, 2]}, "config.json", "Expected `object`, got `array`"),
        ({**ST, "sentence_bert_config.json": {"max_seq_length": "256"}}, "sentence_bert_config.json", "max_seq_length"),
        ({**ST, "sentence_bert_config.json": {"max_seq_length": 0}}, "sentence_bert_config.json", ">= 1"),
        ({"modules.json": [1, 2]}, "modules.json", "got `int` - at `$[0]`"),
        ({**ST, "tokenizer_config.json": []}, "tokenizer_config.json", "Expected `object`, got `array`"),
        ({**ST, "1_Pooling/config.json": "mean"}, "1_Pooling/config.json", "Expected `object`, got `str`"),
        ({"config.json": {"architectures": ["BertModel"]}}, "config.json", "missing required field `model_type`"),
        ({"config.json": {"model_type": "bert", "architectures": "BertModel"}}, "config.json", "$.architectures"),
        ({"config.json": {"model_type": "bert", "max_position_embeddings": "x"}}, "config.json", "max_position"),
    ],
)
def test_a_file_of_the_wrong_shape_is_one_folder_error_naming_it(
    tmp_path: Path, files: dict[str, object], file: str, says: str
) -> None:
    """Issue 46, item 11: each file is decoded into the shape the server reads of it; one of another shape is
    a FolderError naming the file and the member, never an AttributeError or TypeError from deep inside."""
    write(tmp_path, {**bert(tmp_path), **files})
    with pytest.raises(FolderError) as caught:
        inspect_folder(str(tmp_path), "embeddings")
    assert str(caught.value).startswith(f"{tmp_path / file}: malformed: ") and says in str(caught.value)


def test_malformed_json_and_generation_and_reranker_files(tmp_path: Path) -> None:
    (write(tmp_path / "bad", bert(tmp_path)) / "config.json").write_text('{"model_type": ')
    with pytest.raises(FolderError, match=r"bad/config.json: not valid JSON"):
        inspect_folder(str(tmp_path / "bad"))
    write(tmp_path / "lm", {**LM, "generation_config.json": ["greedy"]})
    with pytest.raises(FolderError, match=r"lm/generation_config.json: malformed: Expected `object`"):
        inspect_folder(str(tmp_path / "lm"))
    ce = {"architectures": ["BertForSequenceClassification"], "model_type": "bert"}
    write(tmp_path / "ce", {"config.json": {**ce, "sentence_transformers": "sigmoid"}, "tokenizer.json": TOKENIZER})
    with pytest.raises(FolderError, match=r"ce/config.json: malformed: .* `\$.sentence_transformers`"):
        inspect_folder(str(tmp_path / "ce"))


def test_an_unforeseen_error_of_a_folder_is_still_one_folder_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchserve.backends import folder

    def broken(config: object) -> int:
        raise TypeError("an unforeseen shape")

    monkeypatch.setattr(folder, "labels", broken)
    ce = {"architectures": ["BertForSequenceClassification"], "model_type": "bert"}
    write(tmp_path, {"config.json": ce, "tokenizer.json": TOKENIZER})
    with pytest.raises(FolderError, match=f"^{tmp_path}: its files are not as transformers writes them "):
        inspect_folder(str(tmp_path))


def test_a_tokenizer_json_the_library_cannot_read_is_refused_at_start(tmp_path: Path) -> None:
    write(tmp_path, {**LM, "tokenizer.json": {"version": 1}})
    with pytest.raises(ValueError, match=r"^model m: .*tokenizer.json: the tokenizers library cannot read it"):
        resolve_folders(Settings(models=[folder_spec(f"m={tmp_path}")]))
