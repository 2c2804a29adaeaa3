"""Rendering deploy/k8s's kustomizations as `kubectl apply -k` would: `kubectl kustomize <dir>`.
Tests that need it are marked `needs_kubectl` and skipped, saying why, where kubectl is not installed."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from typing import Any

import pytest
import yaml

from tests.deploy.checks import ROOT

K8S = ROOT / "deploy/k8s"
KUSTOMIZATIONS = sorted(p.parent.relative_to(ROOT).as_posix() for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = ("cpu", "gpu", "gpu-ep8")  # what a user applies: deploy/k8s/<overlay>
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not on PATH, so the kustomizations cannot be rendered here "
    "(install kubectl >= 1.27, which has kustomize v5 built in, to run these tests)",
)


@cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize <kustomization>` prints (a path from the repository root);
    AssertionError with kustomize's own message when it cannot build."""
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", kustomization], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, f"kubectl kustomize {kustomization} failed: {out.stderr.strip()}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)
