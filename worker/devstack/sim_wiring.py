"""Point fleetmend at the simulated fleet: every URL setting derived from the simulator's addresses.

In production each of these is a real endpoint (the pod's metrics port, the DCGM exporter,
the gateway's admin API, the API server's audit log...). The simulator serves the Kubernetes
API over TLS (through the kubeconfig it writes); each engine listens on its own pod IP, as in
a cluster (``http://{pod_ip}:<engine port>/metrics`` and ``/health``); everything else is on
one plain-HTTP port under distinct paths, and this is the one place that says which.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_ENGINE_PORT = 8000  # vLLM's default --port, and the simulator's (sim.k8s.podips)
# The simulated Jira wants a token, as a real one does, and takes any: this one names the dev stack.
SIM_JIRA_TOKEN = "fleetmend-dev"


def settings_for_sim(
    base_url: str,
    kubeconfig: Path,
    audit_log: Path | None = None,
    engine_port: int = DEFAULT_ENGINE_PORT,
) -> dict[str, Any]:
    """Settings for a simulator serving the world at ``base_url`` and its API through ``kubeconfig``.

    ``audit_log``: the API server's audit log, which ``ledger reconcile`` and the recovery's
    verification step read for Kubernetes actions (the world's record, as on a real cluster).
    ``engine_port``: the port every engine listens on at its pod IP (the scenario's
    ``load.engine_port``); the worker fills in ``{pod_ip}`` from the pod's status.
    """
    base = base_url.rstrip("/")
    settings: dict[str, Any] = {
        "kubeconfig": kubeconfig,
        "kube_context": None,
        # The users' requests go through Envoy (worker.devstack.gateway); the sim's port is its
        # clock, faults, load generator, incident channel and a Jira (REST API v2) for tickets.
        "gateway": "envoy",
        "sim_url": base,
        "metrics_url_template": f"http://{{pod_ip}}:{engine_port}/metrics",
        "health_url_template": f"http://{{pod_ip}}:{engine_port}/health",
        "node_telemetry_url_template": base + "/nodes/{node}/metrics",
        "notifier_url": base + "/sim/v1/notify",
        "tickets_url": base,
        "tickets_token": SIM_JIRA_TOKEN,
        "action_log_url": base + "/sim/v1/actions",
    }
    if audit_log is not None:
        settings["audit_log"] = audit_log
    return settings


def settings_for_running_sim(sim: Any) -> dict[str, Any]:
    """``settings_for_sim`` for a ``sim.runner.RunningSim`` (a thread) or a sim process
    (``worker.devstack.sim_process.SimProcess``)."""
    serving = getattr(getattr(sim, "world", None), "serving", None)
    port = getattr(sim, "engine_port", None) or (
        serving.settings.engine_port if serving is not None else DEFAULT_ENGINE_PORT
    )
    return settings_for_sim(sim.base_url, Path(sim.kubeconfig), getattr(sim, "audit_log", None), port)
