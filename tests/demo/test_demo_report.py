"""The demo report's arithmetic: which cut streams the fault explains, and which it does not.

The unit of loss is the replica group (DESIGN.md §3): one dead rank of a
multi-pod group cuts every stream the group serves (the gateway journals them
under the group's leader). Whatever else cut a stream - fleetmend's own actions
above all - must show as ``truncated``.
"""

from __future__ import annotations

import pytest

from fleet.gateway import JournalEntry, Outcome
from fleet.vocabulary import FaultKind, Tier
from worker.devstack.demo import count_cuts
from worker.devstack.scenarios import SCENARIOS, Fault, PodPlace, lost_group_pods

# A 2-pod LeaderWorkerSet group per index on its own nodes, plus one single-pod replica.
BEFORE = {
    p.name: p
    for p in (
        PodPlace("llama-405b-0", "uid-a", "gpu-node-4", "llama-405b-0"),
        PodPlace("llama-405b-0-1", "uid-b", "gpu-node-5", "llama-405b-0"),
        PodPlace("llama-405b-1", "uid-c", "gpu-node-2", "llama-405b-1"),
        PodPlace("llama-405b-1-1", "uid-d", "gpu-node-3", "llama-405b-1"),
        PodPlace("llama-x7", "uid-e", "gpu-node-5", "llama-x7"),
    )
}


def cut(replica: str, started_at: float, *, tokens: int = 20) -> JournalEntry:
    return JournalEntry(
        request_id=f"r-{replica}-{started_at}",
        pool="inference/llama-405b",
        tier=Tier.STANDARD,
        outcome=Outcome.TERMINAL_ERROR,
        replica=replica,
        started_at=started_at,
        ended_at=started_at + 1,
        tokens_streamed=tokens,
        truncated=True,
    )


def test_a_lost_rank_loses_its_whole_group_and_nothing_else() -> None:
    fault = Fault(FaultKind.RANK_LOST, "pod:rank")
    assert lost_group_pods(fault, BEFORE, "llama-405b-0-1") == {"llama-405b-0", "llama-405b-0-1"}


def test_a_lost_node_loses_every_group_with_a_pod_on_it() -> None:
    fault = Fault(FaultKind.NODE_LOST, "gpu-node-5")
    assert lost_group_pods(fault, BEFORE, None) == {"llama-405b-0", "llama-405b-0-1", "llama-x7"}


@pytest.mark.parametrize("fault", [Fault(FaultKind.SLOW_REPLICA, "pod:serving"), Fault(None, "pod:r2")])
def test_a_fault_that_kills_nothing_loses_nothing(fault: Fault) -> None:
    assert lost_group_pods(fault, BEFORE, "llama-405b-0") == set()


def test_every_demo_scenario_says_what_its_fault_takes() -> None:
    for scenario in SCENARIOS.values():  # Fault.__post_init__ refuses a kind it cannot answer for
        assert scenario.fault.takes(BEFORE, "llama-405b-0-1") <= set(BEFORE)


def test_streams_on_the_lost_groups_leader_are_the_faults_others_are_truncated() -> None:
    lost = lost_group_pods(Fault(FaultKind.RANK_LOST, "pod:rank"), BEFORE, "llama-405b-0-1")
    entries = [
        cut("llama-405b-0", 100.0),  # the leader of the group whose rank died: the fault's
        cut("llama-405b-0", 101.0),
        cut("llama-405b-1", 100.5),  # the surviving group: not the fault's
        cut("llama-405b-0", 102.0, tokens=0),  # failed before its first token: not a cut stream
    ]
    assert count_cuts(entries, lost, {}) == (2, 1)


def test_a_stream_on_the_replacement_that_reuses_the_lost_name_is_not_the_faults() -> None:
    lost = lost_group_pods(Fault(FaultKind.RANK_LOST, "pod:rank"), BEFORE, "llama-405b-0-1")
    # The LeaderWorkerSet recreated group 0 under the same names; its new leader took the name at 130.
    entries = [cut("llama-405b-0", 100.0), cut("llama-405b-0", 140.0)]
    assert count_cuts(entries, lost, {"llama-405b-0": 130.0}) == (1, 1)
