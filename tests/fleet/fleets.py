"""Small builders for pool snapshots used by the policy tests (package-local support: see tests/support.py)."""

from __future__ import annotations

from fleet.incident import PoolRef
from fleet.pool import GroupRole, NodeInfo, PoolSnapshot, ReplicaGroup, WorkloadKind
from fleet.shedding import SurvivorLoad
from fleet.vocabulary import NVLINK_DOMAIN_LABEL, ZONE_LABEL

POOL = PoolRef(namespace="llm", service="llama")


def node(
    name: str, domain: str | None = "nvl-a", zone: str = "z1", gpus: int = 8, used: int = 8, **kw: object
) -> NodeInfo:
    labels = {ZONE_LABEL: zone}
    if domain:
        labels[NVLINK_DOMAIN_LABEL] = domain
    labels.update(kw.pop("labels", {}))  # type: ignore[call-overload]
    return NodeInfo(name=name, labels=labels, gpu_allocatable=gpus, gpu_allocated=used, **kw)  # type: ignore[arg-type]


def group(
    gid: str,
    nodes: tuple[str, ...] = (),
    revision: str = "r1",
    model: str = "llama-70b",
    role: GroupRole = GroupRole.SERVING,
    ready: bool = True,
    engine_up: bool | None = None,
    pods: int = 1,
    gpus_per_pod: int = 4,
    kind: WorkloadKind = WorkloadKind.DEPLOYMENT,
) -> ReplicaGroup:
    pod_names = tuple(f"{gid}-{i}" for i in range(pods))
    return ReplicaGroup(
        id=gid,
        model=model,
        revision=revision,
        role=role,
        pods=pod_names,
        nodes=nodes or (f"node-{gid}",),
        leader_pod=pod_names[0],
        gpus_per_pod=gpus_per_pod,
        ready=ready,
        engine_up=engine_up,
        routed=role is GroupRole.SERVING,
        workload_kind=kind,
        workload_name="llama" if kind is WorkloadKind.DEPLOYMENT else "llama-lws",
    )


def snapshot(groups: list[ReplicaGroup], nodes: list[NodeInfo] | None = None, **kw: object) -> PoolSnapshot:
    if nodes is None:
        names = sorted({n for g in groups for n in g.nodes})
        nodes = [node(n) for n in names]
    return PoolSnapshot(pool=POOL, observed_at=1000.0, groups=tuple(groups), nodes=tuple(nodes), **kw)  # type: ignore[arg-type]


# Three survivors with room to spare: the shedding tests' calm pool.
CALM = [SurvivorLoad(group_id=f"g{i}", waiting=0, running=4, kv_usage=0.4, capacity_rps=20) for i in range(3)]
