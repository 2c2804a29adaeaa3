"""deploy/k8s as `kubectl apply -k` would apply each overlay (cpu, gpu: rendered by `kubectl kustomize`):
references hold (selectors, ports, volumes, config, scale targets), and what the containers run and set
exists in the project. Skipped where kubectl is not installed (tests/deploy/kustomize.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from libs.telemetry import otlp_config
from tests.deploy.checks import ROOT, check_command, check_settings, dockerfile_tools
from tests.deploy.kustomize import K8S, OVERLAYS, needs_kubectl, render

pytestmark = needs_kubectl
API = {
    "Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "PersistentVolumeClaim": "v1",
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "HorizontalPodAutoscaler": "autoscaling/v2",
    "NetworkPolicy": "networking.k8s.io/v1",
}  # fmt: skip
WORKLOADS = ("Deployment", "StatefulSet")
MESH = {"kv-broker": "Deployment", "scheduler": "Deployment", "gateway": "Deployment",
        "prefill-worker": "StatefulSet", "decode-worker": "StatefulSet"}  # fmt: skip


def docs_of(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(overlay) -> list[dict[str, Any]]:
    return [dict(d) for d in render(f"deploy/k8s/{overlay}")]


def index(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(out) == len(docs), "duplicate kind/name"
    return out


def containers(w: dict[str, Any]) -> list[dict[str, Any]]:
    spec = w["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def env_of(c: dict[str, Any], configmaps: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]])
    for e in c.get("env", []):
        env[e["name"]] = e.get("value", "set-from-" + next(iter(e.get("valueFrom", {"x": 0}))))
    return env


def test_every_object_is_well_formed(docs) -> None:
    for d in docs:
        assert d["apiVersion"] == API[d["kind"]], d["kind"]
        assert d["metadata"]["name"]
    assert {(k, n) for n, k in MESH.items()} <= set(index(docs))


def test_selectors_match_their_pods(docs) -> None:
    idx = index(docs)
    for (kind, name), w in idx.items():
        if kind not in WORKLOADS:
            continue
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        if kind == "StatefulSet":
            svc = idx[("Service", w["spec"]["serviceName"])]
            assert svc["spec"]["clusterIP"] == "None", name  # headless: a stable name per pod
    for (kind, name), svc in idx.items():
        if kind != "Service":
            continue
        pods = [w for (k, _), w in idx.items() if k in WORKLOADS
                and svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
        port_names = {
            p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]
        }
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in port_names or isinstance(p["targetPort"], int), (name, p)


def test_probes_ports_and_volumes_resolve(docs) -> None:
    idx = index(docs)
    for (kind, name), w in idx.items():
        if kind not in WORKLOADS:
            continue
        spec = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in containers(w):
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    port = (c[probe].get("httpGet") or c[probe].get("tcpSocket"))["port"]
                    assert port in ports or isinstance(port, int), (name, probe, port)
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (name, mount)
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in idx, name


def test_containers_run_project_commands_with_settings_the_services_read(docs, overlay) -> None:
    idx = index(docs)
    configmaps = {n: d["data"] for (k, n), d in idx.items() if k == "ConfigMap"}
    tools = dockerfile_tools(ROOT / "deploy/Dockerfile")
    seen = set()
    for (kind, name), w in idx.items():
        if kind not in WORKLOADS or name == "jaeger":
            continue
        for c in containers(w):
            assert c["image"] == f"moemesh:{overlay.removesuffix('-ep8')}", name  # the overlay's images: rewrites it
            service = check_command(c["command"], tools)
            if service is None:
                continue
            assert service == name and c["name"] == name
            env = env_of(c, configmaps)
            settings = check_settings(service, env)
            assert otlp_config(env) == ("otlp", "http/protobuf"), name
            ports = {p["containerPort"] for p in c["ports"]}
            assert (settings.port if service == "gateway" else settings.http_port) in ports, name
            if kind == "StatefulSet":  # gpu-ep8: a worker pod is one EP group, a GPU per rank
                gpus = c["resources"]["limits"].get("nvidia.com/gpu")
                want = {"gpu": ("cuda", 1, 1), "gpu-ep8": ("cuda", 8, 8)}.get(overlay, ("cpu", None, 1))
                assert (settings.device, gpus, settings.ep_size) == want, name
            seen.add(service)
    assert seen == set(MESH)


def test_tracing_and_nats_endpoints_point_at_their_services(docs, overlay) -> None:
    idx = index(docs)
    cm = idx[("ConfigMap", "moemesh")]["data"]
    jaeger_ports = {p["port"] for p in idx[("Service", "jaeger")]["spec"]["ports"]}
    assert cm["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318" and 4318 in jaeger_ports
    assert cm["MOEMESH_NATS_URL"] == "nats://nats:4222"  # the NATS Helm chart's service for release "nats"
    values = "nats-values-single.yaml" if overlay == "cpu" else "nats-values.yaml"  # as the overlay says
    assert f"helm/{values}" in (K8S / overlay / "kustomization.yaml").read_text()
    nats = yaml.safe_load((K8S / "helm" / values).read_text())
    assert nats["config"]["jetstream"]["enabled"] is True
    cluster = nats["config"]["cluster"]
    nats_servers = cluster["replicas"] if cluster["enabled"] else 1
    assert nats_servers >= int(cm["MOEMESH_KV_BROKER_BUCKET_REPLICAS"])


def test_autoscalers_target_workloads_that_exist(docs) -> None:
    idx = index(docs)
    hpas = {n: d for (k, n), d in idx.items() if k == "HorizontalPodAutoscaler"}
    assert set(hpas) == {"gateway", "prefill-worker", "decode-worker"}
    adapter = (K8S / "helm/prometheus-adapter-values.yaml").read_text()
    for name, hpa in hpas.items():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == (MESH[name], name)
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Pods" and m["pods"]["metric"]["name"] in adapter  # served by the adapter


def test_cpu_overlay_serves_the_tiny_model_it_writes() -> None:
    idx = index([dict(d) for d in render("deploy/k8s/cpu")])
    assert ("PersistentVolumeClaim", "moemesh-model") not in idx  # no checkpoint volume
    cm = idx[("ConfigMap", "moemesh")]["data"]
    tools = dockerfile_tools(ROOT / "deploy/Dockerfile")
    for service in ("prefill-worker", "decode-worker", "gateway"):
        spec = idx[(MESH[service], service)]["spec"]["template"]["spec"]
        [init] = spec["initContainers"]
        check_command(init["command"], tools)
        out = init["command"][init["command"].index("--out") + 1]
        assert any(m["mountPath"] == out for m in init["volumeMounts"])
        assert {"name": "model", "emptyDir": {}} in spec["volumes"]
        s = check_settings(service, cm)
        assert s.model_dir == out and s.served_model_name == "tiny-v3"
        if service != "gateway":
            assert s.device == "cpu"


def test_readiness_probes_ask_ready_and_liveness_does_not(docs) -> None:
    """Readiness is /ready (a gateway: a decode worker is live; a worker: model loaded, KV pool registered);
    liveness never depends on the rest of the mesh, so a NATS outage restarts nothing."""
    idx = index(docs)
    for name, kind in MESH.items():
        [c] = [c for c in idx[(kind, name)]["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready", name
        live = c["livenessProbe"]
        assert "tcpSocket" in live or live["httpGet"]["path"] == "/livez", name
