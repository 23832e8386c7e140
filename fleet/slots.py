"""Bounded remediation, fleet-wide: at most ``cap`` pieces of one kind of work at once.

Qualification Jobs (``fleet.qualification``) and recoveries rebuilding capacity (``rebuild_slot``
below) are counted from the world's own record each time a procedure asks
(Jobs not yet finished; recoveries whose phase Temporal's visibility shows), so nothing leaks
when a worker dies. Beyond the cap the asking procedure waits, queued, and says so. Two
procedures that ask in the same moment may both go, so the bound holds to within the work
started at that moment.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.recovery import Phase


class Slots(BaseModel):
    """The work of one kind running now, fleet-wide, and the cap on it."""

    running: list[str] = Field(default_factory=list, description="What runs (names, for the record)")
    cap: int = Field(ge=1)


class SlotDecision(BaseModel):
    free: bool
    reason: str


class SlotWork(BaseModel):
    """How a kind of work is named in the record: ``"3 of 8 {running}: {who} {goes}"``."""

    running: str  # e.g. "qualification Job(s) running fleet-wide"
    already: str  # e.g. "qualification Job(s) already run fleet-wide"
    goes: str  # e.g. "qualifies now"
    queued_for: str  # e.g. "qualification"
    starts: str  # e.g. "it starts when one ends"


def take_slot(who: str, slots: Slots, work: SlotWork) -> SlotDecision:
    """May ``who`` start its work now? Below the cap it goes; at the cap it is queued, naming what runs."""
    running = sorted(slots.running)
    shown = ", ".join(running[:5]) + (f" and {len(running) - 5} more" if len(running) > 5 else "")
    if len(running) < slots.cap:
        return SlotDecision(
            free=True, reason=f"{len(running)} of {slots.cap} {work.running}: {who} {work.goes}"
        )
    return SlotDecision(
        free=False,
        reason=f"{who} queued for {work.queued_for}: {len(running)} of {slots.cap} {work.already} ({shown}); "
        f"{work.starts}",
    )


# A recovery holds a rebuild slot from step 6 (scaling workloads back up) to the end of its ramp: the
# replacements' scheduling, image pulls and model-weight loads are what a fleet-wide burst contends for.
# One waiting on an operator holds none (its phase is awaiting-operator).
REBUILD_PHASES = (Phase.REBUILDING, Phase.PLACING, Phase.RAMPING)

REBUILDING = SlotWork(
    running="recoveries rebuilding capacity fleet-wide",
    already="recoveries already rebuild capacity fleet-wide",
    goes="rebuilds now",
    queued_for="rebuilding",
    starts="it rebuilds when one has ramped back",
)


def rebuild_slot(pool: str, slots: Slots) -> SlotDecision:
    """May ``pool``'s recovery scale its replacements up now? At most ``cap`` recoveries rebuild at once
    fleet-wide; beyond it the recovery waits, queued, after its deroute, shedding and promotion (which
    never wait: dead capacity leaves routing and warm spares serve at once)."""
    return take_slot(pool, slots, REBUILDING)


__all__ = ["REBUILDING", "REBUILD_PHASES", "SlotDecision", "SlotWork", "Slots", "rebuild_slot", "take_slot"]
