"""deploy/k8s validates against the Kubernetes schemas (kubernetes-validate, offline), and its parts agree with
each other and with the server (issue 14 item 4): probes on the routes that exist, a grace period longer than
preStop + drain, selectors that select the pods, the HPA's metric served by the adapter rule."""

from __future__ import annotations

import copy
import re
import shlex
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from batchserve.backends import NEEDS_MODEL_EXTRA
from batchserve.config import cli_fields
from batchserve.config_env import env_name
from batchserve.metrics import make_metrics

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # the oldest we document, and the newest known
LOAD_SIGNAL = "batchserve_load_ratio"


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> dict:
    found = [d for _, d in documents() if d["kind"] == kind]
    assert len(found) == 1, f"one {kind} expected, found {len(found)}"
    return found[0]


def container() -> dict:
    return by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c["env"]}


def test_every_manifest_validates_strictly():
    docs = documents()
    assert {d["kind"] for _, d in docs} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
    }
    for version in VERSIONS:
        for _name, doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    broken = copy.deepcopy(by_kind("Deployment"))
    c = broken["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


def test_deployment_runs_one_gpu_pod_per_node_with_the_probes_the_server_answers():
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    c = container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert (
        anti["labelSelector"]["matchLabels"].items()
        <= by_kind("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    assert int(env_of(c)["BATCHSERVE_PORT"]["value"]) == ports["http"]


def test_grace_period_outlasts_prestop_and_the_drain():
    pod = by_kind("Deployment")["spec"]["template"]["spec"]
    c = container()
    env = env_of(c)
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    sleep_s = float(pre_stop[1])
    drain_s = float(env["BATCHSERVE_DRAIN_TIMEOUT_S"]["value"])
    grace_s = float(env["BATCHSERVE_DRAIN_GRACE_S"]["value"])
    # The drain and the grace run side by side from SIGTERM; then up to 1 s for drain leftovers, 0.5 s linger
    # and uvicorn's graceful shutdown (5 s) before the process exits.
    needed = sleep_s + max(drain_s + 1.0, grace_s) + 0.5 + 5
    assert pod["terminationGracePeriodSeconds"] > needed
    # Readiness notices the drain within the grace (a probe period), so the pod leaves the endpoints first.
    r = c["readinessProbe"]
    assert r["periodSeconds"] * r["failureThreshold"] <= grace_s


def test_every_environment_variable_is_a_server_setting():
    known = {env_name(f.name) for f in cli_fields()}
    unknown = set(env_of(container())) - known
    assert not unknown, f"not batchserve settings: {unknown}"


def test_service_and_budget_select_the_pods():
    labels = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = by_kind("Service")["spec"]
    assert service["selector"].items() <= labels.items()
    assert service["ports"][0]["targetPort"] in {p["name"] for p in container()["ports"]}
    assert by_kind("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_hpa_scales_the_deployment_on_the_metric_the_adapter_serves():
    hpa = by_kind("HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["scaleTargetRef"]["name"] == by_kind("Deployment")["metadata"]["name"]
    metric = hpa["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == LOAD_SIGNAL
    rules = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    served = [r for r in rules if r["name"]["as"] == LOAD_SIGNAL]
    assert len(served) == 1
    rule = served[0]
    assert LOAD_SIGNAL in rule["seriesQuery"] and rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_the_server_exports_the_hpa_metric():
    from prometheus_client import generate_latest

    assert f"# TYPE {LOAD_SIGNAL} gauge" in generate_latest(make_metrics().registry).decode()


# -- the image serves every store the manifests configure (issue 24 item 1) ----------------------------------
ROOT = K8S.parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def image_extras(dockerfile: str | None = None) -> set[str]:
    """The extras of the Dockerfile's `pip install '.[a,b]'` line: what the image can serve."""
    text = DOCKERFILE.read_text() if dockerfile is None else dockerfile
    found = re.findall(r"pip install\s+['\"]?\.\[([^\]]*)\]", text)
    assert len(found) == 1, f"one `pip install '.[extras]'` line expected in the Dockerfile, found {found}"
    return {extra.strip() for extra in found[0].split(",")}


def image_env() -> dict[str, str]:
    """The Dockerfile's ENV settings (`ENV A=1 B=2`, continued lines joined)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(line[4:]))
    return env


def documented_secrets() -> dict[tuple[str, str], str]:
    """(secret, key) -> value of the `kubectl create secret generic NAME --from-literal=KEY=VALUE` lines of
    docs/deploy.md: what an operator following the docs puts in the Secrets the Deployment reads."""
    secrets = {}
    for line in (ROOT / "docs" / "deploy.md").read_text().splitlines():
        if line.startswith("kubectl create secret generic"):
            words = shlex.split(line)
            for word in words[4:]:
                if word.startswith("--from-literal="):
                    key, _, value = word.removeprefix("--from-literal=").partition("=")
                    secrets[(words[4], key)] = value
    return secrets


def rendered_env() -> dict[str, str]:
    """The container's environment as the pod sees it: the image's ENV, then the manifest's values, with every
    secretKeyRef resolved from the documented `kubectl create secret` commands."""
    env = image_env()
    secrets = documented_secrets()
    for name, item in env_of(container()).items():
        if "value" in item:
            env[name] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) in secrets, f"{name}: secret {ref} is not in docs/deploy.md"
            env[name] = secrets[(ref["name"], ref["key"])]
    return env


def extras_needed(env: dict[str, str]) -> set[str]:
    """Which of batchserve's extras the configured server imports."""
    needed = set()
    if env.get("BATCHSERVE_JOBS_DB", "").startswith(("postgresql://", "postgres://")):
        needed.add("postgres")
    if env.get("BATCHSERVE_BACKEND", "sim") in NEEDS_MODEL_EXTRA:
        needed.add("model")
    return needed


def test_the_image_installs_every_extra_the_manifests_configure():
    env = rendered_env()
    assert env["BATCHSERVE_JOBS_DB"].startswith("postgresql://")  # the shared store the docs set up
    needed = extras_needed(env)
    assert {"postgres", "model"} <= needed
    assert needed <= image_extras(), f"the image lacks {needed - image_extras()} for deploy/k8s"
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert image_extras() <= declared.keys()


def test_the_extras_check_sees_a_missing_postgres_extra():
    """The check above fails for the image as it was (`.[model]`, a postgresql:// store)."""
    before = DOCKERFILE.read_text().replace(".[model,postgres]", ".[model]")
    assert image_extras(before) == {"model"}
    assert extras_needed(rendered_env()) - image_extras(before) == {"postgres"}
