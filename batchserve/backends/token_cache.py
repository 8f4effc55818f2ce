"""The tokens an embedder or reranker keeps per input text, bounded in bytes.

The tokenizer stage makes an input's tokens once and the backend reads them twice (to cost it on the event loop,
to run it on the device thread), so they are kept by text: only the ids and type ids, as plain lists, never a
`tokenizers.Encoding` (a truncated input's carries every overflowing window: hundreds of kilobytes).

An LRU with a budget in bytes (each entry's own estimate, its text included), not a count of texts: long inputs
and many short ones fill it alike, and a refused request's entries go first. A text it no longer holds is
tokenized again where needed (a cost in time, never a wrong answer).
"""

from __future__ import annotations

import sys
import threading

from cachetools import LRUCache

CACHE_BYTES = 48 << 20  # the default budget: ~3,800 inputs of 256 tokens, or ~30,000 of 20
LIST_BYTES = 56  # an empty list's header (CPython, 64-bit)
INT_BYTES = 40  # one list slot and, at worst, one int object of its own (ids past 256 are not shared)
ENTRY_BYTES = 200  # the entry object, its slots, and the cache's own bookkeeping for it


class Tokens:
    """One input's tokens after truncation: what costing (`len(ids)`) and a forward pass read."""

    __slots__ = ("ids", "type_ids", "nbytes")

    def __init__(self, text: str, ids: list[int], type_ids: list[int]) -> None:
        self.ids = ids
        self.type_ids = type_ids
        self.nbytes = sys.getsizeof(text) + ENTRY_BYTES + 2 * LIST_BYTES + INT_BYTES * len(ids) + 8 * len(type_ids)


class TooLong:
    """An input whose tokens cannot be made from a bounded prefix of it (`tokenizer_guard.safe_cut`): answered
    with this 413 wherever it is costed, never tokenized whole."""

    __slots__ = ("message", "nbytes")

    def __init__(self, text: str, message: str) -> None:
        self.message = message
        self.nbytes = sys.getsizeof(text) + ENTRY_BYTES + sys.getsizeof(message)


Kept = Tokens | TooLong


class TokenCache:
    """Text -> `Kept`, least recently used first out, within `budget` bytes; safe to share between the stage's
    thread, the event loop and the device threads (one lock around each call)."""

    def __init__(self, budget: int = CACHE_BYTES) -> None:
        self._lru: LRUCache[str, Kept] = LRUCache(maxsize=max(1, budget), getsizeof=lambda kept: kept.nbytes)
        self._lock = threading.Lock()

    def get(self, text: str) -> Kept | None:
        with self._lock:
            return self._lru.get(text)

    def __contains__(self, text: str) -> bool:
        with self._lock:
            return text in self._lru

    def put(self, text: str, value: Kept) -> None:
        """Keep `value` (an entry larger than the whole budget is not kept)."""
        if value.nbytes > self._lru.maxsize:
            return
        with self._lock:
            self._lru[text] = value

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        """The bytes its entries are counted at now (at most the budget)."""
        return int(self._lru.currsize)
