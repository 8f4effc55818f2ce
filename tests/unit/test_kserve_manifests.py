"""deploy/kserve against KServe's InferenceService and KEDA's ScaledObject CRD schemas (vendored in
deploy/kserve/vendor/), strict as `kubectl apply --validate=strict` is (an unknown field fails), and against the
server: ports, probes and drain as batchserve serves them, the scaler on the metric it exports."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client import generate_latest

from batchserve.config import cli_fields
from batchserve.config_env import env_name
from batchserve.metrics import make_metrics

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "deploy" / "kserve"
VENDOR = KSERVE / "vendor"
LOAD_SIGNAL = "batchserve_load_ratio"


def strict(schema: object) -> object:
    """A CRD's structural schema as JSON Schema that refuses unknown fields: every object that lists its
    properties and neither declares additionalProperties nor preserves unknown fields gets
    `additionalProperties: false`, and int-or-string fields accept both."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def isvc_validator() -> jsonschema.Draft7Validator:
    vendored = json.loads((VENDOR / "serving.kserve.io_inferenceservices.v1beta1.json").read_text())
    return jsonschema.Draft7Validator(strict(vendored["openAPIV3Schema"]))


def keda_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((VENDOR / "keda.sh_scaledobjects.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def isvc() -> dict:
    return yaml.safe_load((KSERVE / "inferenceservice.yaml").read_text())


def scaled_object() -> dict:
    return yaml.safe_load((KSERVE / "keda-scaledobject.yaml").read_text())


def container(doc: dict | None = None) -> dict:
    return (doc or isvc())["spec"]["predictor"]["containers"][0]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in c["env"]}


def test_the_inference_service_validates_against_kserves_crd():
    doc = isvc()
    assert doc["apiVersion"] == "serving.kserve.io/v1beta1" and doc["kind"] == "InferenceService"
    isvc_validator().validate(doc)


def test_the_scaled_object_validates_against_kedas_crd():
    doc = scaled_object()
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] == "ScaledObject"
    keda_validator().validate(doc)


def misspelt_probe(d: dict) -> None:
    container(d)["readinesProbe"] = container(d).pop("readinessProbe")


@pytest.mark.parametrize(
    "mistake",
    [
        misspelt_probe,
        lambda d: d["spec"]["predictor"].update(protocolVersion="v2"),  # only a model spec has it, not a container
        lambda d: d["spec"]["predictor"].update(containerConcurrency="0"),
        lambda d: container(d)["ports"][1].update(containerPort="8001"),
        lambda d: d["spec"].pop("predictor"),
    ],
    ids=[
        "misspelt-probe",
        "protocolVersion-on-a-custom-predictor",
        "string-concurrency",
        "string-port",
        "no-predictor",
    ],
)
def test_the_isvc_schema_rejects_a_broken_manifest(mistake):
    broken = copy.deepcopy(isvc())
    mistake(broken)
    with pytest.raises(jsonschema.ValidationError):
        isvc_validator().validate(broken)


@pytest.mark.parametrize(
    "mistake",
    [
        lambda d: d["spec"]["triggers"][0]["metadata"].update(threshold=0.75),  # metadata values are strings
        lambda d: d["spec"].update(minReplicas=1),
        lambda d: d["spec"]["scaleTargetRef"].pop("name"),
    ],
    ids=["numeric-threshold", "hpa-field-name", "no-target-name"],
)
def test_the_keda_schema_rejects_a_broken_manifest(mistake):
    broken = copy.deepcopy(scaled_object())
    mistake(broken)
    with pytest.raises(jsonschema.ValidationError):
        keda_validator().validate(broken)


def test_a_custom_v2_predictor_on_both_ports():
    doc = isvc()
    predictor = doc["spec"]["predictor"]
    c = container(doc)
    assert c["name"] == "kserve-container"
    env = env_of(c)
    assert env["PROTOCOL"] == "v2"  # KServe's check for a custom predictor accepts v1 or v2
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert list(ports) == ["http1", "h2c"]  # the first port is the Service's port 80; h2c marks gRPC
    assert int(env["BATCHSERVE_PORT"]) == ports["http1"]
    assert int(env["BATCHSERVE_GRPC_PORT"]) == ports["h2c"]
    # Two ports in one container: Knative's (Serverless) mode allows one, KServe's Standard mode both.
    assert doc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert predictor["containerConcurrency"] == 0
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] == ports["http1"]


def test_every_batchserve_variable_is_a_server_setting():
    known = {env_name(f.name) for f in cli_fields()}
    ours = {name for name in env_of(container()) if name.startswith("BATCHSERVE_")}
    assert ours and ours <= known, f"not batchserve settings: {ours - known}"


def test_grace_period_outlasts_prestop_and_the_drain():
    """As deploy/k8s: the drain and the grace run side by side from SIGTERM, then up to 1 s for leftovers,
    0.5 s linger and uvicorn's graceful shutdown (5 s); readiness notices the drain within the grace."""
    predictor = isvc()["spec"]["predictor"]
    c = container()
    env = env_of(c)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain_s, grace_s = float(env["BATCHSERVE_DRAIN_TIMEOUT_S"]), float(env["BATCHSERVE_DRAIN_GRACE_S"])
    needed = float(pre_stop[1]) + max(drain_s + 1.0, grace_s) + 0.5 + 5
    assert predictor["terminationGracePeriodSeconds"] > needed
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r["failureThreshold"] <= grace_s


def test_keda_scales_the_predictor_kserve_makes_on_the_load_signal():
    doc, so = isvc(), scaled_object()
    assert doc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"  # no HPA of KServe's
    target = so["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] == doc["metadata"]["name"] + "-predictor"
    predictor = doc["spec"]["predictor"]
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (
        predictor["minReplicas"],
        predictor["maxReplicas"],
    )
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    assert query.startswith(f"sum({LOAD_SIGNAL}{{") and f'pod=~"{target["name"]}-.*"' in query
    hpa = yaml.safe_load((ROOT / "deploy" / "k8s" / "hpa.yaml").read_text())
    per_pod = hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"]
    assert float(trigger["metadata"]["threshold"]) == int(per_pod.removesuffix("m")) / 1000
    assert f"# TYPE {LOAD_SIGNAL} gauge" in generate_latest(make_metrics().registry).decode()


def test_the_pods_carry_the_endpoint_pickers_engine_label():
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    key = "llm-d.ai/engine-type"
    assert isvc()["spec"]["predictor"]["labels"][key] == deployment["spec"]["template"]["metadata"]["labels"][key]
