"""Log lines a caller cannot forge: control characters in what a caller sent (a path with an encoded `%0A`, a
header) are escaped before they reach the log, so one record stays one line and no caller writes a line that
reads as the server's own.

`printable` is for the places that log a caller's text; `EscapeControlChars` is a filter on the root handlers, so
every record is one line whatever its arguments held (a traceback keeps its lines).
"""

from __future__ import annotations

import logging
import re

# C0 controls (newline, carriage return, escape ...), DEL, C1 controls and the Unicode line/paragraph separators
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
MAX_LOGGED_CHARS = 2000  # of one caller-given value in a log line


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """`text` with every control character escaped (`\\x0a`), cut to `limit` characters."""
    cut = text if len(text) <= limit else f"{text[:limit]}...({len(text) - limit} more)"
    return CONTROL.sub(_escape, cut)


class EscapeControlChars(logging.Filter):
    """A handler filter: a record whose message holds a control character is rewritten with it escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if CONTROL.search(message):
            record.msg, record.args = CONTROL.sub(_escape, message), None
        return True


def install() -> None:
    """Put the filter on every handler of the root logger (after `logging.basicConfig`)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, EscapeControlChars) for f in handler.filters):
            handler.addFilter(EscapeControlChars())
