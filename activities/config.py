"""What the activities need to know about the world, as one small model.

The worker's bootstrap (``worker/registry.py``) builds it from its settings and hands
it in; nothing in ``activities/`` imports the worker, so importing a workflow (which
imports activity *references*) never drags the worker's configuration along.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.qualification import QualificationSpec
from fleet.recovery import RecoveryTimings, ServingObjectives
from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE


class ActivityConfig(BaseModel):
    """Addresses and names of the world's interfaces, plus the default procedure policy."""

    model_config = ConfigDict(frozen=True)

    kubeconfig: Path | None = None
    kube_context: str | None = None
    router_label: str = ROUTER_LABEL
    router_label_value: str = ROUTER_LABEL_VALUE
    gateway: Literal["envoy"] = "envoy"
    gateway_admin_urls: list[str] = Field(default_factory=list)
    gateway_apply_timeout_s: float = 5.0
    metrics_url_template: str = "http://{pod_ip}:8000/metrics"
    health_url_template: str = "http://{pod_ip}:8000/health"
    engine_reads_per_look: int = Field(8, ge=1)
    http_connections: int = Field(256, ge=1)
    kube_connections: int = Field(64, ge=1)
    node_telemetry_url_template: str = "http://{node}:9400/metrics"
    qualification: QualificationSpec = Field(default_factory=QualificationSpec)
    recovery_concurrency: int = Field(16, ge=1)
    action_log_url: str | None = None
    audit_log: Path | None = None  # the Kubernetes API server's audit log (reconcile)
    audit_log_world: str | None = None
    notifier_url: str | None = None
    # The policy an alert-started incident runs with (no explicit IncidentInput).
    dry_run: bool = False
    recovery_timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    serving_objectives: ServingObjectives = Field(default_factory=ServingObjectives)
