"""deploy/kserve/inferenceservice.yaml's container configuration on a live server (the sim for the GPU model,
free loopback ports for 8000/8001), driven over both of the ports it declares by Triton's clients and by
KServe's own Python v2 clients (`kserve.InferenceRESTClient`, `kserve.InferenceGRPCClient`). The manifests'
offline checks are tests/unit/test_kserve_manifests.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import LiveServer, start_server
from tests.integration.kserve.test_grpc import grpc_port
from tests.unit.test_kserve_manifests import container, env_of

TEXTS = ["ab", "kserve", "v2 over two ports"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("kserve-deploy")
    config = root / "config.toml"
    config.write_text('[[models]]\nname = "echo"\nbackend = "sim"\nsim_batch_ms = 5\n')
    env = dict(env_of(container()))
    assert env["PROTOCOL"] == "v2" and env["BATCHSERVE_GRPC_PORT"] == "8001"
    # Only the node's parts swapped for this machine: loopback, free ports, this test's config, no grace.
    env.update(
        BATCHSERVE_HOST="127.0.0.1",
        BATCHSERVE_GRPC_PORT="0",
        BATCHSERVE_CONFIG=str(config),
        BATCHSERVE_DRAIN_GRACE_S="0",
    )
    s = start_server(env=env)
    yield s
    s.stop()


def test_tritons_clients_on_both_declared_ports(server: LiveServer):
    import tritonclient.grpc as triton_grpc
    import tritonclient.http as triton_http

    data = np.array([t.encode() for t in TEXTS], dtype=np.object_)
    http = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
    tensor = triton_http.InferInput("input", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(data)
    assert http.is_server_ready() and http.is_model_ready("echo")
    assert [b.decode() for b in http.infer("echo", [tensor]).as_numpy("output")] == [t[::-1] for t in TEXTS]
    http.close()

    grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port(server)}")
    tensor = triton_grpc.InferInput("input", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(data)
    assert grpc.is_server_ready() and grpc.is_model_ready("echo")
    assert [b.decode() for b in grpc.infer("echo", [tensor]).as_numpy("output")] == [t[::-1] for t in TEXTS]
    grpc.close()


KSERVE_CLIENT = textwrap.dedent(
    """
    import asyncio, json, sys

    import numpy as np
    from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig

    http_url, grpc_url, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])


    def request(binary):
        tensor = InferInput(name="input", shape=[len(texts)], datatype="BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=binary)
        return InferRequest(model_name="echo", infer_inputs=[tensor], request_id="kserve-client")


    def strings(response):
        return [v.decode() if isinstance(v, bytes) else v for v in response.outputs[0].as_numpy().tolist()]


    async def main():
        out = {}
        rest = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
        out["rest_ready"] = [await rest.is_server_live(http_url), await rest.is_server_ready(http_url),
                             await rest.is_model_ready(http_url, "echo")]
        out["rest"] = strings(await rest.infer(http_url, request(False), model_name="echo"))
        await rest.close()
        grpc = InferenceGRPCClient(grpc_url, timeout=30)
        out["grpc_ready"] = [await grpc.is_server_live(), await grpc.is_server_ready(),
                             await grpc.is_model_ready("echo")]
        out["grpc"] = strings(await grpc.infer(request(False)))
        await grpc.close()
        print(json.dumps(out))


    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def kserve_python() -> str:
    """A Python with KServe's client: `KSERVE_CLIENT_PYTHON` when set, else this one (`kserve` is in the test
    extra: with tritonclient 2.73 on protobuf 6, its protobuf<7 pin installs beside the rest)."""
    return os.environ.get("KSERVE_CLIENT_PYTHON") or sys.executable


def test_kserves_own_clients_on_both_declared_ports(server: LiveServer, kserve_python: str, tmp_path: Path):
    script = tmp_path / "kserve_client.py"
    script.write_text(KSERVE_CLIENT)
    done = subprocess.run(
        [kserve_python, str(script), server.url, f"127.0.0.1:{grpc_port(server)}", json.dumps(TEXTS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rest_ready"] == [True, True, True] and out["grpc_ready"] == [True, True, True]
    assert out["rest"] == out["grpc"] == [t[::-1] for t in TEXTS]
