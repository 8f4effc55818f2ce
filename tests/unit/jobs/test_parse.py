"""The job body parser in process (issue 28's second hardening round, item 4): a lone surrogate is refused in any
slicing of the body."""

from __future__ import annotations


def test_the_job_parser_finds_a_lone_surrogate_in_any_slicing():
    from batchserve.errors import ApiError
    from batchserve.jobs.parse import JobBodyParser

    def parse(body: bytes, step: int) -> list[str] | str:
        parser = JobBodyParser(10, 100)
        try:
            for at in range(0, len(body), step):
                parser.feed(body[at : at + step])
            return parser.finish().inputs
        except ApiError as err:
            return err.code

    for step in (1, 2, 5, 7, 1000):
        assert parse(rb'{"inputs": ["a\ud800b"]}', step) == "INVALID_REQUEST"  # yajl made it "a?b"
        assert parse(rb'{"inputs": ["a\ud800"]}', step) == "INVALID_REQUEST"
        assert parse(rb'{"inputs": ["x"], "metadata": {"k": "\udc00"}}', step) == "INVALID_REQUEST"
        assert parse(rb'{"inputs": ["odd \\\ud800"]}', step) == "INVALID_REQUEST"
        assert parse(rb'{"inputs": ["ok \ud83d\ude00"]}', step) == ["ok \U0001f600"]  # a pair is fine
        assert parse(rb'{"inputs": ["lit \\ud800"]}', step) == ["lit \\ud800"]  # an escaped backslash


def test_an_integer_past_64_bits_is_named_as_such_not_as_broken_json():
    import pytest

    from batchserve.errors import ApiError
    from batchserve.jobs.parse import JobBodyParser

    for body in (
        b'{"inputs": ["a"], "metadata": {"n": 123456789012345678901234567890}}',
        b'{"inputs": ["a", -123456789012345678901234567890]}',
    ):
        parser = JobBodyParser(10, 100)
        with pytest.raises(ApiError) as caught:
            parser.feed(body)
            parser.finish()
        assert caught.value.status == 400 and "integer outside the 64-bit range" in caught.value.message
        assert "not valid JSON" not in caught.value.message
