"""deploy/kubernetes: every manifest validates against the Kubernetes schemas (offline, strict),
and the replicas are wired to the router the way docs/router.md says."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"


def _documents() -> list[dict]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_is_valid_kubernetes(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or wrong field


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
