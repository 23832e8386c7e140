"""Point fleetmend at the simulated fleet: every URL setting derived from the simulator's one base URL.

In production each of these is a real endpoint (the pod's metrics port, the
DCGM exporter, the gateway's admin API...); the simulator serves them all on
one port under distinct paths, and this is the one place that says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def settings_for_sim(base_url: str, kubeconfig: Path) -> dict[str, Any]:
    base = base_url.rstrip("/")
    return {
        "kubeconfig": kubeconfig,
        "kube_context": None,
        "router_admin_url": base,
        "metrics_url_template": base + "/pods/{namespace}/{pod}/metrics",
        "health_url_template": base + "/pods/{namespace}/{pod}/health",
        "node_telemetry_url_template": base + "/nodes/{node}/metrics",
        "qualification_url_template": base + "/nodes/{node}/qualification",
        "notifier_url": base + "/sim/v1/notify",
        "action_log_url": base + "/sim/v1/actions",
    }
