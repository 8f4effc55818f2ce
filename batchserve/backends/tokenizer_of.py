"""A served model's tokenizer, for `POST /tokenize` and `/detokenize`: found through the wrappers a backend is
served in (`ProcessBackend.local`, `PluginBackend.plugin`, MiniLM's `embedder`) as the `tokenizer` of the model
object (or of the generation engine): a `tokenizers.Tokenizer` (folder embedders and rerankers) or a transformers
tokenizer (the engine's). The folders' tokenizer truncates at the model's length; a copy without truncation
answers here, so `/tokenize` counts a long prompt whole, as vLLM's does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

WRAPPERS = ("local", "plugin", "embedder")  # where a backend keeps the object it wraps


class TextTokenizer(Protocol):
    """What the routes ask of a tokenizer; each call runs off the event loop."""

    max_model_len: int

    def encode(self, text: str, special: bool) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_texts(self, ids: list[int]) -> list[str]: ...
    def vocab_size(self) -> int: ...


@dataclass
class FastTokenizer:
    """A `tokenizers.Tokenizer` (without its truncation and padding)."""

    tok: Any
    max_model_len: int

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=special).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=False))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tok.id_to_token(i) or "" for i in ids]

    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))


@dataclass
class HfTokenizer:
    """A transformers tokenizer."""

    tok: Any
    max_model_len: int

    def encode(self, text: str, special: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [str(t) for t in self.tok.convert_ids_to_tokens(ids)]

    def vocab_size(self) -> int:
        return len(self.tok)


def adapt(tok: Any, max_model_len: int) -> TextTokenizer | None:
    """`tok` as a `TextTokenizer`, or None when it is neither kind."""
    if tok is None:
        return None
    if hasattr(tok, "encode_batch") and hasattr(tok, "no_truncation"):  # tokenizers.Tokenizer
        from tokenizers import Tokenizer

        whole = Tokenizer.from_str(tok.to_str())
        whole.no_truncation()
        whole.no_padding()
        return FastTokenizer(whole, max_model_len)
    if callable(tok) and hasattr(tok, "convert_ids_to_tokens"):
        return HfTokenizer(tok, max_model_len)
    return None


_MADE: dict[int, tuple[object, TextTokenizer | None]] = {}  # by id(backend), the backend kept so its id stays its own


def tokenizer_of(backend: object) -> TextTokenizer | None:
    """The backend's model's tokenizer, or None when it has none (a plugin, the sim). Made once per backend."""
    made = _MADE.get(id(backend))
    if made is not None and made[0] is backend:
        return made[1]
    chain: list[object] = [backend]  # the backend, then what each wraps
    for _ in range(4):
        obj = chain[-1]
        inner = next((getattr(obj, name) for name in WRAPPERS if getattr(obj, name, None) is not None), None)
        if inner is None:
            break
        chain.append(inner)
    tok = next((t for obj in chain if (t := getattr(obj, "tokenizer", None)) is not None), None)
    # The window may sit on another object of the chain than the tokenizer.
    longest = next((n for obj in chain if (n := getattr(getattr(obj, "info", None), "max_tokens", 0))), 0)
    longest = longest or next((n for obj in chain if (n := getattr(obj, "max_context", 0))), 0)  # the engine's
    out = adapt(tok, int(longest))
    _MADE[id(backend)] = (backend, out)
    return out
