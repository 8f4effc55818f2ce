"""batchserve/logsafe.py: a caller's control characters never split a log record into lines."""

from __future__ import annotations

import io
import logging

from batchserve.logsafe import EscapeControlChars, printable


def test_printable_escapes_controls_and_cuts():
    assert printable("/a\nb\r\x1b[0m\u2028") == "/a\\x0ab\\x0d\\x1b[0m\\u2028"
    assert printable("x" * 10, limit=4) == "xxxx...(6 more)"


def test_the_filter_keeps_a_record_on_one_line_and_its_traceback_whole():
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(EscapeControlChars())
    log = logging.getLogger("test_logsafe")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("error on %s", "/x\nINFO forged")
        log.warning("plain %d", 5)
    finally:
        log.removeHandler(handler)
    lines = out.getvalue().splitlines()
    assert lines[0] == "error on /x\\x0aINFO forged" and lines[1].startswith("Traceback")
    assert lines[-1] == "plain 5"
