"""The pure parts of file storage (issue 34): the line splitter shared by the checking pass and the stores'
copy, the streaming multipart reader, the upload cap, the byte bounds, and the input file check."""

from __future__ import annotations

import orjson
import pytest

from batchserve.errors import ApiError
from batchserve.jobs.files import LineSplitter, LineTooLong, StorageFull, StorageLimits
from batchserve.jobs.openai_batch import InputCheck, line_size, file_line, OUTPUT, ERRORS
from batchserve.jobs.store import ItemRow
from batchserve.jobs.upload import FormError, FormStream, UploadGate


def split_all(data: bytes, size: int, max_line: int = 1 << 30) -> list[bytes]:
    s = LineSplitter(max_line)
    out: list[bytes] = []
    for i in range(0, len(data), size):
        out += s.feed(data[i : i + size])
    return out + s.end()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 1 << 20])
def test_lines_are_the_same_whatever_the_chunks(size: int) -> None:
    data = b'{"a": 1}\r\n\n  \n{"b": [1, 2]}\n{"c": "x y"}  \n\n{"d": 4}'
    assert split_all(data, size) == [b'{"a": 1}', b'{"b": [1, 2]}', b'{"c": "x y"}', b'{"d": 4}']


def test_a_line_over_the_bound_is_refused_before_it_is_gathered() -> None:
    with pytest.raises(LineTooLong):
        split_all(b"x" * 100 + b"\nshort\n", 7, max_line=50)
    with pytest.raises(LineTooLong):
        split_all(b"ok\n" + b"y" * 100, 1000, max_line=50)
    assert split_all(b"a" * 50 + b"\n", 3, max_line=50) == [b"a" * 50]


def multipart(parts: list[tuple[str, bytes, str | None]], boundary: bytes = b"XyZ") -> bytes:
    out = b""
    for name, value, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += b"--" + boundary + b"\r\nContent-Disposition: " + disp.encode() + b"\r\n\r\n" + value + b"\r\n"
    return out + b"--" + boundary + b"--\r\n"


@pytest.mark.parametrize("step", [1, 5, 4096])
def test_the_form_streams_the_file_part_out_and_keeps_the_small_fields(step: int) -> None:
    content = b"line one\r\nline two\n--XyZ is not the boundary here\n" * 50
    body = multipart(
        [("purpose", b"batch", None), ("file", content, "in.jsonl"), ("expires_after[seconds]", b"60", None)]
    )
    form = FormStream(b"XyZ")
    got = b""
    for i in range(0, len(body), step):
        form.feed(body[i : i + step])
        got += form.take()  # what the route stores every chunk: nothing accumulates
    form.finish()
    got += form.take()
    assert got == content and form.file_bytes == len(content) and form.filename == "in.jsonl"
    assert form.fields == {"purpose": "batch", "expires_after[seconds]": "60"}


def test_malformed_forms_are_form_errors() -> None:
    two = multipart([("file", b"a", "a"), ("file", b"b", "b")])
    with pytest.raises(FormError, match="more than one"):
        FormStream(b"XyZ").feed(two)
    cut = multipart([("file", b"abc", "a")])[:-10]
    form = FormStream(b"XyZ")
    form.feed(cut)
    with pytest.raises(FormError):
        form.finish()
    big = multipart([("purpose", b"p" * (70 << 10), None)])
    with pytest.raises(FormError, match="over"):
        FormStream(b"XyZ").feed(big)


def test_upload_gate_caps_per_tenant_then_in_all_and_frees_on_leave() -> None:
    gate = UploadGate(total=3, per_tenant=2)
    gate.enter("a")
    gate.enter("a")
    with pytest.raises(ApiError) as per:
        gate.enter("a")
    assert per.value.status == 429 and per.value.retry_after_ms
    gate.enter("b")
    with pytest.raises(ApiError) as full:
        gate.enter("c")
    assert full.value.status == 503
    gate.leave("a")
    gate.enter("c")
    for t in ("a", "b", "c"):
        gate.leave(t)
    assert gate.count == 0 and not gate.active


def test_storage_limits() -> None:
    limits = StorageLimits(tenant_bytes=100, total_bytes=1000)
    limits.check("t", 60, 500, 40, "x")  # exactly at the quota is allowed
    with pytest.raises(StorageFull) as tenant:
        limits.check("t", 61, 500, 40, "this upload")
    assert (
        not tenant.value.server and "this upload" in tenant.value.message and "--tenant-storage-mb" in str(tenant.value)
    )
    with pytest.raises(StorageFull) as server:
        limits.check("t", 0, 990, 20, "x")
    assert server.value.server and "--storage-max-mb" in server.value.message
    StorageLimits().check("t", 10**12, 10**12, 10**9, "x")  # 0: no bound
    own = StorageLimits(tenant_bytes=100, tenants={"big": 1000})  # [[keys]] storage_mb
    own.check("big", 500, 0, 400, "x")
    with pytest.raises(StorageFull, match="storage_mb"):
        own.check("big", 900, 0, 200, "x")
    with pytest.raises(StorageFull, match="--tenant-storage-mb"):
        own.check("other", 90, 0, 20, "x")
    assert own.bounded and not StorageLimits().bounded


def test_a_keys_storage_mb_is_its_tenants_quota(tmp_path) -> None:
    from batchserve.config import Settings
    from batchserve.config_file import apply_config_file

    path = tmp_path / "bs.toml"
    path.write_text('[[keys]]\ntenant = "acme"\ntier = "paid"\nsha256 = "' + "a" * 64 + '"\nstorage_mb = 5\n')
    s = Settings()
    apply_config_file(s, str(path))
    assert s.tenant_storage_mb_by_tenant == {"acme": 5.0} and "storage_mb" not in s.keys[0]
    path.write_text('[[keys]]\ntenant = "acme"\ntier = "paid"\nsha256 = "' + "a" * 64 + '"\nstorage_mb = -1\n')
    with pytest.raises(ValueError, match="storage_mb"):
        apply_config_file(Settings(), str(path))


def line(i: int, body: object, url: str = "/v1/embeddings") -> bytes:
    return orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) + b"\n"


def check(data: bytes, max_lines: int = 100, max_line: int = 1 << 20) -> InputCheck:
    c = InputCheck("/v1/embeddings", max_lines, max_line)
    for i in range(0, len(data), 5):
        c.feed(data[i : i + 5])
    c.end()
    return c


def test_input_check_counts_and_refuses_by_line() -> None:
    good = line(0, {"input": "a", "model": "m"}) + b"\n" + line(1, {"input": ["b"]})
    c = check(good)
    assert (c.lines, c.nbytes, c.models) == (2, len(good) - 3, {"m", None})
    for bad, words in [
        (line(0, {"input": "a"}) * 2, "appears twice"),
        (line(0, {}, url="/v1/inference"), "'url'"),
        (line(0, []), "'body' must be"),
        (b"{not json\n", "not JSON"),
        (
            line(0, {"input": "a"}) + line(1, {"input": orjson.Fragment(b"[" * 300 + b"]" * 300)}),
            "line 2: 'body' is nested too deeply",
        ),
        (b"\n\n", "no requests"),
    ]:
        with pytest.raises(ApiError) as err:
            check(bad)
        assert err.value.status == 400 and words in err.value.message, err.value.message
    with pytest.raises(ApiError, match="more than 1 requests"):
        check(line(0, {}) + line(1, {}), max_lines=1)
    with pytest.raises(ApiError, match="over 40 bytes"):
        check(line(0, {"input": "x" * 100}), max_line=40)


@pytest.mark.parametrize(
    "row",
    [
        ItemRow(3, "completed", '{"status_code": 200, "body": {"x": "é"}}', None, None),
        ItemRow(4, "failed", '{"status_code": 400, "body": {}}', "INVALID", "bad"),
        ItemRow(5, "cancelled", None, "CANCELLED", "the job was cancelled"),
    ],
)
def test_line_size_is_the_rendered_lines_length(row: ItemRow) -> None:
    row.input = line(row.index, {"input": "x"}).decode()
    kind, size = line_size("batch_abc", row)
    rendered = file_line("batch_abc", row, kind)
    assert kind == (OUTPUT if row.status == "completed" else ERRORS)
    assert rendered is not None and size == len(rendered)
