"""deploy/llm-d/endpoint-picker-config.yaml against the llm-d endpoint picker's config types (vendored as a JSON
schema in deploy/llm-d/vendor/, strict as the picker's own decoder: an unknown key fails), its references
against each other, its metric selectors against the series batchserve exports, and the pod label that picks
the mapping against deploy/k8s/deployment.yaml."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from batchserve.config import Settings
from batchserve.core.load_signal import GatewayGauges, ModelLoad
from batchserve.metrics import make_metrics

ROOT = Path(__file__).resolve().parents[2]
LLMD = ROOT / "deploy" / "llm-d"
VENDOR = LLMD / "vendor"
SCHEMA = json.loads((VENDOR / "endpointpickerconfig.schema.json").read_text())
ENGINE = "batchserve"


def config() -> dict:
    return yaml.safe_load((LLMD / "endpoint-picker-config.yaml").read_text())


def validator(definition: str | None = None) -> jsonschema.Draft202012Validator:
    schema = SCHEMA if definition is None else {"$ref": f"#/$defs/{definition}", "$defs": SCHEMA["$defs"]}
    return jsonschema.Draft202012Validator(schema)


def plugin(cfg: dict, type_: str) -> dict:
    found = [p for p in cfg["plugins"] if p["type"] == type_]
    assert len(found) == 1, f"one {type_} plugin expected"
    return found[0]


def scorer(cfg: dict, name: str) -> dict:
    return next(p for p in cfg["plugins"] if p.get("name") == name)


def engine_config(cfg: dict) -> dict:
    engines = plugin(cfg, "core-metrics-extractor")["parameters"]["engineConfigs"]
    return next(e for e in engines if e["name"] == ENGINE)


def test_the_config_validates_against_the_pickers_types():
    validator().validate(config())


def test_the_schema_accepts_the_pickers_own_examples():
    """The transcription is not stricter than upstream: its sample configs validate too."""
    examples = VENDOR / "examples"
    validator().validate(yaml.safe_load((examples / "epp-config.yaml").read_text()))
    validator().validate(yaml.safe_load((examples / "payload-agnostic.yaml").read_text()))
    extractor = yaml.safe_load((examples / "core-metrics-extractor-custom-engine.yaml").read_text())
    validator("pluginSpec").validate(extractor)
    fragment = yaml.safe_load((examples / "endpoint-attribute-scorer-fixed-range.yaml").read_text())
    validator().validate({"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", **fragment})


@pytest.mark.parametrize(
    "mistake",
    [
        lambda c: engine_config(c).update(queuedRequestSpec=engine_config(c).pop("queuedRequestsSpec")),
        lambda c: c.pop("schedulingProfiles"),
        lambda c: c.update(apiVersion="inference.networking.x-k8s.io/v1alpha1"),
        lambda c: plugin(c, "core-metrics-extractor")["parameters"].update(engineLabel="llm-d.ai/engine-type"),
        lambda c: c["plugins"][-1].pop("type"),
        lambda c: c["schedulingProfiles"][0]["plugins"][0].update(wieght=1),
        lambda c: scorer(c, "load-ratio-scorer")["parameters"]["algorithm"].update(type="lower_is_better"),
    ],
    ids=[
        "misspelt-engine-key",
        "no-profiles",
        "old-api-group",
        "unknown-extractor-key",
        "no-type",
        "misspelt-weight",
        "unknown-algorithm",
    ],
)
def test_the_schema_rejects_what_the_picker_rejects(mistake):
    broken = copy.deepcopy(config())
    mistake(broken)
    with pytest.raises(jsonschema.ValidationError):
        validator().validate(broken)


def test_every_reference_names_a_declared_plugin_of_a_known_type():
    cfg = config()
    names = {p.get("name") or p["type"] for p in cfg["plugins"]}
    assert len(names) == len(cfg["plugins"]), "plugin names must be unique"
    assert {p["type"] for p in cfg["plugins"]} <= set(SCHEMA["x-plugin-types"])
    refs = [p["pluginRef"] for profile in cfg["schedulingProfiles"] for p in profile["plugins"]]
    refs += [s["pluginRef"] for s in cfg["dataLayer"]["sources"]]
    refs += [e["pluginRef"] for s in cfg["dataLayer"]["sources"] for e in s["extractors"]]
    refs += [p["pluginRef"] for p in cfg["requestHandler"]["parsers"]]
    assert set(refs) <= names
    # the fallback parser is last: the picker stops registering at the first parser that claims no paths
    assert cfg["requestHandler"]["parsers"][-1]["pluginRef"] == "passthrough-parser"


def test_the_attribute_scorers_read_attributes_the_extractor_produces():
    cfg = config()
    produced = {m["attributeKey"] for m in engine_config(cfg).get("customMetrics", [])}
    scorers = [p for p in cfg["plugins"] if p["type"] == "endpoint-attribute-scorer"]
    assert scorers
    for scorer in scorers:
        assert scorer["parameters"]["attributeKey"] in produced


def test_the_pods_carry_the_engine_label_the_extractor_maps():
    params = plugin(config(), "core-metrics-extractor")["parameters"]
    assert params.get("engineLabelKey", SCHEMA["x-engine-label-key"]) == SCHEMA["x-engine-label-key"]
    assert ENGINE not in SCHEMA["x-built-in-engines"]
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[SCHEMA["x-engine-label-key"]] == ENGINE
    assert params["defaultEngine"] == ENGINE


# The picker's selector syntax (pkg/epp/framework/plugins/datalayer/extractor/metrics/spec.go): a metric name
# and optional {label=value,...}, values quoted or not.
SPEC = re.compile(r"^\s*(\S+?)\s*(?:\{([^}]*)\})?\s*$")
LABEL = re.compile(r'^\s*(\S+?)\s*=\s*"([^"]*)"\s*$')
ADD_QUOTES = re.compile(r'(\w+)\s*=\s*([^",}\s]+)')


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    m = SPEC.match(ADD_QUOTES.sub(r'\1="\2"', spec))
    assert m and re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", m[1]), f"not a metric selector: {spec!r}"
    labels = {}
    for pair in filter(None, (m[2] or "").split(",")):
        lm = LABEL.match(pair)
        assert lm, f"bad label pair {pair!r} in {spec!r}"
        labels[lm[1]] = lm[2]
    return m[1], labels


def exported(model: str) -> list[tuple[str, dict[str, str]]]:
    """Every sample a node serving `model` exports on /metrics (the load gauges as the runtime registers them)."""
    registry: CollectorRegistry = make_metrics().registry
    GatewayGauges(lambda: {model: ModelLoad(waiting=2, running=3, kv_usage=0.25)}, registry)
    text = generate_latest(registry).decode()
    return [(s.name, s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


def test_every_selector_picks_exactly_one_series_batchserve_exports():
    engine = engine_config(config())
    specs = [
        engine[k]
        for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec")
        if engine.get(k)
    ]
    specs += [m["metricSpec"] for m in engine["customMetrics"]]
    assert len(specs) == 5
    samples = exported(Settings().generation_model)  # the image's generation model
    for spec in specs:
        name, labels = parse_spec(spec)
        matching = [s for s in samples if s[0] == name and labels.items() <= s[1].items()]
        assert len(matching) == 1, f"{spec} selects {matching}"


def test_a_selector_for_another_model_selects_nothing():
    name, labels = parse_spec(engine_config(config())["queuedRequestsSpec"])
    assert not [s for s in exported("sim@1") if s[0] == name and labels.items() <= s[1].items()]


def test_the_docs_name_the_pickers_headers_and_no_deprecated_flag():
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for header in ("fairnessId", "objective"):
        assert SCHEMA["x-request-headers"][header] in docs
    for flag in SCHEMA["x-deprecated-flags"]:
        assert flag + "=" not in docs, f"docs/deploy.md still passes {flag}, which the picker now refuses"
