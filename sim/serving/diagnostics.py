"""NVIDIA DCGM diagnostics (``dcgmi diag -r <level>``) as the simulated kubelet runs them.

A pod whose container command runs ``dcgmi diag`` is a *program* to the simulated kubelet
(``ControlPlane.program_for``): it runs for the level's duration on the node it was bound to,
then prints the JSON report ``dcgmi diag -r N -j`` prints and exits non-zero when a test failed.
The outcome follows the node's simulated GPUs when the run ends:

* a broken GPU (a hardware Xid, NVLink failure) or thermal slowdown fails every level
  (the deployment checks cannot use the GPU, or it throttles at once);
* a defect that shows only under load (``GpuState.under_load_defect``: the GPU idles clean,
  its DCGM series are clean) passes level 1 (deployment checks, no load) and fails level 2 and
  up, whose PCIe and memory tests load the GPU.

Levels (DCGM: r1 quick, r2 medium, r3 long, r4 extended) take ``base_s`` x 0.1 / 1 / 4 / 8.

Which GPUs are tested: those ``-i`` / ``--gpuList`` names (a GPU index, or a comma list: ``-i 3``,
``-i 0,2``), else the GPUs the pod holds through DRA claims (the devices its container sees), else
every GPU of the node. The verdict follows only the GPUs tested: a broken GPU elsewhere on the node
does not fail a run that does not test it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from typing import Any

from sim.k8s.controlplane import Program
from sim.serving.telemetry import NodeTelemetry

Obj = dict[str, Any]
DCGM_VERSION = "3.3.9"
_LEVEL = re.compile(r"(?:^|\s)(?:-r|--run)[\s=]+(\d)\b")
_GPU_LIST = re.compile(r"(?:^|\s)(?:-i|--gpuList)[\s=]+(\d+(?:\s*,\s*\d+)*)")
_DURATION_FACTOR = {1: 0.1, 2: 1.0, 3: 4.0, 4: 8.0}
_TESTS: dict[int, list[tuple[str, str]]] = {
    1: [
        ("Deployment", "Denylist"),
        ("Deployment", "NVML Library"),
        ("Deployment", "CUDA Main Library"),
        ("Deployment", "Permissions and OS Blocks"),
        ("Deployment", "Persistence Mode"),
        ("Deployment", "Environment Variables"),
        ("Deployment", "Page Retirement/Row Remap"),
        ("Deployment", "Graphics Processes"),
        ("Deployment", "Inforom"),
    ],
    2: [("Integration", "PCIe"), ("Hardware", "GPU Memory")],
    3: [
        ("Stress", "Targeted Stress"),
        ("Stress", "Targeted Power"),
        ("Stress", "Memory Bandwidth"),
        ("Hardware", "Diagnostic"),
    ],
    4: [("Hardware", "Memtest"), ("Hardware", "Pulse Test")],
}


def diag_level(pod: Obj) -> int | None:
    """The ``-r`` level of the first container when it runs ``dcgmi diag`` (None: not a diagnostic)."""
    containers = pod.get("spec", {}).get("containers") or []
    if not containers:
        return None
    c = containers[0]
    line = " ".join(shlex.quote(str(a)) for a in [*(c.get("command") or []), *(c.get("args") or [])])
    if "dcgmi" not in line or " diag" not in f" {line}":
        return None
    match = _LEVEL.search(line.replace("'", " "))
    level = int(match.group(1)) if match else 1
    return level if level in _DURATION_FACTOR else None


def _command_line(pod: Obj) -> str:
    containers = pod.get("spec", {}).get("containers") or []
    if not containers:
        return ""
    c = containers[0]
    return " ".join(shlex.quote(str(a)) for a in [*(c.get("command") or []), *(c.get("args") or [])])


def diag_gpus(pod: Obj) -> list[int] | None:
    """The GPU indices ``-i``/``--gpuList`` names (None: the option is not given)."""
    match = _GPU_LIST.search(_command_line(pod).replace("'", " "))
    if match is None:
        return None
    return sorted({int(part) for part in match.group(1).split(",")})


def _report(level: int, tel: NodeTelemetry, only: list[int] | None = None) -> tuple[int, str]:
    categories: dict[str, list[Obj]] = {}
    failed = False
    gpus = [g for g in tel.gpus if only is None or g.index in only]
    for lvl in range(1, level + 1):
        for category, name in _TESTS[lvl]:
            results: list[Obj] = []
            for g in gpus:
                problem: str | None = None
                if g.broken and name in ("NVML Library", "Page Retirement/Row Remap"):
                    problem = f"GPU {g.index}: {g.broken}"
                elif g.clock_events and name in ("Persistence Mode", "PCIe", "Targeted Stress"):
                    problem = f"GPU {g.index}: clocks held down for temperature ({g.temp_c:g} C)"
                elif g.under_load_defect and lvl >= 2 and name in ("PCIe", "GPU Memory", "Targeted Stress"):
                    problem = f"GPU {g.index}: {g.under_load_defect}"
                entry: Obj = {"gpu_id": str(g.index), "status": "Fail" if problem else "Pass"}
                if problem:
                    failed = True
                    entry["warnings"] = [{"warning": problem, "error_id": 83}]
                results.append(entry)
            categories.setdefault(category, []).append({"name": name, "results": results})
    doc = {
        "DCGM GPU Diagnostic": {
            "test_categories": [{"category": c, "tests": t} for c, t in categories.items()],
            "version": DCGM_VERSION,
        }
    }
    return (226 if failed else 0), json.dumps(doc, indent=2) + "\n"


def diagnostic_program(
    pod: Obj,
    base_s: float,
    telemetry_of: Callable[[str], NodeTelemetry],
    claimed_gpus: Callable[[Obj], list[int]] | None = None,
) -> Program | None:
    """The program a ``dcgmi diag`` pod runs on its node; None for any other pod.

    ``claimed_gpus(pod)``: the GPU indices the pod holds (used for a DRA pod run without ``-i``)."""
    level = diag_level(pod)
    node = pod.get("spec", {}).get("nodeName")
    if level is None or not node:
        return None

    def finish() -> tuple[int, str]:
        only = diag_gpus(pod)
        if only is None and claimed_gpus is not None and pod.get("spec", {}).get("resourceClaims"):
            only = claimed_gpus(pod)
        return _report(level, telemetry_of(node), only)

    return Program(duration_s=base_s * _DURATION_FACTOR[level], finish=finish)
