"""The removal breaker: a cap on how much *still-serving* capacity fleetmend removes on a signal alone.

A signal can be wrong for the whole fleet at once: a health check that marks every node of a type
unhealthy while its engines serve, a node-monitor verdict from a partitioned API path, a bad driver
probe. NVSentinel's users met each of these (NVSentinel #1663/#1716, #911); its answer is an absolute
``maxNodes`` cap (PR #1713). fleetmend's breaker separates the two things such a signal could ask for:

* **dead capacity** (every engine on the node was probed and none answers): fencing it is never limited. Routing to, or
  scheduling onto, the dead is always worse than acting, and a real mass failure must be handled at full
  speed.
* **capacity that still serves** (some engine on the node answers): an action that would take it out
  (cordon, quarantine, eviction, deroute, drain) is granted only within a budget per window: in any
  ``window_s`` (10 minutes), at most the larger of ``min_nodes`` (1) and ``fleet_share`` (5 %) of the
  fleet's GPU nodes, and never more than ``max_nodes`` (16). A node is counted once per window, however
  many procedures ask about it.

The first request beyond the budget **trips** the breaker: it is held, and so is every later request to
remove serving capacity, until an operator resets it with a reason. The trip says which signal, how many
nodes, and what share of the nodes asked about still served. Returning capacity (uncordon, return from
quarantine, readmission) never asks the breaker. A reset does not replay what was held: each holder is
told, re-reads the world as it is then, and decides again (a node that came back meanwhile is left
alone).

Pure: the durable state lives in the ``RemovalBreaker`` workflow (``workflows/breaker.py``).
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, Field

BREAKER_WORKFLOW_ID = "breaker/removals"


def breaker_workflow_id(task_queue: str) -> str:
    """The breaker of the fleetmend deployment on ``task_queue``: ``breaker/removals/<task queue>``. Two
    fleets whose workers share a Temporal namespace (two clusters, a staging next to production)
    never count, hold or release each other's removals."""
    return f"{BREAKER_WORKFLOW_ID}/{task_queue}"


class BreakerLimits(BaseModel):
    window_s: float = Field(600.0, gt=0, description="The window the budget counts over, seconds")
    fleet_share: float = Field(0.05, ge=0, le=1, description="Share of the fleet's GPU nodes per window")
    min_nodes: int = Field(1, ge=0, description="Nodes per window however small the fleet")
    max_nodes: int = Field(16, ge=0, description="Nodes per window however large the fleet")


class BreakerInput(BaseModel):
    """The breaker workflow's start (and continue-as-new) input: its state so far."""

    state: BreakerState | None = None


class RemovalRequest(BaseModel):
    """A procedure asks to remove capacity on ``node`` because of ``signal``."""

    node: str
    action: str = Field(description="What it would do: cordon, quarantine, deroute, drain, evict")
    signal: str = Field(description="Why: the evidence the procedure acts on")
    requester: str = Field(description="The asking workflow's id (told when a held request may re-decide)")
    engines: int = Field(ge=0, description="Engines of managed pools on the node")
    answering: int = Field(ge=0, description="Of them, how many answered a direct probe just now")
    unread: int = Field(
        0, ge=0, description="Of them, how many the probe did not reach in its time (not known dead)"
    )
    fleet_gpu_nodes: int = Field(ge=0, description="GPU nodes in the fleet (the share's base)")
    limits: BreakerLimits | None = Field(
        None, description="The asker's configured limits (FLEETMEND_REMOVAL_BREAKER); the newest ask's apply"
    )


class Verdict(StrEnum):
    DEAD = "dead"  # no engine answers: never limited, not counted
    GRANTED = "granted"  # serving capacity, within the budget (counted)
    HELD = "held"  # serving capacity beyond the budget, or the breaker is tripped


class BreakerDecision(BaseModel):
    verdict: Verdict
    reason: str
    counted: int = Field(description="Serving nodes granted in the window, after this decision")
    cap: int


class Grant(BaseModel):
    node: str
    signal: str
    requester: str
    at: float


class Held(BaseModel):
    request: RemovalRequest
    at: float


class Trip(BaseModel):
    at: float
    signal: str
    cap: int
    reason: str


class Reset(BaseModel):
    at: float
    operator: str
    reason: str
    released: list[str] = Field(description="The held requesters told to decide again")


class BreakerState(BaseModel):
    limits: BreakerLimits = Field(default_factory=BreakerLimits)
    granted: list[Grant] = Field(default_factory=list)
    held: list[Held] = Field(default_factory=list)
    trip: Trip | None = None
    resets: list[Reset] = Field(default_factory=list)
    dead_passed: int = Field(0, description="Requests for dead capacity, never limited")


BreakerInput.model_rebuild()


class BreakerStatus(BaseModel):
    """What ``fleetmend breaker status`` and the Temporal UI show."""

    tripped: bool
    trip: Trip | None
    held: list[Held]
    granted_in_window: list[Grant]
    cap_for_last_fleet: int | None
    dead_passed: int
    resets: list[Reset]


def node_cap(limits: BreakerLimits, fleet_gpu_nodes: int) -> int:
    """Serving nodes per window: max(min_nodes, share of the fleet), never above max_nodes."""
    return min(limits.max_nodes, max(limits.min_nodes, math.floor(limits.fleet_share * fleet_gpu_nodes)))


def _in_window(state: BreakerState, now: float) -> list[Grant]:
    return [g for g in state.granted if now - g.at < state.limits.window_s]


def decide(state: BreakerState, req: RemovalRequest, now: float) -> tuple[BreakerDecision, BreakerState]:
    """The breaker's answer to one request, and its state after it."""
    if req.limits is not None and req.limits != state.limits:
        state = state.model_copy(update={"limits": req.limits})
    cap = node_cap(state.limits, req.fleet_gpu_nodes)
    recent = _in_window(state, now)
    counted = len({g.node for g in recent})
    if req.answering == 0 and req.unread == 0:
        decision = BreakerDecision(
            verdict=Verdict.DEAD,
            reason=f"{req.node}: none of its {req.engines} engine(s) answers: dead capacity, never held",
            counted=counted,
            cap=cap,
        )
        return decision, state.model_copy(update={"dead_passed": state.dead_passed + 1})
    serving = f"{req.answering} of {req.engines} engine(s) on {req.node} still answer" + (
        f" ({req.unread} not read in time: not known dead)" if req.unread else ""
    )
    if state.trip is not None:
        decision = BreakerDecision(
            verdict=Verdict.HELD,
            reason=f"held: the removal breaker is tripped ({state.trip.reason}); {serving}",
            counted=counted,
            cap=cap,
        )
        held = [h for h in state.held if h.request.requester != req.requester] + [Held(request=req, at=now)]
        return decision, state.model_copy(update={"held": held})
    if req.node in {g.node for g in recent} or counted < cap:
        grant = Grant(node=req.node, signal=req.signal, requester=req.requester, at=now)
        after = len({g.node for g in recent} | {req.node})
        decision = BreakerDecision(
            verdict=Verdict.GRANTED,
            reason=f"{req.action} {req.node} granted although {serving}: {after} of {cap} serving node(s) "
            f"in {state.limits.window_s:g} s",
            counted=after,
            cap=cap,
        )
        return decision, state.model_copy(update={"granted": [*recent, grant]})
    asked = {g.node for g in recent} | {h.request.node for h in state.held} | {req.node}
    trip = Trip(
        at=now,
        signal=req.signal,
        cap=cap,
        reason=f"suspected bad signal: {len(asked)} nodes whose engines still answer asked to be removed "
        f"in {state.limits.window_s:g} s (cap {cap} of {req.fleet_gpu_nodes} GPU nodes); last signal: "
        f"{req.signal}",
    )
    decision = BreakerDecision(
        verdict=Verdict.HELD,
        reason=f"held: {trip.reason}; {serving}. Reset with `fleetmend breaker reset --reason ...` once "
        "the signal is understood",
        counted=counted,
        cap=cap,
    )
    held = [*state.held, Held(request=req, at=now)]
    return decision, state.model_copy(update={"trip": trip, "held": held})


def reset(state: BreakerState, operator: str, reason: str, now: float) -> tuple[list[str], BreakerState]:
    """Close the breaker: the held requesters are released to decide again against the world as it is
    now (never replayed); the window's count starts afresh."""
    released = list(dict.fromkeys(h.request.requester for h in state.held))
    record = Reset(at=now, operator=operator, reason=reason, released=released)
    return released, state.model_copy(
        update={"trip": None, "held": [], "granted": [], "resets": [*state.resets[-19:], record]}
    )
