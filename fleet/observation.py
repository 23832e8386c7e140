"""One consistent look at a pool, as the observe activity returns it to the workflows.

It bundles the Kubernetes view (``PoolSnapshot``, pods, EndpointSlice
conditions, the Service and every workload selector), the router's view
(routing set, configuration) and the engines' view (one metrics scrape and a
health answer per group leader). Policies in ``fleet/`` decide from it: what
was seen of one pod (``PodObservation``, with its EndpointSlice conditions and
its engine's health) is judged lost or present by ``fleet.loss``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import RouterState
from fleet.pool import PoolSnapshot


class EngineHealth(StrEnum):
    OK = "ok"  # /health 200
    FAILING = "failing"  # /health 5xx (EngineDeadError -> 503)
    UNREACHABLE = "unreachable"  # connection refused / timed out
    UNKNOWN = "unknown"  # not probed


class EndpointConditions(BaseModel):
    """One endpoint of the Service's EndpointSlices. ``None`` follows Kubernetes' nil semantics."""

    model_config = ConfigDict(frozen=True)

    pod: str
    ready: bool | None = None  # nil = true
    serving: bool | None = None  # nil = true
    terminating: bool | None = None  # nil = false

    def routable(self, publish_not_ready: bool) -> bool:
        """Would a router following the slice send traffic here?

        Under ``publishNotReadyAddresses`` (e.g. LWS headless Services) ``ready`` is
        always true, so ``serving`` and ``terminating`` are what count.
        """
        if publish_not_ready:
            return self.serving is not False and self.terminating is not True
        return self.ready is not False


class PodObservation(BaseModel):
    """What the activities saw of one pod of a group."""

    model_config = ConfigDict(frozen=True)

    pod: str
    exists: bool = True
    phase: str = "Running"
    node: str | None = None
    deleting: bool = Field(default=False, description="metadata.deletionTimestamp set")
    pod_ready: bool = True
    containers_ready: bool = True
    waiting_reason: str | None = None
    terminated_reason: str | None = Field(default=None, description="Current or last termination reason")
    restart_count: int = 0
    status_reason: str | None = Field(default=None, description="status.reason, e.g. Evicted, NodeLost")
    engine_health: EngineHealth = EngineHealth.UNKNOWN
    engine_progressing: bool | None = Field(
        default=None, description="False = requests queued/running but no token advanced between two scrapes"
    )
    endpoint: EndpointConditions | None = Field(default=None, description="None = not in any EndpointSlice")


class WorkloadSelector(BaseModel):
    """A workload controller and the labels it selects its pods by (equality part)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    name: str
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expression_keys: tuple[str, ...] = ()
    replicas: int | None = None

    def selects_on(self, label: str) -> bool:
        return label in self.match_labels or label in self.match_expression_keys


class PoolObservation(BaseModel):
    snapshot: PoolSnapshot
    pods: dict[str, PodObservation] = Field(default_factory=dict)
    pod_uids: dict[str, str] = Field(
        default_factory=dict, description="pod -> metadata.uid (a recreated pod differs)"
    )
    pod_nodes: dict[str, str] = Field(default_factory=dict)
    service_selector: dict[str, str] = Field(default_factory=dict)
    publish_not_ready: bool = False
    workloads: list[WorkloadSelector] = Field(default_factory=list)
    routed_pods: list[str] = Field(default_factory=list, description="Pods in the router's routing set")
    router: RouterState | None = None
    gateway_admitted_total: int | None = Field(
        None, description="The gateway's counter of requests past admission (first attempts), if it keeps one"
    )
    gateway_counted_at: float | None = Field(None, description="When that counter was read (epoch seconds)")
    engines: dict[str, EngineSnapshot] = Field(
        default_factory=dict, description="group id -> leader's scrape"
    )
    pending_pods: dict[str, str] = Field(
        default_factory=dict, description="Pending pod -> latest FailedScheduling message"
    )
    router_label: str = Field(description="The router-only label this pool routes by")
    router_label_value: str = "true"
    warnings: list[str] = Field(default_factory=list, description="Parts that could not be observed")

    def controllers_selecting(self, label: str) -> list[WorkloadSelector]:
        """Workload controllers whose selector uses ``label``: removing it would orphan their pods."""
        return [w for w in self.workloads if w.selects_on(label)]
