"""deploy/kubernetes: every manifest validates offline and strictly — built-in kinds against the
Kubernetes schemas (kubernetes-validate), the Gateway API and inference extension kinds against
their upstream CRDs' schemas (tests/data/crds, README there) — and the pieces are wired the way
docs/router.md and docs/deploy.md say."""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvserve.commands import build_parser
from kvserve.config import CacheConfig

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
CRDS = Path(__file__).resolve().parent / "data" / "crds"
K8S_VERSION = "1.30.0"


def _documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused wherever it lists its fields, as the API server's
    strict field validation refuses them (`x-kubernetes-preserve-unknown-fields` keeps them)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, strict."""
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        for v in crd["spec"]["versions"]:
            schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
            schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by the API server, not the CRD
            out[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = _strict(schema)
    return out


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc):
    crd_schema = _crd_schemas().get((doc["apiVersion"], doc["kind"]))
    if crd_schema is not None:
        jsonschema.validate(doc, crd_schema)  # raises on an unknown field, a wrong type or a missing one
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or wrong field


def test_a_crd_schema_refuses_what_the_api_server_would():
    route = next(d for d in _documents() if d["kind"] == "HTTPRoute")
    schema = _crd_schemas()[("gateway.networking.k8s.io/v1", "HTTPRoute")]
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["backendRef"] = bad["spec"]["rules"][0].pop("backendRefs")  # misspelt
    with pytest.raises(jsonschema.ValidationError, match="backendRef"):
        jsonschema.validate(bad, schema)
    pool = next(d for d in _documents() if d["kind"] == "InferencePool")
    bad = copy.deepcopy(pool)
    del bad["spec"]["endpointPickerRef"]["name"]
    with pytest.raises(jsonschema.ValidationError, match="'name' is a required property"):
        jsonschema.validate(bad, _crd_schemas()[("inference.networking.k8s.io/v1", "InferencePool")])


def test_replicas_join_the_router_service_and_drain_before_they_are_killed():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _documents()}
    router_service = docs[("Service", "kvserve-router")]
    port = router_service["spec"]["ports"][0]["port"]
    pod = docs[("Deployment", "kvserve-replica")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert f"--join=http://kvserve-router:{port}" in container["args"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "preStop" in container["lifecycle"]
    drain = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("--drain-timeout="))
    assert pod["terminationGracePeriodSeconds"] > drain + 3
    assert router_service["spec"]["selector"] == docs[("Deployment", "kvserve-router")]["spec"]["selector"]["matchLabels"]


def test_inference_pool_selects_the_replicas_and_its_picker_reads_their_events():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _documents()}
    pool = docs[("InferencePool", "kvserve-pool")]["spec"]
    replicas = docs[("Deployment", "kvserve-pool")]["spec"]["template"]
    labels, container = replicas["metadata"]["labels"], replicas["spec"]["containers"][0]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert [p["number"] for p in pool["targetPorts"]] == [ports["http"]]

    # the replicas' own command line, as kvserve parses it (a misspelt flag fails here)
    args = build_parser().parse_args(container["args"])
    assert (args.port, args.api_key) == (ports["http"], None)  # the picker calls render without a key
    assert not any(e["name"] == "KVSERVE_API_KEY" for e in container.get("env", []))
    assert args.kv_events_endpoint == f"tcp://*:{ports['kv-events']}"
    assert args.kv_events_replay_endpoint == f"tcp://*:{ports['kv-replay']}"

    picker = docs[("Service", pool["endpointPickerRef"]["name"])]
    assert {p["name"]: p["port"] for p in picker["spec"]["ports"]}["grpc-ext-proc"] == pool["endpointPickerRef"]["port"]["number"]
    epp = docs[("Deployment", "kvserve-epp")]["spec"]["template"]["spec"]
    assert "--pool-name=kvserve-pool" in epp["containers"][0]["args"]
    assert picker["spec"]["selector"].items() <= docs[("Deployment", "kvserve-epp")]["spec"]["template"]["metadata"]["labels"].items()

    config = yaml.safe_load(docs[("ConfigMap", "kvserve-epp")]["data"]["config.yaml"])
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    tokens = plugins["token-producer"]
    assert tokens["modelName"] == args.served_model_name
    render = docs[("Service", tokens["vllm"]["url"].split("//")[1].split(":")[0])]["spec"]
    assert render["selector"].items() <= labels.items() and render["ports"][0]["targetPort"] == "http"
    precise = plugins["precise-prefix-cache-producer"]
    events = precise["kvEventsConfig"]
    assert events["podDiscoveryConfig"]["socketPort"] == ports["kv-events"]
    assert events["podDiscoveryConfig"]["replaySocketPort"] == ports["kv-replay"]
    key, _, value = events["podDiscoveryConfig"]["podLabelSelector"].partition("=")
    assert labels[key] == value
    # the picker subscribes to "kv@" and reads the pod and the model from "kv@<pod>@<model>"
    assert args.kv_events_topic.startswith(events["topicFilter"])
    assert args.kv_events_topic.split("@")[2] == args.served_model_name
    assert precise["tokenProcessorConfig"]["blockSize"] == CacheConfig().block_size
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    assert labels["llm-d.ai/engine-type"] == "vllm"  # kvserve serves the vLLM metric names the picker reads

    route = docs[("HTTPRoute", "kvserve")]["spec"]
    assert route["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": "kvserve-pool"}]
    assert route["parentRefs"][0]["name"] in {name for kind, name in docs if kind == "Gateway"}
