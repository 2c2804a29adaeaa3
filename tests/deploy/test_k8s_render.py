"""Every kustomization under deploy/k8s renders on its own with `kubectl kustomize` (what
`kubectl apply -k` runs), and every object it renders is valid for Kubernetes by its published OpenAPI
schemas (kubernetes-validate, strict: unknown fields are errors), at the oldest and the newest
Kubernetes version named in K8S_VERSIONS. Skipped, saying so, where kubectl is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize import K8S, KUSTOMIZATIONS, ROOT, needs_kubectl, render

# The Kubernetes versions the manifests are held to: 1.32 (the kubectl on the project's machines) and the
# newest whose schemas the pinned kubernetes-validate ships.
K8S_VERSIONS = ("1.32.0", "1.37.0")


def schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.absolute_path) or "(top)"
        return [f"{name} at {where}: {e.message} (Kubernetes {e.version})"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{name}: {e}"]
    return []


def test_the_layout_is_a_base_with_overlays_beside_it() -> None:
    assert KUSTOMIZATIONS == ["deploy/k8s/base", "deploy/k8s/cpu", "deploy/k8s/gpu", "deploy/k8s/gpu-ep8"]
    for overlay, under in (("cpu", "base"), ("gpu", "base"), ("gpu-ep8", "gpu")):  # gpu-ep8: one pod per node
        kust = yaml.safe_load((K8S / overlay / "kustomization.yaml").read_text())
        assert kust["resources"][0] == f"../{under}", overlay


@needs_kubectl
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_kustomization_renders_and_validates(kustomization: str) -> None:
    objects = render(kustomization)
    assert objects, f"{kustomization} rendered nothing"
    errors = [e for version in K8S_VERSIONS for obj in objects for e in schema_errors(obj, version)]
    assert not errors, f"{kustomization}:\n" + "\n".join(errors)


def test_strict_validation_catches_what_kubernetes_would_refuse() -> None:
    """The check can fail: a misspelt field and a wrong type are reported."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "readinesProbe": {}}]}}  # fmt: skip
    assert schema_errors(pod, K8S_VERSIONS[0]) and "readinesProbe" in schema_errors(pod, K8S_VERSIONS[0])[0]
    svc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "s"},
        "spec": {"ports": [{"port": "x"}]},
    }
    assert schema_errors(svc, K8S_VERSIONS[-1])


def _by_kind(objects: tuple[dict[str, Any], ...]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _main_container(w: dict[str, Any]) -> dict[str, Any]:
    name = w["metadata"]["name"]
    return next(c for c in w["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@needs_kubectl
def test_overlays_render_what_they_promise() -> None:
    """cpu: the tiny model, no GPU, no checkpoint volume, the cpu image; gpu: a GPU per worker pod and
    the gpu image; both in the moemesh namespace, readiness on /ready."""
    for overlay, tag in (("cpu", "cpu"), ("gpu", "gpu")):
        objs = _by_kind(render(f"deploy/k8s/{overlay}"))
        assert all(o["metadata"].get("namespace", "moemesh") == "moemesh" for o in objs.values())
        cm = objs[("ConfigMap", "moemesh")]["data"]
        has_pvc = ("PersistentVolumeClaim", "moemesh-model") in objs
        for name in ("prefill-worker", "decode-worker"):
            c = _main_container(objs[("StatefulSet", name)])
            assert c["image"] == f"moemesh:{tag}"
            gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
            env = name.upper().replace("-", "_")
            if overlay == "cpu":
                assert gpus is None and cm[f"MOEMESH_{env}_DEVICE"] == "cpu" and not has_pvc
            else:
                assert gpus == 1 and cm[f"MOEMESH_{env}_DEVICE"] == "cuda" and has_pvc
        own_probe = {"jaeger": None, "kv-store-master": "/health"}  # third-party binaries: their own
        for (kind, name), w in objs.items():
            if kind in ("Deployment", "StatefulSet") and own_probe.get(name, "/ready"):
                path = _main_container(w)["readinessProbe"]["httpGet"]["path"]
                assert path == own_probe.get(name, "/ready"), name


def test_base_files_are_all_listed() -> None:
    """kustomize applies only what kustomization.yaml lists: a manifest left out would be silently lost."""
    for kdir in (Path(ROOT / k) for k in KUSTOMIZATIONS):
        kust = yaml.safe_load((kdir / "kustomization.yaml").read_text())
        listed = {*kust.get("resources", []), *(p["path"] for p in kust.get("patches", []))}
        files = {p.name for p in kdir.glob("*.yaml") if p.name != "kustomization.yaml"}
        assert files <= listed, (
            f"{kdir.relative_to(ROOT)}: {sorted(files - listed)} not in kustomization.yaml"
        )
