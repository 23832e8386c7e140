"""One look of the admission keeper at the routed replicas' queues, and what it would re-admit.

The recovery's admission keeper (``workflows/admission.py``) looks with a workflow timer and an
activity per look. While the recovery waits on an operator, the same looks run inside one
activity (``watch_admission``) that ends only when admission would move, so the hours an operator
takes add no history per look. Both take their looks through ``keeper_look`` and decide with
``keeper_readmission``: the same look moves admission the same way in either place.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from fleet.arrivals import ArrivalTally
from fleet.observation import PoolObservation
from fleet.service_rate import capacity_to_count_on, routed_served_rate, smoothed
from fleet.shedding import PressureThresholds, QueueRoom, ShedDecision, decide_readmission
from fleet.survivor_load import routed_backlog

# Arrivals the gateway counted over at least this long replace the first estimate (open-loop clients
# arrive in bursts; the protect step's first window is a second or two).
ARRIVALS_COUNTED_S = 5.0


class KeeperMemory(BaseModel):
    """What the keeper carries from one look to the next."""

    model_config = ConfigDict(frozen=True)

    arrivals: ArrivalTally = ArrivalTally()
    previous: PoolObservation | None = None  # the last look (a served rate needs two)
    served_rps: float | None = None  # the routed replicas' served rate, smoothed over the looks


class KeeperLook(BaseModel):
    """What one look says: the queues, the arrivals counted, the capacity to count on, and why."""

    model_config = ConfigDict(frozen=True)

    memory: KeeperMemory
    backlog: float
    arrival_rps: float | None  # None until the gateway counted ARRIVALS_COUNTED_S
    capacity_rps: float
    change: str  # what the incident record says if this look moves admission


def keeper_look(
    memory: KeeperMemory,
    obs: PoolObservation,
    lost_ids: Iterable[str],
    *,
    refused_share: float,
    planned_capacity_rps: float,
) -> KeeperLook:
    """Read one observation: the routed backlog, the gateway's arrival count, the served rate."""
    lost = set(lost_ids)
    backlog = routed_backlog(obs, lost)
    arrivals = memory.arrivals.add(obs, refused_share)
    arrival = arrivals.rate(ARRIVALS_COUNTED_S)
    served = memory.served_rps
    if memory.previous is not None:
        served = smoothed(served, routed_served_rate(memory.previous, obs, lost))
    capacity, measured = capacity_to_count_on(planned_capacity_rps, served)
    notes = [f"queues re-read: {backlog:.0f} request(s) waiting on the routed replicas"]
    if arrival is not None:
        notes.append(f"arrivals {arrival:.1f} req/s counted by the gateway over {arrivals.seconds:.0f} s")
    if measured:
        notes.append(measured)
    return KeeperLook(
        memory=KeeperMemory(arrivals=arrivals, previous=obs, served_rps=served),
        backlog=backlog,
        arrival_rps=arrival,
        capacity_rps=capacity,
        change="; ".join(notes),
    )


def keeper_queue_room(wait_budget_s: float, backlog: float, look_s: float) -> QueueRoom | None:
    """What the routed replicas' queues can absorb until the keeper's next look (None: budget 0).

    The horizon is twice the keeper's interval: a change takes effect a moment after it is decided.
    """
    if wait_budget_s <= 0:
        return None
    return QueueRoom(wait_budget_s=wait_budget_s, backlog=backlog, horizon_s=2 * look_s)


def keeper_readmission(
    arrival_rps: float,
    capacity_rps: float,
    change: str,
    *,
    backlog: float,
    wait_budget_s: float,
    look_s: float,
    target_utilization: float,
) -> ShedDecision:
    """The admission the keeper would set now: the gap the queues cannot absorb is refused, with the
    routed capacity planned at ``target_utilization``."""
    return decide_readmission(
        arrival_rps,
        capacity_rps,
        change,
        warm_floor_restored=False,
        thresholds=PressureThresholds(target_utilization=target_utilization),
        queues=keeper_queue_room(wait_budget_s, backlog, look_s),
    )


__all__ = [
    "ARRIVALS_COUNTED_S",
    "KeeperLook",
    "KeeperMemory",
    "keeper_look",
    "keeper_queue_room",
    "keeper_readmission",
]
