"""Reading an upload as it streams in: a multipart/form-data body parsed incrementally (python-multipart's
streaming parser), the file part's bytes handed out a chunk at a time, and the cap on uploads in progress.

Not Starlette's form parser: it gathers each file part (in memory, then in a temporary file) before the route sees
any of it. Here the route feeds each body message to `FormStream` and stores the file's bytes every `CHUNK_BYTES`, so
an upload holds one chunk in memory, and no step holds the event loop longer than parsing one body message.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import partial

from python_multipart.multipart import MultipartParser, parse_options_header

from batchserve import errors
from batchserve.errors import ApiError

FIELD_MAX = 64 << 10  # one form field other than the file (purpose, expires_after[...])
FIELDS_MAX = 8
FILE_FIELD = "file"


class FormError(ValueError):
    """The multipart body cannot be read as the form an upload needs."""


@dataclass(eq=False)
class FormStream:
    """One multipart/form-data body, fed as it arrives: the `file` part's bytes gather in `pending` (the
    route takes them off with `take`), every other field (small) in `fields`."""

    boundary: bytes
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None  # set once the file part's headers are read
    file_bytes: int = 0  # bytes of the file part so far
    pending: bytearray = field(default_factory=bytearray)
    _parser: MultipartParser = field(init=False)
    _header: bytearray = field(default_factory=bytearray)
    _value: bytearray = field(default_factory=bytearray)
    _disposition: bytes = b""
    _name: str | None = None
    _field: bytearray = field(default_factory=bytearray)
    _in_file = False
    _ended = False

    def __post_init__(self) -> None:
        self._parser = MultipartParser(
            self.boundary,
            {
                "on_part_begin": self._part_begin,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
                "on_header_field": partial(self._gather, self._header),
                "on_header_value": partial(self._gather, self._value),
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_end": self._end,
            },
        )

    def feed(self, data: bytes) -> None:
        try:
            self._parser.write(data)
        except FormError:
            raise
        except Exception as exc:  # noqa: BLE001 - python-multipart's own errors: the body is malformed
            raise FormError(str(exc) or type(exc).__name__) from None

    def finish(self) -> None:
        self._parser.finalize()
        if not self._ended:
            raise FormError("the body ended before the form's closing boundary")

    def take(self) -> bytearray:
        """The file bytes gathered so far, handed over whole (no copy: a fresh buffer takes their place)."""
        data, self.pending = self.pending, bytearray()
        return data

    # -- parser callbacks ------------------------------------------------------------------------------------
    def _part_begin(self) -> None:
        self._disposition, self._name, self._in_file = b"", None, False
        self._field.clear()

    def _gather(self, into: bytearray, data: bytes, start: int, end: int) -> None:
        into += data[start:end]  # a header's name or value, in pieces

    def _header_end(self) -> None:
        if bytes(self._header).lower() == b"content-disposition":
            self._disposition = bytes(self._value)
        self._header.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        name = options.get(b"name")
        if name is None:
            raise FormError("a part has no name in its Content-Disposition")
        self._name = name.decode("latin-1")
        if self._name == FILE_FIELD:
            if self.filename is not None:
                raise FormError("the form has more than one 'file' part")
            self._in_file = True
            raw = options.get(b"filename")
            self.filename = raw.decode("utf-8", "replace") if raw else "upload.jsonl"
        elif len(self.fields) >= FIELDS_MAX:
            raise FormError(f"the form has more than {FIELDS_MAX} fields")

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.pending += data[start:end]
            self.file_bytes += end - start
            return
        self._field += data[start:end]
        if len(self._field) > FIELD_MAX:
            raise FormError(f"the form field {self._name!r} is over {FIELD_MAX} bytes")

    def _part_end(self) -> None:
        if self._name is not None and not self._in_file:
            self.fields[self._name] = self._field.decode("utf-8", "replace")
        self._in_file = False

    def _end(self) -> None:
        self._ended = True


@dataclass(eq=False)
class UploadGate:
    """Upload places: at most `total` uploads in progress and `per_tenant` per tenant (0 = no cap), a tenant being a
    scheduling lane (all callers without a key are one). An upload holds memory, a store writer and event-loop time
    while its body arrives, so no tenant (nor the anonymous crowd) may hold every place: a tenant already holding
    one may not take the last `kept_free` free places, kept for tenants holding none."""

    total: int
    per_tenant: int
    active: Counter[str] = field(default_factory=Counter)
    count: int = 0

    @property
    def kept_free(self) -> int:
        """Places only a tenant holding none may take: one tenant's share, where the server has room beyond it."""
        return min(self.per_tenant, max(0, self.total - self.per_tenant))

    def enter(self, tenant: str, anonymous: bool = False) -> None:
        """Take a place, or refuse: 429 when the tenant holds its share, 503 when the server is full."""
        held = self.active[tenant]
        who = "callers without a key (together one tenant) already have" if anonymous else "you already have"
        busy = f"{who} {held} uploads in progress"
        if self.per_tenant and held >= self.per_tenant:
            why = f"the most one tenant may (--files-max-uploads-per-tenant {self.per_tenant}); retry when one ends"
            raise errors.rate_limited(f"{busy}, {why}", 1000, {})
        if self.total and self.count >= self.total:
            raise errors.overloaded(
                f"the server already has {self.total} uploads in progress (--files-max-uploads); retry shortly", 1000
            )
        if held and self.total - self.count <= self.kept_free:
            why = f"the server's last {self.kept_free} upload places are kept for tenants with none"
            raise errors.rate_limited(
                f"{busy} and {why} (--files-max-uploads {self.total}); retry when one of yours ends", 1000, {}
            )
        self.active[tenant] += 1
        self.count += 1

    def leave(self, tenant: str) -> None:
        self.count -= 1
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]


@dataclass(frozen=True, slots=True)
class UploadPace:
    """The slowest an upload may arrive: `min_bps` bytes a second on average, counted from its start but only
    checked from `grace_s` on (0 = no floor). An upload slower than that holds its place, a store writer and
    its reserved bytes for nothing, so it is ended (408)."""

    min_bps: float
    grace_s: float
    start: float  # the loop time the upload began

    def deadline(self, received: int) -> float | None:
        """Loop time by which more bytes must have come, given `received` so far (None: no floor)."""
        if self.min_bps <= 0:
            return None
        return self.start + max(self.grace_s, received / self.min_bps)

    def too_slow(self, received: int, now: float) -> ApiError:
        return errors.request_timeout(
            f"the upload arrived slower than {self.min_bps / 1000:g} KB/s (--files-upload-min-kbps): "
            f"{received} bytes in {now - self.start:.1f} s; it was ended and nothing of it was kept"
        )
