"""The declared shapes of KServe's v2 routes (`kserve/routes.py`): the infer request's JSON header, which
`parse.parse_infer` decodes into `V2InferRequest` (with the binary extension raw tensor bytes follow it, sliced by
hand: they are not JSON), the answers `routes.py` and `render.py` write, v2's error `{"error": message}`, and
their operations in /openapi.json."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from batchserve.http.openapi import DocAnswer, DocDialect, Operation, model_post, Param
from batchserve.http.shapes import Priority

MAX_ELEMENTS = 2048  # strings per request, as /v1/embeddings: each is an item on the batcher
MAX_DIMS = 8
INPUT_NAME = "input"  # a batchserve model's one input (BYTES) and one output, as v2 clients see them
OUTPUT_NAME = "output"
HEADER_LENGTH = "inference-header-content-length"  # the binary extension's JSON header length, in and out
EXTENSIONS = ["binary_tensor_data"]


class V2Error(Struct):
    """KServe v2's error body."""

    error: str


KSERVE = DocDialect("KServe v2", V2Error)


class V2Live(Struct):
    live: Literal[True]


class V2Ready(Struct, omit_defaults=True):
    ready: bool
    name: str | UnsetType = UNSET
    reason: Annotated[str, Meta(description="why not, when not ready")] | UnsetType = UNSET


class V2ServerMetadata(Struct):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(Struct):
    name: str
    datatype: str
    shape: list[int]


class V2ModelMetadata(Struct):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class InferParameters(Struct):
    timeout: Annotated[float, Meta(gt=0, description="the request's deadline in microseconds")] | None = None
    binary_data_output: Annotated[bool, Meta(description="the output tensor in binary")] | None = None
    priority: (
        Priority
        | Annotated[int, Meta(ge=0, description="Triton's priority level: 0 the default, 1 the highest (enterprise)")]
        | None
    ) = None


class InputParameters(Struct):
    binary_data_size: (
        Annotated[int, Meta(ge=0, description="with the binary extension: the tensor's bytes after the JSON header")]
        | None
    ) = None


class InputTensor(Struct):
    name: Literal["input"]
    datatype: Literal["BYTES"]
    shape: Annotated[list[Annotated[int, Meta(ge=0, le=MAX_ELEMENTS)]], Meta(max_length=MAX_DIMS)]
    parameters: InputParameters | None = None
    data: Annotated[Any, Meta(description="strings, flat or nested by the shape")] = None


class OutputParameters(Struct):
    binary_data: bool | None = None


class RequestedOutput(Struct):
    name: Literal["output"]
    parameters: OutputParameters | None = None


class V2InferRequest(Struct):
    """One BYTES input named `input`; each element (1 to 2048) is one item on the batcher. With the binary
    extension the JSON is followed by the tensor (Inference-Header-Content-Length). Members it does not know
    are ignored."""

    inputs: Annotated[list[InputTensor], Meta(min_length=1, max_length=1)]
    id: str | None = None
    parameters: InferParameters | None = None
    outputs: list[RequestedOutput] | None = None


class OutputTensor(Struct):
    name: Literal["output"]
    datatype: Literal["BYTES", "FP32"]
    shape: list[int]
    data: list[Any] | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET


class V2InferResponse(Struct):
    model_name: str
    outputs: list[OutputTensor]
    model_version: str | UnsetType = UNSET
    id: str | UnsetType = UNSET


_TAGS = ("KServe v2",)
_MODEL = Param("model", "path", Annotated[str, Meta(examples=["sim"])])
_VERSION = Param("version", "path", Annotated[str, Meta(examples=["v1"])])
_INFER_EXAMPLE = {"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2], "data": ["hello", "world"]}]}


def _params(path: str) -> tuple[Param, ...]:
    return tuple(p for p in (_MODEL, _VERSION) if f"{{{p.name}}}" in path)


def _get(path: str, op_id: str, summary: str, shape: Any, *errors: int) -> Operation:
    answers: tuple[DocAnswer, ...] = (DocAnswer(200, summary, shape, headers=()),)
    if shape is V2Ready:
        answers += (DocAnswer(400, "not ready (v2: a 4xx means false)", V2Ready, headers=()),)
    return Operation("GET", path, op_id, summary, answers, KSERVE, errors=errors, params=_params(path), tags=_TAGS)


_BINARY = (("application/octet-stream", Annotated[bytes, Meta(description="JSON header, then the raw tensors")]),)
_HEADER_LENGTH = Param(
    "Inference-Header-Content-Length",
    "header",
    Annotated[int, Meta(ge=0)],
    "with the binary extension: the length of the JSON header",
)


def _infer(path: str, op_id: str) -> Operation:
    return model_post(
        path,
        op_id,
        "KServe v2 infer: each element of the BYTES input rides the batcher",
        DocAnswer(
            200,
            "the output tensor: BYTES, or FP32 [..., dim] for embedding models; binary when asked "
            "(Inference-Header-Content-Length)",
            V2InferResponse,
            also=_BINARY,
        ),
        KSERVE,
        Annotated[V2InferRequest, Meta(examples=[_INFER_EXAMPLE])],
        request_also=_BINARY,
        params=(*_params(path), _HEADER_LENGTH),
        tags=_TAGS,
    )


def _versions(suffix: str, op_id: str, summary: str) -> list[tuple[str, str, str]]:
    """(path, operationId, summary) of `/v2/models/{model}<suffix>`, and of the same path of one version."""
    return [
        (f"/v2/models/{{model}}{path}{suffix}", f"v2Model{name}{op_id}", f"KServe v2 model {said}{summary}")
        for path, name, said in (("", "", ""), ("/versions/{version}", "Version", "version "))
    ]


OPERATIONS = (
    _get("/v2/health/live", "v2ServerLive", "KServe v2 server liveness", V2Live),
    _get("/v2/health/ready", "v2ServerReady", "KServe v2 server readiness", V2Ready),
    _get("/v2", "v2ServerMetadata", "KServe v2 server metadata", V2ServerMetadata),
    *(_get(*op, V2ModelMetadata, 404) for op in _versions("", "Metadata", "metadata")),
    *(_get(*op, V2Ready, 404) for op in _versions("/ready", "Ready", "readiness")),
    *(_infer(path, op_id) for path, op_id, _ in _versions("/infer", "Infer", "infer")),
)
