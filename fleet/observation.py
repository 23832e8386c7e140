"""One consistent look at a pool, as the observe activity returns it to the workflows.

It bundles the Kubernetes view (``PoolSnapshot``, pods, EndpointSlice
conditions, the Service and every workload selector), the router's view
(routing set, configuration) and the engines' view (one metrics scrape and a
health answer per group leader). Policies in ``fleet/`` decide from it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import RouterState
from fleet.loss import PodObservation
from fleet.pool import PoolSnapshot


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
