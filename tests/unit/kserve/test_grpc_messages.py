"""The v2 gRPC messages (`kserve/grpc_messages.py`): the descriptor shipped in the package is the .proto as protoc
compiles it now (so the two cannot drift), the classes built from it live beside tritonclient's own generated code
in one process, and a protobuf that cannot build them is one line naming the install that fixes it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from batchserve.kserve import grpc_descriptor, grpc_messages
from scripts.grpc_descriptor import compile_proto, module_text

ROOT = Path(__file__).resolve().parents[3]


def test_the_shipped_descriptor_is_the_proto_compiled_now():
    compiled = compile_proto()
    shipped = descriptor_pb2.FileDescriptorProto.FromString(grpc_descriptor.SERIALIZED)
    assert shipped == descriptor_pb2.FileDescriptorProto.FromString(compiled), (
        "batchserve/kserve/grpc_descriptor.py is not grpc_inference.proto: run python scripts/grpc_descriptor.py"
    )
    assert (ROOT / "batchserve/kserve/grpc_descriptor.py").read_text() == module_text(compiled)


def test_a_proto_edit_is_caught(tmp_path: Path):
    """The comparison above can fail: a field added to the .proto changes what protoc makes."""
    proto = tmp_path / "batchserve/kserve/grpc_inference.proto"
    proto.parent.mkdir(parents=True)
    text = (ROOT / "batchserve/kserve/grpc_inference.proto").read_text()
    proto.write_text(text.replace("message ServerLiveRequest {}", "message ServerLiveRequest { int32 x = 1; }"))
    assert compile_proto(tmp_path) != compile_proto()


def test_the_messages_load_beside_tritonclients_generated_code():
    """tritonclient.grpc registers `inference.*` in protobuf's default pool; generated `*_pb2.py` of ours would
    clash with it ("duplicate symbol"), a pool of our own does not."""
    from tritonclient.grpc import service_pb2

    messages = grpc_messages.load()
    assert [m.name for m in messages.methods] == [
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
    ]
    theirs = service_pb2.ModelInferRequest(model_name="m", id="7")
    theirs.inputs.add(name="input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a cat")
    ours = messages.ModelInferRequest.FromString(theirs.SerializeToString())
    assert (ours.model_name, ours.id, list(ours.inputs[0].contents.bytes_contents)) == ("m", "7", [b"a cat"])
    assert messages.ModelMetadataResponse.TensorMetadata(name="x").name == "x"


def test_a_protobuf_that_cannot_build_them_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(grpc_descriptor, "SERIALIZED", b"\xff not a descriptor")
    with pytest.raises(grpc_messages.GrpcUnavailable) as caught:
        grpc_messages.load()
    said = str(caught.value)
    assert "\n" not in said and said.endswith(f"pip install 'protobuf{grpc_messages.PROTOBUF_RANGE}'"), said


def test_the_range_named_is_pyprojects():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "protobuf" + grpc_messages.PROTOBUF_RANGE in deps
    assert "grpcio" + grpc_messages.GRPCIO_RANGE in deps
