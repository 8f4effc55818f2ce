"""The v2 gRPC messages, built at start from the descriptor shipped in the package (`grpc_descriptor.py`, protoc's
output for `grpc_inference.proto`) into a descriptor pool of their own.

Why not generated `*_pb2.py` files: those register `inference.*` in protobuf's process-wide default pool, as
`tritonclient.grpc`'s own code does, so the two could not be imported in one process; and each stamps the protobuf
release that generated it, which the runtime refuses when older. A pool of our own works with every protobuf in
`PROTOBUF_RANGE`.
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOBUF_RANGE = ">=5.26,<8"  # as pyproject.toml's dependency; the fix a failure names
GRPCIO_RANGE = ">=1.60"
SERVICE = "inference.GRPCInferenceService"


class GrpcUnavailable(Exception):
    """`--grpc-port` cannot be served with what is installed; the message is one line that names the fix."""


@dataclass(frozen=True)
class Method:
    """One rpc of the service: its name and the classes of its request and response."""

    name: str
    request: type
    response: type


@dataclass(frozen=True)
class Messages:
    """The message classes by full name (`inference.ModelInferRequest`), and the service's methods in order."""

    classes: dict[str, type]
    methods: tuple[Method, ...]

    def __getattr__(self, name: str) -> type:
        """`messages.ModelInferResponse`: the class of `inference.<name>`."""
        try:
            return self.classes["inference." + name]
        except KeyError:
            raise AttributeError(name) from None


def load() -> Messages:
    """The classes, from the shipped descriptor; GrpcUnavailable when grpcio or protobuf cannot serve them."""
    try:
        import grpc  # noqa: F401 - the server's own import, checked here so its absence is said in one line
    except ImportError as exc:
        raise GrpcUnavailable(f"--grpc-port needs grpcio ({exc}): pip install 'grpcio{GRPCIO_RANGE}'") from None
    try:
        from google.protobuf import descriptor_pool, message_factory

        from batchserve.kserve.grpc_descriptor import SERIALIZED

        pool = descriptor_pool.DescriptorPool()
        file = pool.AddSerializedFile(SERIALIZED)
        classes = {m.full_name: message_factory.GetMessageClass(m) for m in file.message_types_by_name.values()}
        service = file.services_by_name[SERVICE.rpartition(".")[2]]
        methods = tuple(
            Method(m.name, classes[m.input_type.full_name], classes[m.output_type.full_name]) for m in service.methods
        )
    except Exception as exc:  # noqa: BLE001 - whatever an unfit protobuf raises, it is said in one line
        try:
            from google.protobuf import __version__ as found
        except ImportError:
            found = "none"
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GrpcUnavailable(
            f"--grpc-port cannot build its messages with protobuf {found} ({said}): "
            f"pip install 'protobuf{PROTOBUF_RANGE}'"
        ) from None
    return Messages(classes, methods)
