"""Token ids in, text deltas out: incremental detokenization and stop strings.

Decoding is the tokenizers library's `DecodeStream` (it holds back a partial UTF-8 character until the token
that completes it arrives). Stop strings are matched on the decoded text; any tail that could still grow into a
stop string is held back, so a client never receives half of a stop string.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class TextStream:
    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer  # a `tokenizers.Tokenizer` (a transformers tokenizer's `backend_tokenizer`)
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False  # a stop string was found; the text before it has been returned

    def push(self, token_id: int) -> str:
        """The text this token makes safe to send (often "", never past a stop string)."""
        if self.stopped:
            return ""
        piece = self._decoder.step(self._tokenizer, token_id) or ""
        if not self._stops:
            return piece
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        hold = max(
            (n for s in self._stops for n in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:n])),
            default=0,
        )
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold]

    def flush(self) -> str:
        """What was held back, once the sequence has ended without reaching a stop string."""
        out, self._held = self._held, ""  # nothing is held once a stop string is found
        return out
