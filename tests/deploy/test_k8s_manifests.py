"""The Kubernetes manifests in deploy/k8s: valid against the Kubernetes API schema (offline,
strict: an unknown field fails), and consistent with each other, with the rules and with
the kvfence CLI they call."""

from __future__ import annotations

import copy
import re
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from deploy_files import (
    RULES,
    containers,
    documents,
    envvars_of,
    gate_probe,
    k8s_objects,
    of_kind,
    parse_kvfence,
)

# The Kubernetes version the schemas are taken from (the newest kubernetes-validate ships).
K8S_VERSION = kubernetes_validate.latest_version()
# Kinds that are custom resources of the Prometheus operator: no schema in the Kubernetes
# API; what they must agree with is checked below (selectors, ports, promtool).
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}


def test_every_builtin_object_validates_strictly() -> None:
    checked = []
    for path, doc in k8s_objects():
        if doc["kind"] in OPERATOR_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked.append(f"{path.name}:{doc['kind']}/{doc['metadata']['name']}")
    assert len(checked) >= 9, checked  # 3 Deployments, 3 Services, 2 NetworkPolicies, the Secret


def test_the_strict_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: one misspelt probe field is refused."""
    (vllm,) = (d for d in of_kind("Deployment") if d["metadata"]["name"] == "vllm")
    broken = copy.deepcopy(vllm)
    gate = containers(broken)[1]
    gate["readinesProbe"] = gate.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def engine_deployments() -> list[dict[str, Any]]:
    return [d for d in of_kind("Deployment") if any(c["name"] == "engine" for c in containers(d))]


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_gate_probes_its_own_engine_on_localhost(name: str) -> None:
    """The readiness gate runs the capacity check against the engine container of the same
    pod, on loopback, at the port the engine listens on."""
    (dep,) = (d for d in engine_deployments() if d["metadata"]["name"] == name)
    parsed = parse_kvfence(gate_probe(dep))
    assert parsed.path == ("gate",)  # the live gate: the audit's capacity check, failing closed
    url = urlsplit(parsed.params["target"].split("=", 1)[1])
    engine = next(c for c in containers(dep) if c["name"] == "engine")
    assert url.hostname == "127.0.0.1"
    assert url.port == engine["ports"][0]["containerPort"]
    probe = next(c for c in containers(dep) if c["name"] == "kvfence-gate")["readinessProbe"]
    # The audit's own budget ends before the kubelet's timeout cuts the probe off.
    assert parsed.params["max_seconds"] < probe["timeoutSeconds"]


def test_every_secret_reference_names_a_key_of_the_example_secret() -> None:
    (secret,) = of_kind("Secret")
    keys = set(secret["stringData"])
    refs = []
    for dep in of_kind("Deployment"):
        for c in containers(dep):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    refs.append(ref)
    for mon in of_kind("ServiceMonitor"):
        for ep in mon["spec"]["endpoints"]:
            if "authorization" in ep:
                refs.append(ep["authorization"]["credentials"])
    assert len(refs) >= 6
    for ref in refs:
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in keys, ref


def test_the_watch_deployment_runs_a_valid_watch_command() -> None:
    (watch,) = (d for d in of_kind("Deployment") if d["metadata"]["name"] == "kvfence-watch")
    (c,) = containers(watch)
    parsed = parse_kvfence(["kvfence", *c["args"]])  # the image's entrypoint is kvfence
    assert parsed.path == ("watch",)
    listen_port = int(parsed.params["listen"].rsplit(":", 1)[1])
    assert listen_port == c["ports"][0]["containerPort"]
    # Its targets are the engine Services, at their ports.
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    for target in parsed.params["targets"]:
        url = urlsplit(target)
        assert url.hostname in services, target
        assert url.port in [p["port"] for p in services[url.hostname]["spec"]["ports"]], target
    # Both tenants' keys and the operator's, each in a variable `kvfence watch` reads.
    names = {e["name"] for e in c["env"]}
    assert names <= envvars_of("watch") and len(names) == 3, names


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_the_gate_reads_the_operator_key_from_the_secret(name: str) -> None:
    (dep,) = (d for d in engine_deployments() if d["metadata"]["name"] == name)
    (gate,) = (c for c in containers(dep) if c["name"] == "kvfence-gate")
    (var,) = gate["env"]
    assert var["name"] in envvars_of("gate") and "OPERATOR" in var["name"]
    assert var["valueFrom"]["secretKeyRef"]["key"] == "operator-key"


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_each_service_monitor_selects_services_with_the_port_it_scrapes() -> None:
    services = of_kind("Service")
    monitors = of_kind("ServiceMonitor")
    assert len(monitors) == 2
    for mon in monitors:
        chosen = [
            s
            for s in services
            if selects(mon["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert chosen, mon["metadata"]["name"]
        for svc in chosen:
            ports = {p["name"] for p in svc["spec"]["ports"]}
            for ep in mon["spec"]["endpoints"]:
                assert ep["port"] in ports, (mon["metadata"]["name"], svc["metadata"]["name"])


def test_the_guard_service_is_the_job_the_rules_expect() -> None:
    """A ServiceMonitor's series carry the Service's name as `job`; GuardDown looks for
    the guard under the job the rules name, so the two must agree or GuardDown fires
    forever (absent) while the guard runs."""
    expr = next(
        r["expr"]
        for g in yaml.safe_load(RULES.read_text())["groups"]
        for r in g["rules"]
        if r.get("alert") == "GuardDown"
    )
    jobs = set(re.findall(r'job="([^"]+)"', expr))
    (watch,) = (d for d in of_kind("Deployment") if d["metadata"]["name"] == "kvfence-watch")
    pods = watch["spec"]["template"]["metadata"]["labels"]
    (svc,) = (s for s in of_kind("Service") if selects(s["spec"]["selector"], pods))
    (monitor,) = (
        m
        for m in of_kind("ServiceMonitor")
        if selects(m["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    )
    assert "jobLabel" not in monitor["spec"]
    assert jobs == {svc["metadata"]["name"]}


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_only_labelled_callers_reach_an_engine_and_watch_is_one(name: str) -> None:
    (policy,) = (p for p in of_kind("NetworkPolicy") if p["metadata"]["name"] == f"{name}-callers")
    (dep,) = (d for d in engine_deployments() if d["metadata"]["name"] == name)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    (rule,) = policy["spec"]["ingress"]
    engine = next(c for c in containers(dep) if c["name"] == "engine")
    assert [p["port"] for p in rule["ports"]] == [engine["ports"][0]["containerPort"]]
    client = next(f["podSelector"]["matchLabels"] for f in rule["from"] if "podSelector" in f)
    (watch,) = (d for d in of_kind("Deployment") if d["metadata"]["name"] == "kvfence-watch")
    assert selects(client, watch["spec"]["template"]["metadata"]["labels"])


def test_manifest_files_hold_only_known_kinds() -> None:
    kinds = {d["kind"] for _, d in k8s_objects()}
    builtin = {"Deployment", "Service", "NetworkPolicy", "Secret"}
    assert kinds == builtin | OPERATOR_KINDS
    assert all(documents(p) for p, _ in k8s_objects())
