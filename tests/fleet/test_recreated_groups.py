"""A LeaderWorkerSet group its controller is re-creating is lost now, not after its new pods appear."""

from __future__ import annotations

from fleet.incident import LossReport
from fleet.loss import confirm_group, groups_being_recreated, lws_group_of_pod, match_reports
from fleet.observation import WorkloadSelector
from fleet.pool import WorkloadKind
from fleet.rebuild import awaiting_recreation, uids_at_loss
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


def pod_report(pod: str) -> LossReport:
    return LossReport(pool=POOL, fingerprint=f"fp-{pod}", alert_name="KubePodCrashLooping", pod=pod)


def test_a_leaderworkerset_pod_names_its_group() -> None:
    assert lws_group_of_pod("llama-lws-0", ["llama-lws"]) == "llama-lws-0"  # the leader names the group
    assert lws_group_of_pod("llama-lws-0-3", ["llama-lws"]) == "llama-lws-0"  # worker 3 of group 0
    assert lws_group_of_pod("llama-lws-12-1", ["llama-lws"]) == "llama-lws-12"
    assert lws_group_of_pod("llama-7f9c-abcde", ["llama-lws"]) is None  # a Deployment's pod
    assert lws_group_of_pod("llama-lws-0", []) is None  # no such LeaderWorkerSet


def test_an_alert_about_a_leader_its_leaderworkerset_deleted_reaches_the_group_still_terminating() -> None:
    # An OOM-killed leader: the LeaderWorkerSet deleted its group to re-create it; the leader is gone
    # and its worker is still terminating, so the pool shows group 0 with the worker alone.
    terminating = SURVIVOR.model_copy(
        update={"id": "llama-lws-0", "pods": ("llama-lws-0-1",), "leader_pod": "llama-lws-0-1"}
    )
    snap = snapshot([terminating, SURVIVOR])
    assert set(match_reports(snap, [pod_report("llama-lws-0")])) == {"llama-lws-0"}
    assert match_reports(snap, [pod_report("llama-lws-0")], by_pod_name=False) == {}  # a recovery in flight
    # With no pod left, the group is the one its controller is re-creating.
    (gone,) = groups_being_recreated(snapshot([SURVIVOR]), [LWS], [pod_report("llama-lws-0-1")])
    assert gone.id == "llama-lws-0"


def test_a_group_re_created_while_confirmation_looked_is_not_awaited_again() -> None:
    lost = SURVIVOR.model_copy(
        update={"id": "llama-lws-0", "pods": ("llama-lws-0", "llama-lws-0-1"), "leader_pod": "llama-lws-0"}
    )
    # First look: the leader already deleted, its worker still the old object. Confirmed look: both new.
    first = {"llama-lws-0-1": "old-w", "llama-lws-1": "s", "llama-lws-1-1": "sw"}
    confirmed = {"llama-lws-0": "new-l", "llama-lws-0-1": "new-w", "llama-lws-1": "s", "llama-lws-1-1": "sw"}
    at_loss = uids_at_loss([lost], first, confirmed)
    assert at_loss == {"llama-lws-0-1": "old-w", "llama-lws-1": "s", "llama-lws-1-1": "sw"}
    # Against the confirmed look, the re-created group would be waited for until the timeout.
    assert awaiting_recreation([lost], confirmed, confirmed) == ["llama-lws-0"]
    assert awaiting_recreation([lost], at_loss, confirmed) == []
    # While the old worker is still there, the group is still being re-created.
    assert awaiting_recreation([lost], at_loss, first) == ["llama-lws-0"]
