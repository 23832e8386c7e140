"""What a planned scale-down is asked to do, and the pure decisions of its drain (DESIGN.md §4).

``ScaleDownInput`` is the start argument of ``PlannedScaleDown`` - from the CLI,
a Temporal Schedule or a test. ``drain_progress`` turns one scrape of the
victims' engines into "still streaming where", and ``deadline_choice`` says
what the procedure does when an operator does not answer at the drain
deadline: extend once by the original deadline, then keep asking. The rest
answer the termination's questions: which workload to scale to what absolute
count (``workload_scale``; a LeaderWorkerSet only removes its highest groups),
whether the victims are gone and nothing else is going, and how many groups
verification expects ready.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.engine_metrics import EngineSnapshot
from fleet.incident import PoolRef
from fleet.observation import PoolObservation
from fleet.pool import PoolSnapshot, ReplicaGroup, WorkloadKind
from fleet.recovery import Refusal, RetryBudget
from fleet.vocabulary import LWS_GROUP_INDEX_LABEL

# Pods a scale-down is draining carry this annotation (value: the workflow id):
# the readiness keeper leaves their gate alone, so a drained replica never turns ready again.
DRAINING_ANNOTATION = "fleetmend.io/draining"


class ScaleDownInput(BaseModel):
    """One planned scale-down of a pool: to ``target_groups`` serving groups, or of named ``victims``."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    target_groups: int | None = Field(None, ge=0, description="Serving replica groups to keep")
    victims: list[str] | None = Field(None, description="Explicit victims: group ids or pod names")
    drain_deadline_s: float = Field(600.0, gt=0, description="How long the victims may take to drain")
    dry_run: bool = False
    warm_floor: int = Field(1, ge=0, description="Warm groups (serving or spare) that must remain")
    min_serving_groups: int = Field(1, ge=0, description="Capacity floor the guard protects")
    group_capacity_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Tokens/s one warm group sustains (from load tests); None = the busiest group's "
        "current rate, a conservative lower bound",
    )
    capacity_headroom: float = Field(1.1, ge=1.0, description="Remaining capacity must exceed demand by this")
    poll_interval_s: float = Field(2.0, gt=0, description="Drain and termination polling interval")
    operator_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long to wait for an operator: at the drain deadline (then extend once by itself), "
        "and for an approval before anything was removed (then end, removing nothing)",
    )
    incident_poll_s: float = Field(5.0, gt=0, description="Re-check interval while yielding to an incident")
    incident_yield_max_s: float = Field(
        3600.0, gt=0, description="Give up (abort, with the reason) after yielding this long"
    )
    terminate_timeout_s: float = Field(600.0, gt=0, description="How long the victims may take to go away")
    verify_settle_s: float = Field(
        30.0,
        ge=0,
        description="How long the remaining groups may take to read ready and routed again after the "
        "termination (the gateway's health checks settling) before verification fails",
    )
    requested_by: str = Field("operator", max_length=200, description="Who asked (operator, schedule id)")
    retry: RetryBudget = Field(default_factory=RetryBudget)

    @model_validator(mode="after")
    def _one_way_to_name_victims(self) -> ScaleDownInput:
        if (self.target_groups is None) == (self.victims is None):
            raise ValueError(
                "give either target_groups (--to N) or explicit victims, not both and not neither"
            )
        if self.victims is not None and not self.victims:
            raise ValueError("victims: name at least one replica group or pod")
        return self


class DrainProgress(BaseModel):
    """The victims' in-flight requests at one look."""

    model_config = ConfigDict(frozen=True)

    running: dict[str, float] = Field(default_factory=dict)
    waiting: dict[str, float] = Field(default_factory=dict)
    unreachable: tuple[str, ...] = ()
    unread: dict[str, str] = Field(
        default_factory=dict,
        description="pod -> why its engine's /metrics was not read (it answered too late: slow, not "
        "dead); such a victim may still hold requests, so the drain is not done",
    )

    @property
    def in_flight(self) -> int:
        return int(sum(self.running.values()) + sum(self.waiting.values()))

    @property
    def drained(self) -> bool:
        return self.in_flight == 0 and not self.unread

    def summary(self) -> str:
        busy = {p: int(self.running.get(p, 0) + self.waiting.get(p, 0)) for p in self.running}
        busy = {p: n for p, n in busy.items() if n}
        parts = [f"{p}: {n}" for p, n in sorted(busy.items())]
        text = f"{self.in_flight} request(s) in flight" + (f" ({', '.join(parts)})" if parts else "")
        if self.unreachable:
            text += f"; metrics unreachable on {', '.join(self.unreachable)} (counted as drained)"
        if self.unread:
            named = "; ".join(f"{p} ({why})" for p, why in sorted(self.unread.items()))
            text += f"; not read: {named} (not counted as drained: a slow engine may still hold requests)"
        return text


def drain_progress(
    pods: list[str], scrapes: Mapping[str, EngineSnapshot], unread: Mapping[str, str] | None = None
) -> DrainProgress:
    """Running + waiting per victim pod. A victim whose engine no longer answers (its process is gone:
    connection refused) holds nothing; one whose engine answered too late (``unread``) is not drained."""
    slow = {p: why for p, why in (unread or {}).items() if p in pods and p not in scrapes}
    running = {p: scrapes[p].running for p in pods if p in scrapes}
    waiting = {p: scrapes[p].waiting for p in pods if p in scrapes}
    return DrainProgress(
        running=running,
        waiting=waiting,
        unreachable=tuple(p for p in pods if p not in scrapes and p not in slow),
        unread=slow,
    )


def deadline_choice(unanswered_asks: int) -> str:
    """At an unanswered deadline: extend once by the original deadline, then only ask again."""
    return "extend" if unanswered_asks == 0 else "ask-again"


def victim_pods(victims: Iterable[ReplicaGroup]) -> list[str]:
    """Every pod of the victim groups, group by group (leaders and workers)."""
    return [p for g in victims for p in g.pods]


def victims_by_workload(victims: Iterable[ReplicaGroup]) -> dict[tuple[str, str], list[ReplicaGroup]]:
    """The victims grouped by the workload that owns them, (kind, name) in sorted order: one scale each."""
    out: dict[tuple[str, str], list[ReplicaGroup]] = {}
    for g in victims:
        out.setdefault((g.workload_kind.value, g.workload_name), []).append(g)
    return dict(sorted(out.items()))


def lws_scale_problem(
    obs: PoolObservation, name: str, groups: list[ReplicaGroup], current: int
) -> str | None:
    """A LeaderWorkerSet scales down from its highest group index: the victims must be those."""
    wanted = {str(i) for i in range(current - len(groups), current)}
    have: set[str] = set()
    for g in groups:
        leader = obs.pods.get(g.leader_pod)
        index = g.id.rsplit("-", 1)[-1] if leader is not None else ""
        have.add(index)
    if have != wanted:
        return (
            f"LeaderWorkerSet {name} removes group indexes {sorted(wanted)} ({LWS_GROUP_INDEX_LABEL}) "
            f"when scaled down, not the victims {sorted(g.id for g in groups)}; name the highest groups "
            "as explicit victims"
        )
    return None


class WorkloadScale(BaseModel):
    """How to scale one victims' workload: to an absolute count, or why that would remove the wrong pods."""

    model_config = ConfigDict(frozen=True)

    current: int | None
    replicas: int
    problem: str | None = None


def workload_scale(
    obs: PoolObservation, namespace: str, kind: str, name: str, groups: list[ReplicaGroup]
) -> WorkloadScale:
    """The absolute replica count that removes exactly ``groups`` (those still present) from the workload.

    Absolute, not relative: a retried or replayed scale never removes a group twice.
    """
    current = next((w.replicas for w in obs.workloads if w.kind == kind and w.name == name), None)
    if current is None:
        gone = f"{kind} {namespace}/{name} of the victims is gone; nothing to scale"
        return WorkloadScale(current=None, replicas=0, problem=gone)
    still_there = [g for g in groups if any(p in obs.pods for p in g.pods)]
    return WorkloadScale(
        current=current,
        replicas=max(0, current - len(still_there)),
        problem=lws_scale_problem(obs, name, groups, current)
        if kind == WorkloadKind.LEADER_WORKER_SET
        else None,
    )


def victims_present(obs: PoolObservation, pods: Iterable[str]) -> list[str]:
    """Victim pods still in the pool (terminating ones included): the termination is not over."""
    return [p for p in pods if p in obs.pods]


def termination_overdue(present: list[str], timeout_s: float) -> Refusal:
    """What an operator is asked when victims outlive the termination timeout (retry the wait, skip, abort)."""
    return Refusal(
        step="terminate-wait",
        what=f"terminate {', '.join(present)}",
        error=f"still present {timeout_s:g} s after the scale-down; check the pods' finalizers and the "
        "workload controller",
    )


def others_terminating(obs: PoolObservation, pods: Iterable[str]) -> list[str]:
    """Pool pods being deleted that are not victims: the workload controller chose other pods."""
    victims = set(pods)
    return sorted(
        p for p, o in obs.pods.items() if o.deleting and p not in victims and obs.snapshot.group_of_pod(p)
    )


def serving_without(snapshot: PoolSnapshot, victim_ids: Iterable[str]) -> int:
    """Serving groups the pool keeps once the victims are gone: what verification expects ready."""
    victims = set(victim_ids)
    return len([g for g in snapshot.serving if g.id not in victims])


def ready_without(snapshot: PoolSnapshot, victim_ids: Iterable[str]) -> int:
    """Remaining serving groups that read ready and routed."""
    victims = set(victim_ids)
    return len([g for g in snapshot.serving if g.ready and g.routed and g.id not in victims])
