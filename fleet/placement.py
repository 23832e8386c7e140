"""Step 7 of the replica-loss procedure: does the replacement fit - as a whole group?

A replacement needs an **admissible allocation of its whole shape**: every pod
gets ``gpus_per_pod`` GPUs on one node, at most ``max_pods_per_node`` pods share
a node, and a multi-pod group lands inside one topology domain (NVLink domain
by default). Free GPUs scattered across nodes or domains are not capacity for
it: that is **fragmentation**, and ``place_group`` says so in so many words -
"N free GPUs, no admissible group for shape S" - instead of leaving the
replacement silently Pending.

Nodes that are NotReady, cordoned, quarantined, tainted (NoSchedule/NoExecute
without a matching toleration), excluded (the failed node) or that do not match
the node selector are not candidates; ``PlacementResult.excluded`` says why for
each. Among admissible allocations it packs best-fit (fewest GPUs left over) so
large holes stay whole for the next multi-GPU group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from fleet.pool import NodeInfo, Taint
from fleet.vocabulary import NVLINK_DOMAIN_LABEL


class Toleration(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str | None = None  # None with operator Exists tolerates every taint
    operator: str = Field(default="Equal", pattern="^(Equal|Exists)$")
    value: str = ""
    effect: str | None = None  # None = every effect

    def tolerates(self, taint: Taint) -> bool:
        if self.effect is not None and self.effect != taint.effect:
            return False
        if self.key is None:
            return self.operator == "Exists"
        if self.key != taint.key:
            return False
        return self.operator == "Exists" or self.value == taint.value


class GroupShape(BaseModel):
    """What one replica group needs from the cluster."""

    model_config = ConfigDict(frozen=True)

    pods: int = Field(default=1, ge=1)
    gpus_per_pod: int = Field(default=1, ge=1)
    max_pods_per_node: int | None = Field(default=None, ge=1, description="None = as many as fit")
    domain_label: str | None = Field(
        default=NVLINK_DOMAIN_LABEL, description="Multi-pod groups must share this label's value; None = any"
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()

    @property
    def total_gpus(self) -> int:
        return self.pods * self.gpus_per_pod

    def describe(self) -> str:
        text = f"{self.pods} pod(s) x {self.gpus_per_pod} GPU"
        if self.max_pods_per_node:
            text += f", at most {self.max_pods_per_node} per node"
        if self.pods > 1 and self.domain_label:
            text += f", all in one {self.domain_label}"
        return text


class PlacementResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    admissible: bool
    nodes: tuple[str, ...] = Field(default=(), description="Target node per pod, in pod order")
    domain: str | None = None
    free_gpus: int = Field(description="Free GPUs on candidate nodes")
    needed_gpus: int
    fragmented: bool = Field(description="Enough free GPUs in total, but no admissible allocation")
    excluded: dict[str, str] = Field(default_factory=dict, description="node -> why it is not a candidate")
    reason: str


_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def _exclusion(node: NodeInfo, shape: GroupShape, exclude: set[str]) -> str | None:
    if node.name in exclude:
        return "excluded (failed node)"
    if node.ready is not True:
        return "not Ready"
    if node.unschedulable:
        return "cordoned"
    if node.quarantined:
        return "quarantined"
    for key, value in shape.node_selector.items():
        if node.labels.get(key) != value:
            return f"does not match node selector {key}={value}"
    for taint in node.taints:
        if taint.effect in _BLOCKING_EFFECTS and not any(t.tolerates(taint) for t in shape.tolerations):
            return f"taint {taint.key}={taint.value}:{taint.effect} not tolerated"
    if node.gpu_allocatable == 0:
        return "no GPUs"
    return None


def _slots(node: NodeInfo, shape: GroupShape) -> int:
    n = node.free_gpus // shape.gpus_per_pod
    return min(n, shape.max_pods_per_node) if shape.max_pods_per_node else n


def _pack(candidates: list[NodeInfo], shape: GroupShape) -> list[str] | None:
    """Best-fit: fill the nodes with the fewest free GPUs first; None if the group does not fit."""
    assignment: list[str] = []
    for node in sorted(candidates, key=lambda n: (n.free_gpus, n.name)):
        take = min(_slots(node, shape), shape.pods - len(assignment))
        assignment += [node.name] * take
        if len(assignment) == shape.pods:
            return assignment
    return None


def place_group(shape: GroupShape, nodes: Iterable[NodeInfo], exclude: Iterable[str] = ()) -> PlacementResult:
    excluded_set = set(exclude)
    excluded: dict[str, str] = {}
    candidates: list[NodeInfo] = []
    for node in nodes:
        why = _exclusion(node, shape, excluded_set)
        if why:
            excluded[node.name] = why
        else:
            candidates.append(node)
    free = sum(n.free_gpus for n in candidates)
    need = shape.total_gpus

    pools: dict[str | None, list[NodeInfo]] = defaultdict(list)
    if shape.pods > 1 and shape.domain_label:
        for node in candidates:
            domain = node.labels.get(shape.domain_label)
            if domain is None:
                excluded[node.name] = f"no {shape.domain_label} label (multi-pod groups need one domain)"
            else:
                pools[domain].append(node)
    else:
        pools[None] = candidates

    best: tuple[int, str, list[str]] | None = None
    for domain, members in pools.items():
        assignment = _pack(members, shape)
        if assignment is None:
            continue
        leftover = sum(n.free_gpus for n in members) - need
        key = (leftover, domain or "", assignment)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is not None:
        _, domain, assignment = best
        where = f" in {shape.domain_label}={domain}" if domain else ""
        return PlacementResult(
            admissible=True,
            nodes=tuple(assignment),
            domain=domain or None,
            free_gpus=free,
            needed_gpus=need,
            fragmented=False,
            excluded=excluded,
            reason=f"shape {shape.describe()} fits on {', '.join(dict.fromkeys(assignment))}{where}",
        )
    if free >= need:
        largest = max((n.free_gpus for n in candidates), default=0)
        per_domain = ", ".join(
            f"{d}: {sum(_slots(n, shape) for n in ms)} pod slot(s)"
            for d, ms in sorted(pools.items(), key=str)
            if d
        )
        detail = f"largest free block on one node is {largest} GPU(s)"
        if per_domain:
            detail += f"; per domain {per_domain}"
        reason = (
            f"{free} free GPUs, no admissible group for shape {shape.describe()} (fragmentation: {detail})"
        )
        fragmented = True
    else:
        reason = (
            f"only {free} free GPUs on schedulable nodes, shape {shape.describe()} needs {need}: "
            "new capacity must be provisioned"
        )
        fragmented = False
    return PlacementResult(
        admissible=False,
        free_gpus=free,
        needed_gpus=need,
        fragmented=fragmented,
        excluded=excluded,
        reason=reason,
    )
