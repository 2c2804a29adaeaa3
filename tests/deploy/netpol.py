"""Kubernetes NetworkPolicy ingress semantics, enough to ask of rendered manifests "may this pod reach
that pod's port?": a pod selected by no Ingress policy takes everything; one selected by any takes only
what some rule of those policies allows (from: pod selectors in the policy's namespace, namespace
selectors; ports by number, range or the target container's port name). Node traffic (probes) aside."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    labels: Mapping[str, str]
    namespace: str = "moemesh"
    ports: Mapping[str, int] = field(default_factory=dict)  # container port names -> numbers


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], src: Pod, policy_ns: str) -> bool:
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is None and pod_sel is None:
        raise ValueError(f"a peer needs a selector (ipBlock is not modelled): {peer}")
    ns_labels = {"kubernetes.io/metadata.name": src.namespace}
    ns_ok = selects(ns_sel, ns_labels) if ns_sel is not None else src.namespace == policy_ns
    return ns_ok and (pod_sel is None or selects(pod_sel, src.labels))


def _port_matches(rule_port: Mapping[str, Any], port: int, dst: Pod) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    p = rule_port.get("port")
    if p is None:
        return True
    if isinstance(p, str):
        return dst.ports.get(p) == port
    return p <= port <= rule_port.get("endPort", p)


def allowed(policies: Sequence[Mapping[str, Any]], src: Pod, dst: Pod, port: int) -> bool:
    """May `src` open a TCP connection to `dst`'s `port` under these NetworkPolicies?"""
    mine = [
        p for p in policies
        if p["metadata"].get("namespace", "moemesh") == dst.namespace
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], dst.labels)
    ]  # fmt: skip
    if not mine:
        return True
    for p in mine:
        ns = p["metadata"].get("namespace", "moemesh")
        for rule in p["spec"].get("ingress", []):
            peers = rule.get("from")
            ports = rule.get("ports")
            if (peers is None or any(_peer_matches(x, src, ns) for x in peers)) and (
                ports is None or any(_port_matches(x, port, dst) for x in ports)
            ):
                return True
    return False
