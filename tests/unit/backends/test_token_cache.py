"""What embedders and rerankers keep of their inputs' tokens (backends/token_cache.py, hf.TokenModel) and what
their tokenizer is given (backends/tokenizer_guard.py), on a real fast tokenizer the test builds (tests/hf_folders:
WordPiece, 64 tokens, so inputs are cut at 64 x 32 = 2,048 characters; folders of JSON and no weights):

- only ids and type ids are kept, never an encoding with its overflowing windows; the cache stays within its
  budget in bytes however long or many the inputs (a count of texts bounded nothing);
- an input cut by characters gets exactly the tokens the whole input gets, as an embedder or a reranker pair;
  one whose cut is not provably safe (whitespace the tokenizer drops, one endless word) is a 413, never a
  shorter embedding;
- a tokenizer.json whose normalizer blows a space up into 4 KB, or that makes many tokens of a character, is
  refused by the start-up probe."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from batchserve import errors
from batchserve.backends.token_cache import TokenCache, Tokens
from tests import hf_folders


def wordpiece() -> Tokenizer:
    """tests/hf_folders' BERT tokenizer, built with the tokenizers library alone (no transformers to import)."""
    from tokenizers import normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = sorted(set("".join(hf_folders.WORDS)) | set("0123456789.,?!'"))
    vocab = {t: i for i, t in enumerate(specials + list(hf_folders.WORDS) + letters + ["##" + c for c in letters])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return tok


def folder(path: Path, files: dict[str, object]) -> Path:
    """A model folder of JSON files and the tokenizer (no weights: nothing here loads a model)."""
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(json.dumps(content))
    wordpiece().save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    bert = {"model_type": "bert", "max_position_embeddings": 128}
    emb = folder(
        root / "emb",
        {
            "config.json": {**bert, "architectures": ["BertModel"]},
            "modules.json": [
                {"type": "sentence_transformers.models.Transformer", "path": ""},
                {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
            ],
            "1_Pooling/config.json": {"pooling_mode_mean_tokens": True},
            "sentence_bert_config.json": {"max_seq_length": 64},
        },
    )
    rr = folder(
        root / "rr", {"config.json": {**bert, "architectures": ["BertForSequenceClassification"], "num_labels": 1}}
    )
    return {"emb": emb, "rr": rr}


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(hf_folders.WORDS) for _ in range(n))


def embedder(folder: Path, **options: int):
    from batchserve.backends.folder import inspect_folder
    from batchserve.backends.hf import FolderEmbedder

    return FolderEmbedder(inspect_folder(str(folder)), ["cpu"], **options)


def test_the_cache_is_bounded_in_bytes_least_recently_used_first_out() -> None:
    cache = TokenCache(budget=100_000)
    for i in range(1000):
        text = f"{i} " + "x" * 2000
        cache.put(text, Tokens(text, list(range(64)), [0] * 64))
        assert cache.nbytes <= 100_000
    assert 0 < len(cache) < 1000
    first = "0 " + "x" * 2000
    assert first not in cache  # the oldest went first
    last = "999 " + "x" * 2000
    assert cache.get(last) is not None


def test_only_ids_are_kept_and_the_kept_bytes_stay_in_budget(folders: dict[str, Path]) -> None:
    """Before: every `tokenizers.Encoding` was kept with all its overflowing windows, 65,536 texts of them."""
    model = embedder(folders["emb"], cache_bytes=1_000_000)
    texts = [words(3000, seed) for seed in range(100)]  # ~16,000 characters each, ~60 windows of 64 tokens
    model.tokenize(texts)
    assert model.kept.nbytes <= 1_000_000
    kept = model.kept.get(texts[-1])
    assert isinstance(kept, Tokens) and len(kept.ids) == 64 and not hasattr(kept, "overflowing")
    assert model.tokens(texts[0]) == 64  # let go, and made again where it is needed
    assert model.tokenized_on_demand == 1


def test_an_input_cut_by_characters_has_the_whole_inputs_tokens(folders: dict[str, Path]) -> None:
    model = embedder(folders["emb"])
    assert model.max_chars == 64 * 32
    full = model.tokenizer  # truncates at 64 tokens, sees the whole text
    cases = [
        words(3000, 1),
        words(3000, 2).upper(),
        "\n\n".join(words(40, s) for s in range(80)),
        ("東京 " + words(10, 3) + ". ") * 300,
    ]
    for text in cases:
        assert len(text) > model.max_chars
        model.tokenize([text])
        assert model.encoding(text).ids == full.encode(text.lower()).ids


def test_a_reranker_pair_cut_by_characters_has_the_whole_pairs_tokens(folders: dict[str, Path]) -> None:
    from batchserve.backends.folder import inspect_folder
    from batchserve.backends.hf import FolderReranker, pair_input

    model = FolderReranker(inspect_folder(str(folders["rr"])), ["cpu"])
    for query, document in [
        ("what is the cat", words(2000, 5)),
        (words(2000, 6), words(2000, 7)),
        (words(3000, 8), "a short one"),
    ]:
        model.tokenize([pair_input(query, document)])
        assert model.encoding(pair_input(query, document)).ids == model.tokenizer.encode(query, document).ids


@pytest.mark.parametrize(
    "text",
    [" " * 5000 + "the cat", "a" * 5000, "x" * 2000 + " " + words(2000), words(10) + "\u200b" * 6000 + words(500)],
)
def test_an_input_that_cannot_be_cut_safely_is_a_413_not_a_shorter_embedding(
    folders: dict[str, Path], text: str
) -> None:
    model = embedder(folders["emb"])
    model.tokenize([text])
    with pytest.raises(errors.ApiError) as refused:
        model.cost_of(text)
    assert refused.value.status == 413 and "2048" in refused.value.message


def hostile(folder: Path, target: Path, normalizer: object) -> Path:
    import shutil

    from tokenizers import Tokenizer, normalizers

    shutil.copytree(folder, target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.normalizer = normalizers.Sequence([tok.normalizer, normalizer])
    tok.save(str(target / "tokenizer.json"))
    return target


def test_a_tokenizer_that_blows_up_the_probe_is_refused(folders: dict[str, Path], tmp_path: Path) -> None:
    from tokenizers import normalizers

    from batchserve.backends.tokenizer_guard import TokenizerRefused, check_tokenizer

    check_tokenizer(folders["emb"])  # a sane one passes
    spaces = hostile(folders["emb"], tmp_path / "spaces", normalizers.Replace(" ", "x" * 4096))
    with pytest.raises(TokenizerRefused, match="normalizer turns"):
        check_tokenizer(spaces)
    from tokenizers import Regex

    split = hostile(folders["emb"], tmp_path / "split", normalizers.Replace(Regex("[a-zA-Z]"), ". . . ."))
    with pytest.raises(TokenizerRefused, match="tokens of"):
        check_tokenizer(split)
    with pytest.raises(RuntimeError, match="normalizer turns"):
        embedder(spaces)
