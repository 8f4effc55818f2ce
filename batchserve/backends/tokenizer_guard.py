"""What a tokenizer may be given, and what it may make of it.

A bound on characters before tokenizing. An embedder or reranker reads only an input's first `max_tokens` tokens,
but a tokenizer's time and memory grow with the whole input. So an input longer than `max_tokens x chars_per_token`
characters (natural text takes 3 to 6 a token) is cut to that many before tokenizing, and kept only when the cut
provably leaves its first tokens as they were (`safe_cut`):

- A tokenizer normalizes per character, splits into words where each split depends only on the characters around
  it, then tokenizes each word on its own. So a prefix's words are the whole text's, except the last (cut) one.
- When the prefix's encoding overflowed `max_tokens` and its last kept token comes from a word before the cut one
  (`word_ids`), every kept token is one the whole text makes, in the same place: the answer is unchanged.
- Otherwise (runs of dropped whitespace, a word of thousands of characters, a tokenizer with no words) the input
  is refused with 413 rather than embedded from fewer tokens than it has. Natural text never gets there.

A pair's sides are cut and checked alone: `longest_first` truncation keeps at most `max_tokens` of a side.

A cap on a folder's tokenizer, at start (`check_tokenizer`): a `tokenizer.json` is code-like (a normalizer may
turn a character into kilobytes), so a probe of mixed text must stay within `MAX_NORMALIZED_GROWTH` and
`MAX_TOKENS_PER_CHAR`. At run time the character bound limits what any input can make of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 32  # characters an input may have per token the model reads, before it is cut
MAX_TOKENS_PER_CHAR = 2.0  # a probe tokenized into more is refused (byte-level BPE makes at most ~1 per byte of text)
MAX_NORMALIZED_GROWTH = 8.0  # a normalizer whose output is over this many times the probe's bytes is refused
_PIECES = (
    "The quick brown fox jumps over the lazy dog. ",
    "PACK my box with FIVE dozen liquor jugs!? ",
    "0123456789 3.14159 1,000,000 x=y+z*(a/b)-c% ",
    "!\"#$&'()*+,-./:;<=>@[\\]^_`{|}~ ",
    "   indented\tand\ttabbed\r\n\n",
    "naïve café résumé straße ĳssel Ωμέγα Привет мир ",
    "東京都は日本の首都です。北京 서울 ",
    "مرحبا بالعالم שלום ",
    "😀🚀 ❤️ 👍🏽 ",
    "e\u0301 a\u0308 n\u0303 \u00a0nbsp\u200bzw\u3000wide ",
)
SHORT_PROBE = "".join(_PIECES)  # tried first: a normalizer that blows up is caught on ~350 characters
PROBE = (SHORT_PROBE * 8)[:2000]


def char_bound(max_tokens: int, chars_per_token: int = CHARS_PER_TOKEN) -> int:
    return max(1, max_tokens) * max(1, chars_per_token)


def _last_word(windows: list[Any]) -> int | None:
    """The word of the last token (not a special one) of the last window that has one."""
    for window in reversed(windows):
        for word in reversed(window.word_ids):
            if word is not None:
                return int(word)
    return None


def safe_cut(encoding: Any) -> bool:
    """Whether a cut input's encoding holds the whole input's first tokens (module docstring)."""
    if not encoding.overflowing:
        return False
    kept = _last_word([encoding])
    last = _last_word(list(encoding.overflowing))
    return kept is not None and last is not None and kept < last


def too_long(chars: int, bound: int, max_tokens: int) -> str:
    """The 413's message for an input `safe_cut` refused."""
    return (
        f"an input of {chars} characters is over the {bound}-character bound, and its first {bound} characters do "
        f"not make its first {max_tokens} tokens (the model reads no more) in whole words: send at most {bound} "
        f"characters"
    )


class TokenizerRefused(ValueError):
    """A tokenizer that makes too much of a probe input; its message is one line."""


def check_tokenizer(path: Path) -> Any:
    """The folder's `tokenizer.json` (without truncation and padding); TokenizerRefused for one that makes too much
    of the probe, or that the library cannot read."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - whatever the library raises for a file it cannot read
        raise TokenizerRefused(
            f"{file}: the tokenizers library cannot read it ({' '.join(str(exc).split())})"
        ) from None
    tok.no_truncation()
    tok.no_padding()
    for probe in (SHORT_PROBE, PROBE):
        size = len(probe.encode())
        if tok.normalizer is not None:
            grown = len(tok.normalizer.normalize_str(probe).encode())
            if grown > MAX_NORMALIZED_GROWTH * size:
                raise TokenizerRefused(
                    f"{file}: its normalizer turns {size} bytes of text into {grown} (over "
                    f"{MAX_NORMALIZED_GROWTH:g}x): refused"
                )
        tokens = len(tok.encode(probe).ids)
        if tokens > MAX_TOKENS_PER_CHAR * len(probe):
            raise TokenizerRefused(
                f"{file}: it makes {tokens} tokens of {len(probe)} characters (over {MAX_TOKENS_PER_CHAR:g} a "
                f"character): refused"
            )
    return tok
