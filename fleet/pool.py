"""The observed serving pool: its replica groups and the nodes they run on.

Activities read Kubernetes (pods, workloads, nodes, EndpointSlices, the router's
routing set) and build a ``PoolSnapshot``; every policy in ``fleet/`` decides
from one. The unit is the **replica group**: one engine instance, which may span
several pods (tensor/pipeline parallel across nodes, e.g. one LeaderWorkerSet
group) - lose one rank and the whole group is lost; scale down and the whole
group goes.

Pure models, no I/O; safe to import inside workflows.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.incident import PoolRef
from fleet.vocabulary import NVLINK_DOMAIN_LABEL, QUARANTINE_LABEL, ZONE_LABEL


class GroupRole(StrEnum):
    SERVING = "serving"  # a pool member the router may send traffic to
    SPARE = "spare"  # loaded, healthy, registered, not routed: promotable


class WorkloadKind(StrEnum):
    DEPLOYMENT = "Deployment"
    LEADER_WORKER_SET = "LeaderWorkerSet"
    STATEFUL_SET = "StatefulSet"


class Taint(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    value: str = ""
    effect: str = Field(default="NoSchedule", description="NoSchedule | PreferNoSchedule | NoExecute")


class NodeInfo(BaseModel):
    """A node as placement, triage and loss-sizing need it."""

    model_config = ConfigDict(frozen=True)

    name: str
    labels: dict[str, str] = Field(default_factory=dict)
    ready: bool | None = Field(default=True, description="Ready condition; None = Unknown (kubelet silent)")
    unschedulable: bool = False
    taints: tuple[Taint, ...] = ()
    gpu_allocatable: int = Field(default=0, ge=0)
    gpu_allocated: int = Field(
        default=0, ge=0, description="GPUs requested by the node's non-terminated pods"
    )
    gpu_problems: tuple[str, ...] = Field(
        default=(), description="GPU problem conditions that are True (GpuXid...; fleet.qualification)"
    )

    @property
    def free_gpus(self) -> int:
        return max(0, self.gpu_allocatable - self.gpu_allocated)

    @property
    def quarantined(self) -> bool:
        return QUARANTINE_LABEL in self.labels

    def domain(self, label: str = NVLINK_DOMAIN_LABEL) -> str | None:
        """The node's topology domain under ``label`` (NVLink domain by default)."""
        return self.labels.get(label)

    @property
    def zone(self) -> str | None:
        return self.labels.get(ZONE_LABEL)


class ReplicaGroup(BaseModel):
    """One engine instance of the pool: all its pods live and die together."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="Stable group id, e.g. the Deployment pod name or '<lws>-<group index>'")
    model: str
    revision: str
    role: GroupRole = GroupRole.SERVING
    pods: tuple[str, ...] = Field(min_length=1)
    nodes: tuple[str, ...] = Field(default=(), description="Distinct nodes the group's pods run on")
    leader_pod: str
    gpus_per_pod: int = Field(default=1, ge=0)
    ready: bool = Field(default=True, description="Every pod Ready (incl. the serving-ready gate)")
    engine_up: bool | None = Field(
        default=None,
        description=(
            "Every pod's containers ready and engine answering: loaded and healthy, with or without headroom. "
            "None = unknown, taken to equal ``ready``"
        ),
    )
    routed: bool = Field(default=True, description="In the router's routing set (router-only label present)")
    workload_kind: WorkloadKind = WorkloadKind.DEPLOYMENT
    workload_name: str

    @model_validator(mode="after")
    def _leader_is_a_member(self) -> ReplicaGroup:
        if self.leader_pod not in self.pods:
            raise ValueError(
                f"leader pod {self.leader_pod!r} is not one of the group's pods {list(self.pods)}"
            )
        return self

    @property
    def gpus(self) -> int:
        return self.gpus_per_pod * len(self.pods)

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    @property
    def warm(self) -> bool:
        """Loaded and healthy: counts towards the warm floor whether serving or spare.

        A saturated replica that the ``serving-ready`` gate holds not-ready is still
        warm (its cache is full of live work), so warmth follows ``engine_up``.
        """
        return self.ready if self.engine_up is None else self.engine_up

    @property
    def shape(self) -> str:
        return f"{len(self.pods)} pod(s) x {self.gpus_per_pod} GPU"


class PoolSnapshot(BaseModel):
    """Everything fleetmend observed about one pool at one moment (``observed_at``, unix s)."""

    model_config = ConfigDict(frozen=True)

    pool: PoolRef
    observed_at: float
    groups: tuple[ReplicaGroup, ...] = ()
    nodes: tuple[NodeInfo, ...] = ()
    target_revision: str | None = Field(
        default=None, description="The revision the workload's template currently asks for"
    )
    rollout_in_progress: bool = False
    rollout_started_at: float | None = None

    @model_validator(mode="after")
    def _unique_ids(self) -> PoolSnapshot:
        ids = [g.id for g in self.groups]
        if len(ids) != len(set(ids)):
            raise ValueError(f"replica group ids must be unique, got {ids}")
        return self

    def group(self, group_id: str) -> ReplicaGroup:
        for g in self.groups:
            if g.id == group_id:
                return g
        raise KeyError(f"no replica group {group_id!r} in pool {self.pool.key}")

    def node(self, name: str) -> NodeInfo | None:
        for n in self.nodes:
            if n.name == name:
                return n
        return None

    def group_of_pod(self, pod: str) -> ReplicaGroup | None:
        for g in self.groups:
            if pod in g.pods:
                return g
        return None

    def groups_on_node(self, node: str) -> list[ReplicaGroup]:
        return [g for g in self.groups if node in g.nodes]

    @property
    def serving(self) -> list[ReplicaGroup]:
        return [g for g in self.groups if g.role is GroupRole.SERVING]

    @property
    def spares(self) -> list[ReplicaGroup]:
        return [g for g in self.groups if g.role is GroupRole.SPARE]

    def warm_copies(self, model: str, revision: str) -> list[ReplicaGroup]:
        """Warm groups (serving or spare) of exactly this model and revision."""
        return [g for g in self.groups if g.model == model and g.revision == revision and g.warm]
