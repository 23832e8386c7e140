"""The survivors' load after a loss: queues, KV-cache usage and preemptions, from two scrapes.

``survivor_loads`` gives the pressure figures of every routed serving group
that survived (what shedding, the retry budget and verification decide from),
``routed_backlog`` the requests waiting in the routed groups' queues, and
``next_admission_look`` how long the admission keeper waits before it looks at
those queues again.

A survivor whose engine did not answer the look in time (``PoolObservation.unread_engines``)
has no figures: ``survivors_look`` names it beside the loads of those read. Steps judge the
survivors' pressure on those read only; the unread still count for their capacity (they serve,
their EndpointSlice says so) and for no queue headroom (their queue is unknown, not empty).
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PartialLook, PoolObservation, judge_partial_look
from fleet.pool import ReplicaGroup
from fleet.shedding import SurvivorLoad

# Once Temporal suggests continuing as new (the history is thousands of events long), the keeper looks
# this many times its steady interval apart: a recovery stuck for days cannot reach the server's hard
# history limit (51,200 events) through the keeper's looks.
PARKED_FACTOR = 10.0


def survivor_load(
    group_id: str, before: EngineSnapshot, after: EngineSnapshot, seconds: float
) -> SurvivorLoad:
    """One survivor's pressure figures from two scrapes."""
    preempt = max(0.0, after.preemptions_total - before.preemptions_total) / seconds if seconds > 0 else 0.0
    return SurvivorLoad(
        group_id=group_id,
        waiting=after.waiting,
        running=after.running,
        kv_usage=after.kv_usage,
        preemptions_per_s=preempt,
        waiting_delta=after.waiting - before.waiting,
    )


def _survives(g: ReplicaGroup, after: PoolObservation, lost_ids: set[str]) -> bool:
    """A serving group that was not lost, routed or (Ready) answering this look. Envoy takes a replica
    out of its routing set when its health check times out, which a busy node does to survivors too
    (and with most hosts failing, Envoy's panic threshold routes to all of them anyway): one such look
    counted 0 survivors in a loaded 2-core CI run and planned on zero capacity. A replica whose own
    engine answered is capacity."""
    return g.id not in lost_ids and (g.routed or (g.ready and g.id in after.engines))


def survivor_loads(before: PoolObservation, after: PoolObservation, lost_ids: set[str]) -> list[SurvivorLoad]:
    """Pressure on every serving group that survived (``_survives``: queues, KV, preemptions/s)."""
    seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
    loads = []
    for g in after.snapshot.serving:
        if not _survives(g, after, lost_ids) or g.id not in after.engines:
            continue
        now_e = after.engines[g.id]
        loads.append(survivor_load(g.id, before.engines.get(g.id, now_e), now_e, seconds))
    return loads


class SurvivorsLook(BaseModel):
    """The survivors' load from two looks: figures of those read, and the ones that could not be read."""

    model_config = ConfigDict(frozen=True)

    loads: tuple[SurvivorLoad, ...]
    unread: dict[str, str] = Field(
        default_factory=dict, description="survivor group id -> why its engine was not read"
    )

    @property
    def note(self) -> str:
        """What the decision must say about the survivors it could not read ("" when it read them all)."""
        if not self.unread:
            return ""
        named = "; ".join(f"{g} ({why})" for g, why in sorted(self.unread.items()))
        return (
            f"{len(self.unread)} survivor(s) not read, judged on the {len(self.loads)} read: {named}; "
            "their capacity still counts, their queues are unknown (no headroom counted)"
        )


def survivors_look(before: PoolObservation, after: PoolObservation, lost_ids: set[str]) -> SurvivorsLook:
    """Every routed serving survivor: its load when its engine answered the last look, else why not.

    Unread is what ``after`` could not read (it answered neither in time); a survivor read now but
    not in ``before`` is judged on its one scrape (no rate), as ``survivor_loads`` always did.
    """
    unread = {
        g.id: after.unread_engines[g.id]
        for g in after.snapshot.serving
        if g.id not in lost_ids and g.routed and g.id in after.unread_engines
    }
    return SurvivorsLook(loads=tuple(survivor_loads(before, after, lost_ids)), unread=unread)


def survivors_read(
    before: PoolObservation, after: PoolObservation, lost_ids: set[str], *, waited_s: float, patience_s: float
) -> PartialLook:
    """May the protect step decide on these two looks? (``fleet.observation.judge_partial_look``.)

    Wanted: every routed serving survivor. Unread: a survivor either look could not read (its load
    needs both). Some read: proceed on them. None read: look again until ``patience_s``, then ask.
    """
    wanted = [g.id for g in after.snapshot.serving if g.id not in lost_ids and g.routed]
    unread = {g: after.unread_engines.get(g) or before.unread_engines.get(g, "") for g in wanted}
    return judge_partial_look(
        wanted,
        {g: why for g, why in unread.items() if why},
        waited_s=waited_s,
        patience_s=patience_s,
        what="the survivors' load",
    )


def routed_backlog(obs: PoolObservation, lost_ids: Iterable[str] = ()) -> float:
    """Requests waiting in the queues of the routed serving groups (the survivors and what came back)."""
    lost = set(lost_ids)
    return sum(
        obs.engines[g.id].waiting
        for g in obs.snapshot.groups
        if g.routed and g.id not in lost and g.id in obs.engines
    )


def next_admission_look(
    current_s: float,
    base_s: float,
    max_s: float,
    *,
    admission_moved: bool,
    backlog: float,
    awaiting_operator: bool = False,
    history_large: bool = False,
) -> float:
    """How long the admission keeper waits before its next look at the queues.

    A look that moved admission, or found requests waiting (the queues absorbing a gap, so the
    refused share is about to move), keeps the base interval; a steady look (nothing moved, queues
    empty) doubles the wait up to ``max_s``. While the procedure awaits an operator, waiting
    requests alone do not hold the base interval (nothing the procedure does will change capacity
    until somebody answers; only a moving admission does). Once the workflow's history is large
    (``history_large``: Temporal's continue-as-new suggestion), the keeper looks every
    ``PARKED_FACTOR`` x ``max_s`` whatever happens: about 130 history events an hour, so days of
    waiting stay far below the server's history limit. Capacity changes re-admit at once whatever
    the keeper's interval.
    """
    if history_large:
        return max(base_s, PARKED_FACTOR * max_s)
    if admission_moved or (backlog >= 1.0 and not awaiting_operator):
        return base_s
    return max(base_s, min(max_s, 2.0 * current_s))
