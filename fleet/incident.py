"""What an alert tells fleetmend, and how incidents are named.

A ``LossReport`` is the signal payload every alert source (Alertmanager webhook,
``fleetmend alert``, the demo) delivers into the pool's ``FleetIncident``
workflow by signal-with-start. Workflow ids derive from the pool, so an alert
storm reaches one workflow, not a thousand (DESIGN.md §6).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# Temporal names the webhook uses without importing workflow code.
FLEET_INCIDENT_WORKFLOW = "FleetIncident"
REPORT_LOSS_SIGNAL = "report_loss"
REPLICA_LOSS_WORKFLOW = "ReplicaLossRecovery"
PLANNED_SCALE_DOWN_WORKFLOW = "PlannedScaleDown"


class PoolRef(BaseModel):
    """A serving pool: the pods behind one Service of one model in one namespace."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    service: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.service}"


def incident_workflow_id(pool: PoolRef) -> str:
    """One open FleetIncident per pool."""
    return f"incident/{pool.namespace}/{pool.service}"


def scale_down_workflow_id(pool: PoolRef) -> str:
    return f"scale-down/{pool.namespace}/{pool.service}"


class AlertStatus(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class Severity(StrEnum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


class PreLossArrivals(BaseModel):
    """Requests/s the gateway let through to a pool over a window that ended before the loss was
    detected (``fleet.arrivals.arrivals_before``, from the fast path's readings of Envoy's counters).

    The pool's arrival rate as it was: a window counted after the loss also holds the streams the
    loss cut, which their clients send again at once - a one-off burst that, read as a rate over
    the first second or two, doubled the arrivals fleetmend planned on (114.6 req/s against the
    users' 67.5 in the peak demo) and refused what the world could have served."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rps: float = Field(ge=0)
    seconds: float = Field(gt=0, description="How long the window counted")
    ended_at: float = Field(description="When the window ended (unix seconds)")
    ended_before_s: float = Field(ge=0, description="How long before the loss's first sign the window ended")


class LossReport(BaseModel):
    """One observation that a replica (group) of a pool may be lost.

    At least one of ``node``, ``pod`` or ``replica_group`` names the entity;
    the workflow resolves the rest through the Kubernetes API. ``fingerprint``
    is the alert's identity (Alertmanager's fingerprint): repeats are absorbed.
    """

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    fingerprint: str = Field(min_length=1, max_length=200)
    alert_name: str = Field(min_length=1, max_length=200)
    status: AlertStatus = AlertStatus.FIRING
    severity: Severity = Severity.CRITICAL
    node: str | None = None
    pod: str | None = None
    replica_group: str | None = None
    fault_hint: str | None = Field(None, description="e.g. 'gpu-xid:79' from the alert's labels")
    about: Literal["node", "pod", "group"] | None = Field(
        None,
        description="What the report is about when it names more than that (the fast path names a lost "
        "node's pods too, and a lost pod's node); None = the most specific name given",
    )
    observed_at: float | None = Field(None, description="Unix seconds the alert started (startsAt)")
    source: str = "alertmanager"
    labels: dict[str, str] = Field(default_factory=dict)
    arrivals_before: PreLossArrivals | None = Field(
        None, description="The pool's arrivals counted before the loss (the fast path's reports only)"
    )

    def points_at_node(self, node: str) -> bool:
        """This report is about ``node`` itself, not only about a pod or group that ran on it."""
        if self.node != node:
            return False
        if self.about is not None:
            return self.about == "node"
        return self.pod is None and self.replica_group is None
