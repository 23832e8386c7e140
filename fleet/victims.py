"""Which replica groups a planned scale-down removes (DESIGN.md §4).

``choose_victims(snapshot, target_groups=N)`` or ``choose_victims(snapshot,
explicit=[...])`` picks **whole serving groups only** and never:

* removes the **last warm copy of a model revision** (a warm group of that
  model@revision, serving or spare, must remain);
* takes the pool **below the warm floor** (``warm_floor`` = warm groups of the
  pool, serving or spare, that must remain).

Warm means loaded and healthy (``ReplicaGroup.warm``): a replica that the
readiness gate holds not-ready because it is saturated is warm - and busy.

Among the groups it may remove, it prefers the ones cheapest to lose: not warm
first (they serve nothing), then the least loaded (running + waiting requests
to drain), then the coldest (lowest KV-cache usage: least cached work lost),
then the lowest id so the choice is deterministic. When the rules allow fewer
victims than asked, the result is partial (``complete`` False) and ``blocked``
says why each refused group was refused. Whether the remaining pool can carry
the demand is the capacity guard's question (``fleet.capacity``), asked next.
Explicit victims may be named by group id or by any of their pods; an unknown
name is bad input (``ValueError``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.pool import GroupRole, PoolSnapshot, ReplicaGroup, WorkloadKind


class GroupLoad(BaseModel):
    model_config = ConfigDict(frozen=True)

    running: float = Field(default=0.0, ge=0)
    waiting: float = Field(default=0.0, ge=0)
    kv_usage: float | None = Field(default=None, ge=0)

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting


def group_loads(engines: Mapping[str, EngineSnapshot]) -> dict[str, GroupLoad]:
    """Each group's load from its leader's scrape: what draining it would wait for, and its warm cache."""
    return {
        gid: GroupLoad(running=e.running, waiting=e.waiting, kv_usage=e.kv_usage)
        for gid, e in engines.items()
    }


class VictimChoice(BaseModel):
    model_config = ConfigDict(frozen=True)

    victims: tuple[str, ...]
    wanted: int
    complete: bool
    blocked: dict[str, str] = Field(default_factory=dict)
    remaining_serving: int
    remaining_warm: int
    reason: str


def _preference(group: ReplicaGroup, loads: Mapping[str, GroupLoad]) -> tuple[bool, float, float, str]:
    load = loads.get(group.id, GroupLoad())
    return (group.warm, load.in_flight, load.kv_usage or 0.0, group.id)


def _why_not(group: ReplicaGroup, snapshot: PoolSnapshot, chosen: set[str], warm_floor: int) -> str | None:
    if group.role is not GroupRole.SERVING:
        return "not a serving group"
    if not group.warm:
        return None  # not warm: removing it costs neither a warm copy nor the floor
    copies = [
        g
        for g in snapshot.warm_copies(group.model, group.revision)
        if g.id not in chosen and g.id != group.id
    ]
    if not copies:
        return f"last warm copy of {group.model}@{group.revision}"
    warm_left = sum(1 for g in snapshot.groups if g.warm and g.id not in chosen) - 1
    if warm_left < warm_floor:
        return f"would leave {warm_left} warm group(s), below the warm floor of {warm_floor}"
    return None


def _resolve(snapshot: PoolSnapshot, name: str) -> ReplicaGroup:
    for g in snapshot.groups:
        if g.id == name:
            return g
    group = snapshot.group_of_pod(name)
    if group is None:
        known = ", ".join(g.id for g in snapshot.serving) or "none"
        raise ValueError(
            f"{name!r} is neither a replica group nor a pod of pool {snapshot.pool.key} (groups: {known})"
        )
    return group


def _lws_index_rank(group: ReplicaGroup) -> int:
    """Order of removal a workload imposes: a LeaderWorkerSet's highest group index first; others 0."""
    if group.workload_kind is not WorkloadKind.LEADER_WORKER_SET:
        return 0
    tail = group.id.rsplit("-", 1)[-1]
    return -int(tail) if tail.isdigit() else 0


def choose_victims(
    snapshot: PoolSnapshot,
    target_groups: int | None = None,
    explicit: Sequence[str] | None = None,
    loads: Mapping[str, GroupLoad] | None = None,
    warm_floor: int = 1,
) -> VictimChoice:
    if (target_groups is None) == (explicit is None):
        raise ValueError("give either a target group count or explicit victims, not both")
    if warm_floor < 0:
        raise ValueError(f"warm floor must be >= 0, got {warm_floor}")
    loads = loads or {}
    serving = snapshot.serving
    if explicit is not None:
        candidates = list(dict.fromkeys(_resolve(snapshot, n) for n in explicit))
        wanted = len(candidates)
        ordered = candidates  # the operator's order
    else:
        assert target_groups is not None
        if target_groups < 0:
            raise ValueError(f"target replica-group count must be >= 0, got {target_groups}")
        wanted = max(0, len(serving) - target_groups)
        # A LeaderWorkerSet scales down from its highest group index: only those groups can go.
        ordered = sorted(serving, key=lambda g: (_lws_index_rank(g), _preference(g, loads)))

    chosen: list[str] = []
    blocked: dict[str, str] = {}
    for group in ordered:
        if len(chosen) == wanted:
            break
        why = _why_not(group, snapshot, set(chosen), warm_floor)
        if why:
            blocked[group.id] = why
        else:
            chosen.append(group.id)
    remaining_serving = len(serving) - sum(1 for g in chosen if snapshot.group(g).role is GroupRole.SERVING)
    remaining_warm = sum(1 for g in snapshot.groups if g.warm and g.id not in chosen)
    if wanted == 0:
        reason = f"nothing to remove: {len(serving)} serving group(s), target {target_groups}"
    else:
        reason = f"remove {len(chosen)} of {wanted} wanted: {', '.join(chosen) or 'none'}"
        if blocked:
            reason += "; kept " + "; ".join(f"{g} ({why})" for g, why in blocked.items())
        reason += (
            f"; {remaining_serving} serving and {remaining_warm} warm group(s) remain (floor {warm_floor})"
        )
    return VictimChoice(
        victims=tuple(chosen),
        wanted=wanted,
        complete=len(chosen) == wanted,
        blocked=blocked,
        remaining_serving=remaining_serving,
        remaining_warm=remaining_warm,
        reason=reason,
    )
