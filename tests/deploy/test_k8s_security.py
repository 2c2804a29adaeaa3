"""deploy/k8s's NetworkPolicies and NATS auth, as each overlay renders them: who may reach NATS, the
workers' Mooncake ports, the gateway and the side ports (evaluated with tests/deploy/netpol.py), and every
service logs in to NATS with the password the NATS Helm values require."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.deploy.checks import check_settings
from tests.deploy.kustomize import K8S, OVERLAYS, needs_kubectl, render
from tests.deploy.netpol import Pod, allowed

pytestmark = needs_kubectl
SERVICES = {"kv-broker": "Deployment", "scheduler": "Deployment", "gateway": "Deployment",
            "prefill-worker": "StatefulSet", "decode-worker": "StatefulSet"}  # fmt: skip
NATS_SERVER = Pod(  # the official chart's server pods, release "nats"
    {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats", "app.kubernetes.io/component": "nats"},
    ports={"nats": 4222, "cluster": 6222, "monitor": 8222},
)
NATS_BOX = Pod({"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats",
                "app.kubernetes.io/component": "nats-box"})  # fmt: skip
STRANGER = Pod({"app": "something-else"})  # any other pod in the namespace
OTHER_NS = Pod({"app": "web"}, namespace="default")
INGRESS = Pod({"app.kubernetes.io/name": "ingress-nginx"}, namespace="ingress-nginx")
PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")


@pytest.fixture(scope="module", params=OVERLAYS)
def objs(request) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(f"deploy/k8s/{request.param}")}


def pods(objs) -> dict[str, Pod]:
    out = {}
    for (kind, name), w in objs.items():
        if kind in ("Deployment", "StatefulSet"):
            tpl = w["spec"]["template"]
            ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
            out[name] = Pod(tpl["metadata"]["labels"], w["metadata"].get("namespace", "moemesh"), ports)
    return out


def policies(objs) -> list[dict[str, Any]]:
    return [d for (k, _), d in objs.items() if k == "NetworkPolicy"]


def mooncake_ports(objs) -> tuple[int, int]:
    cm = objs[("ConfigMap", "moemesh")]["data"]
    return int(cm["MC_MIN_RPC_PORT"]), int(cm["MC_MAX_RPC_PORT"])


def test_nats_takes_clients_only_from_the_mesh(objs) -> None:
    p, mesh = policies(objs), pods(objs)
    for name in SERVICES:
        assert allowed(p, mesh[name], NATS_SERVER, 4222), name
        assert not allowed(p, mesh[name], NATS_SERVER, 6222), name  # routes are the servers' own
    assert allowed(p, NATS_SERVER, NATS_SERVER, 6222) and allowed(p, NATS_BOX, NATS_SERVER, 4222)
    for outsider in (STRANGER, OTHER_NS, INGRESS, mesh["jaeger"]):
        assert not allowed(p, outsider, NATS_SERVER, 4222), outsider
    assert allowed(p, PROMETHEUS, NATS_SERVER, 8222) and not allowed(p, PROMETHEUS, NATS_SERVER, 4222)


def test_mooncake_ports_open_only_between_workers(objs) -> None:
    p, mesh = policies(objs), pods(objs)
    lo, hi = mooncake_ports(objs)
    assert (lo, hi) == (15000, 17000)  # Mooncake's own defaults, so an engine that ignored the env agrees
    workers = ("prefill-worker", "decode-worker")
    for dst in workers:
        for port in (lo, (lo + hi) // 2, hi):
            for src in workers:
                assert allowed(p, mesh[src], mesh[dst], port), (src, dst, port)
            for src in ("gateway", "scheduler", "kv-broker", "jaeger"):
                assert not allowed(p, mesh[src], mesh[dst], port), (src, dst, port)
            for src in (STRANGER, OTHER_NS, INGRESS, PROMETHEUS):
                assert not allowed(p, src, mesh[dst], port), (src, dst, port)
        assert not allowed(p, mesh["prefill-worker"], mesh[dst], hi + 1)


def test_the_kv_store_master_takes_only_workers_and_its_metrics_only_prometheus(objs) -> None:
    p, mesh = policies(objs), pods(objs)
    master = mesh["kv-store-master"]
    rpc, metrics = master.ports["rpc"], master.ports["http-metrics"]
    for src in ("prefill-worker", "decode-worker"):
        assert allowed(p, mesh[src], master, rpc), src
    for src in (mesh["gateway"], mesh["scheduler"], STRANGER, OTHER_NS, INGRESS, PROMETHEUS):
        assert not allowed(p, src, master, rpc), src
    assert allowed(p, PROMETHEUS, master, metrics) and not allowed(p, STRANGER, master, metrics)


def test_the_gateway_takes_the_ingress_and_side_ports_take_prometheus(objs) -> None:
    p, mesh = policies(objs), pods(objs)
    api = mesh["gateway"].ports["http"]
    assert allowed(p, INGRESS, mesh["gateway"], api) and allowed(p, PROMETHEUS, mesh["gateway"], api)
    for src in (STRANGER, OTHER_NS, mesh["decode-worker"]):
        assert not allowed(p, src, mesh["gateway"], api), src
    for name in ("scheduler", "kv-broker", "prefill-worker", "decode-worker"):
        side = mesh[name].ports["http-metrics"]
        assert allowed(p, PROMETHEUS, mesh[name], side), name
        for src in (STRANGER, OTHER_NS, INGRESS):
            assert not allowed(p, src, mesh[name], side), (src, name)
    for port in (4317, 4318):  # traces from the services only
        assert allowed(p, mesh["decode-worker"], mesh["jaeger"], port)
        assert not allowed(p, STRANGER, mesh["jaeger"], port)


def test_every_pod_of_the_namespace_is_under_a_default_deny(objs) -> None:
    """A pod added later (or one a policy forgot) takes no traffic until a policy allows it."""
    p = policies(objs)
    assert allowed(p, STRANGER, Pod({"app": "new"}), 80) is False
    assert allowed(p, STRANGER, Pod({"app": "new"}, namespace="default"), 80) is True  # only this namespace


def test_nats_auth_is_on_and_every_service_logs_in(objs) -> None:
    cm = objs[("ConfigMap", "moemesh")]["data"]
    for values in ("nats-values.yaml", "nats-values-single.yaml"):
        v = yaml.safe_load((K8S / "helm" / values).read_text())
        auth = v["config"]["merge"]["authorization"]
        assert auth["user"] == cm["MOEMESH_NATS_USER"], values
        env = v["container"]["env"][auth["password"].strip("<> ").removeprefix("$")]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "moemesh-nats", "key": "password"}, values
    for name, kind in SERVICES.items():
        [c] = [c for c in objs[(kind, name)]["spec"]["template"]["spec"]["containers"] if c["name"] == name]
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env["MOEMESH_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "moemesh-nats", "key": "password"} and not ref.get("optional"), name
        s = check_settings(name, {**cm, "MOEMESH_NATS_PASSWORD": "from-the-secret"})
        assert (s.nats_user, s.nats_password) == ("moemesh", "from-the-secret"), name
