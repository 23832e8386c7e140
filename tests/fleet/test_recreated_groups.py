"""A LeaderWorkerSet group its controller is re-creating is lost now, not after its new pods appear."""

from __future__ import annotations

from fleet.incident import LossReport
from fleet.loss import confirm_group, groups_being_recreated
from fleet.observation import WorkloadSelector
from fleet.pool import WorkloadKind
from tests.fleet.fleets import POOL, group, snapshot

LWS = WorkloadSelector(kind="LeaderWorkerSet", name="llama-lws", replicas=2)
SURVIVOR = group("llama-lws-1", kind=WorkloadKind.LEADER_WORKER_SET, pods=2, nodes=("n1", "n2"))


def report(gid: str) -> LossReport:
    return LossReport(
        pool=POOL,
        fingerprint=f"fp-{gid}",
        alert_name="FleetmendRankFailed",
        source="fastpath",
        replica_group=gid,
    )


def test_a_wanted_group_with_no_pod_left_is_described_from_its_sibling_and_confirmed_lost() -> None:
    snap = snapshot([SURVIVOR])
    (gone,) = groups_being_recreated(snap, [LWS], [report("llama-lws-0")])
    assert gone.id == "llama-lws-0" and gone.pods == ("llama-lws-0", "llama-lws-0-1")
    assert gone.leader_pod == "llama-lws-0" and gone.nodes == () and not gone.ready
    assert (gone.model, gone.revision, gone.gpus_per_pod) == (SURVIVOR.model, SURVIVOR.revision, 4)
    verdict = confirm_group(gone, {})  # none of its pods exists
    assert verdict.lost and set(verdict.lost_pods) == set(gone.pods)


def test_nothing_is_assumed_for_a_group_its_controller_no_longer_wants_or_cannot_describe() -> None:
    snap = snapshot([SURVIVOR])
    assert (
        groups_being_recreated(snap, [LWS], [report("llama-lws-2")]) == []
    )  # scaled away: index >= replicas
    assert groups_being_recreated(snapshot([]), [LWS], [report("llama-lws-0")]) == []  # no sibling to copy
    assert groups_being_recreated(snap, [], [report("llama-lws-0")]) == []  # no such LeaderWorkerSet
    assert groups_being_recreated(snap, [LWS], [report("llama-lws-1")]) == []  # present: confirmed as usual
    deployment = LossReport(pool=POOL, fingerprint="fp-d", alert_name="x", source="fastpath", pod="llama-abc")
    assert groups_being_recreated(snap, [LWS], [deployment]) == []
