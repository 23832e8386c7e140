"""The fence at detection: cordon a node the moment the fast path confirms it lost, fleet-wide.

A recovery cordons its failed nodes at runbook step 6, after the correlation window and its
first looks: seconds to tens of seconds after the loss, and per pool. A burst that takes out
a hundred nodes must not wait on a hundred recoveries for the scheduler to stop binding to the
dead machines. So when the fast path confirms a *node* lost (its Ready condition went
Unknown/False, or the node was deleted) it starts one ``NodeFence`` per node (DESIGN.md §3
step 6, moved ahead of the incident): observe the node, decide here, cordon through the ledger.
The recoveries that follow find the node cordoned and say so; triage still quarantines it
(label + taint) and qualification still returns it, as before.

Only the cordon moves ahead: it is what keeps replacements off a dead machine, and it is cheap to
undo. Deleting pods, quarantine labels and taints stay with the recovery and its triage.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

from fleet.pool import NodeInfo


class FenceVerdict(StrEnum):
    CORDON = "cordon"
    ALREADY_CORDONED = "already-cordoned"
    READY_AGAIN = "ready-again"
    GONE = "gone"


class FenceDecision(BaseModel):
    verdict: FenceVerdict
    reason: str


def fence_decision(node: str, info: NodeInfo | None) -> FenceDecision:
    """Cordon a node that is still not Ready, or Ready with a GPU problem condition, and still
    schedulable; otherwise say why not. (Whether its engines still serve is the removal breaker's
    question, ``fleet.breaker``: a GPU condition on a node whose engines answer may be a bad signal.)"""
    if info is None:
        return FenceDecision(
            verdict=FenceVerdict.GONE, reason=f"{node} is no longer in the cluster: nothing to cordon"
        )
    if info.unschedulable:
        return FenceDecision(
            verdict=FenceVerdict.ALREADY_CORDONED, reason=f"{node} is already cordoned: nothing to do"
        )
    if info.ready is True and info.gpu_problems:
        return FenceDecision(
            verdict=FenceVerdict.CORDON,
            reason=f"{node} shows {', '.join(info.gpu_problems)}: cordon it so no replacement is placed on "
            "a failing GPU",
        )
    if info.ready is True:
        return FenceDecision(
            verdict=FenceVerdict.READY_AGAIN,
            reason=f"{node} is Ready again: not cordoned (its pools' incidents triage it)",
        )
    state = "Unknown" if info.ready is None else "False"
    return FenceDecision(
        verdict=FenceVerdict.CORDON,
        reason=f"{node} is Ready={state}: cordon it so nothing new is scheduled onto it",
    )


def fence_workflow_id(node: str) -> str:
    """One fence per node at a time; a later loss of the same node starts a new run under this id."""
    return f"fence/{node}"
