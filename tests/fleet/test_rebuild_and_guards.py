"""The decisions the procedures used to compute inline: the rebuild plan, the capacity guards'
arithmetic from two observations, and the verification observations (now pure functions in fleet/)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fleet.capacity import measured_token_rates, recovery_guard, scale_down_guard
from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PoolObservation
from fleet.pool import GroupRole, ReplicaGroup, WorkloadKind
from fleet.rebuild import plan_rebuild
from fleet.recovery_observations import recovery_observations, warm_groups_before
from fleet.verification import LedgerReconcile
from tests.fleet.fleets import group, snapshot


def _obs(groups: list[ReplicaGroup], tokens: dict[str, float], at: float) -> PoolObservation:
    snap = snapshot(groups).model_copy(update={"observed_at": at})
    return PoolObservation(
        snapshot=snap,
        engines={gid: EngineSnapshot(generation_tokens_total=t) for gid, t in tokens.items()},
        router_label="fleetmend.io/serving",
    )


# ---------------------------------------------------------------- rebuild plan


def test_no_spare_retires_the_lost_pods_then_grows_back_by_absolute_counts() -> None:
    lost = [group("g1"), group("g2")]
    plan = plan_rebuild(lost, promoted=[], unmatched_ids=["g1", "g2"], replicas={("Deployment", "llama"): 5})
    (workload,) = plan.workloads
    assert workload.retire_pods == ("g1-0", "g2-0")
    assert [(s.step, s.replicas) for s in workload.scales] == [
        ("retire-lost-llama", 3),
        ("replace-lost-llama", 5),
    ]
    assert plan.unmatched == ("g1", "g2") and plan.expected_new == 2


def test_a_promoted_spare_covers_the_slot_and_the_spare_workload_grows_by_one() -> None:
    lost = [group("g1")]
    spare = group("s1", role=GroupRole.SPARE).model_copy(update={"workload_name": "llama-spare"})
    plan = plan_rebuild(
        lost,
        [spare],
        unmatched_ids=[],
        replicas={("Deployment", "llama"): 5, ("Deployment", "llama-spare"): 1},
    )
    scales = [(s.name, s.replicas) for w in plan.workloads for s in w.scales]
    assert scales == [("llama", 4), ("llama-spare", 2)]
    assert plan.unmatched == () and plan.expected_new == 1


def test_a_leader_worker_set_recreates_its_group_itself_so_it_gets_no_scale() -> None:
    lost = [group("lws-0", pods=2, kind=WorkloadKind.LEADER_WORKER_SET)]
    plan = plan_rebuild(lost, [], unmatched_ids=["lws-0"], replicas={("LeaderWorkerSet", "llama-lws"): 2})
    assert plan.workloads == ()
    assert plan.expected_new == 1


@given(
    replicas=st.integers(min_value=0, max_value=12),
    lost_n=st.integers(min_value=1, max_value=6),
    covered=st.integers(min_value=0, max_value=6),
)
def test_rebuild_counts_are_absolute_and_restore_the_serving_count(
    replicas: int, lost_n: int, covered: int
) -> None:
    covered = min(covered, lost_n)
    lost = [group(f"g{i}") for i in range(lost_n)]
    spares = [
        group(f"s{i}", role=GroupRole.SPARE).model_copy(update={"workload_name": "spare"})
        for i in range(covered)
    ]
    unmatched = [g.id for g in lost[covered:]]
    counts = {("Deployment", "llama"): replicas, ("Deployment", "spare"): covered}
    plan = plan_rebuild(lost, spares, unmatched, counts)
    final: dict[str, int] = {}
    for w in plan.workloads:
        for s in w.scales:
            assert s.replicas >= 0
            final[s.name] = s.replicas  # the last scale of a workload is where it ends
    # Serving workload: lost pods leave, the groups no spare covered come back.
    assert final["llama"] == max(0, replicas - lost_n) + len(unmatched)
    # Spare workload: grows by the spares that were promoted.
    if covered:
        assert final["spare"] == 2 * covered
    # Every lost pod is marked to go first; the same plan again is the same plan (a retry cannot compound).
    assert sorted(p for w in plan.workloads for p in w.retire_pods) == sorted(p for g in lost for p in g.pods)
    assert plan_rebuild(lost, spares, unmatched, counts) == plan


# ---------------------------------------------------------------- capacity guards


def test_token_rates_count_a_group_that_is_not_ready_as_zero() -> None:
    groups = [group("g1"), group("g2", ready=False)]
    before = _obs(groups, {"g1": 0, "g2": 0}, at=1000.0)
    after = _obs(groups, {"g1": 400, "g2": 400}, at=1002.0)
    assert measured_token_rates(before, after) == {"g1": 200.0, "g2": 0.0}


def test_recovery_guard_refuses_to_take_the_last_serving_group() -> None:
    groups = [group("g1"), group("g2", ready=False)]
    before = _obs(groups, {"g1": 0, "g2": 0}, at=1000.0)
    after = _obs(groups, {"g1": 400, "g2": 0}, at=1002.0)
    refused = recovery_guard("force-delete", before, after, ["g1"], min_groups=1)
    assert not refused.allowed and "floor is 1" in refused.reason
    allowed = recovery_guard("force-delete", before, after, ["g2"], min_groups=1)
    assert allowed.allowed, allowed.reason


def test_recovery_guard_counts_an_idle_ready_group_for_the_floor_not_a_dead_one() -> None:
    """A short window in which a ready group generated nothing (a quiet pool, a starved machine): it
    is idle, not dead, so force-deleting the dead group beside it keeps the floor."""
    groups = [group("dead", ready=False), group("idle")]
    before = _obs(groups, {"dead": 0, "idle": 0}, at=1000.0)
    after = _obs(groups, {"dead": 0, "idle": 0}, at=1000.5)
    allowed = recovery_guard("force-delete", before, after, ["dead"], min_groups=1)
    assert allowed.allowed and allowed.remaining_groups == 1, allowed.reason
    refused = recovery_guard("force-delete", before, after, ["idle"], min_groups=1)
    assert not refused.allowed and "0 serving group(s) would remain, the floor is 1" in refused.reason


@given(
    rates=st.lists(st.floats(min_value=0, max_value=1000), min_size=2, max_size=8),
    victims=st.integers(min_value=1, max_value=4),
    headroom=st.floats(min_value=1.0, max_value=2.0),
)
def test_scale_down_guard_allows_only_what_the_remaining_groups_carry(
    rates: list[float], victims: int, headroom: float
) -> None:
    groups = [group(f"g{i}") for i in range(len(rates))]
    before = _obs(groups, {g.id: 0.0 for g in groups}, at=1000.0)
    after = _obs(groups, {g.id: r for g, r in zip(groups, rates, strict=True)}, at=1001.0)
    removing = [g.id for g in groups[:victims]]
    decision, demand = scale_down_guard(
        before, after, removing, min_groups=1, headroom=headroom, group_capacity_tokens_per_s=None
    )
    assert demand == sum(rates)
    if decision.allowed:
        assert decision.remaining_tokens_per_s >= demand * headroom - 1e-6
        assert decision.remaining_groups >= 1


# ---------------------------------------------------------------- verification observations


def test_recovery_observations_target_the_pool_as_it_was_and_see_quarantine_from_the_node() -> None:
    initial = _obs([group("g1"), group("g2"), group("s1", role=GroupRole.SPARE)], {}, at=900.0)
    groups_now = [group("g1"), group("g3")]
    before = _obs(groups_now, {"g1": 0, "g3": 0}, at=1000.0)
    after = _obs(groups_now, {"g1": 10, "g3": 10}, at=1001.0)
    obs = recovery_observations(
        initial,
        before,
        after,
        {"g2"},
        baseline_waiting={"g1": 0.0},
        quarantined=["node-g2"],
        reconcile=LedgerReconcile(),
    )
    assert obs.target_groups == 2  # the pool served two groups before the loss
    assert obs.workload_ready_groups == 2
    assert {r.group_id for r in obs.replicas} == {"g1", "g3"}
    assert not obs.failed_nodes["node-g2"].complete  # the node is not in the snapshot: not quarantined
    assert warm_groups_before(initial) == 3


def test_a_pod_that_is_already_gone_gets_no_mark_but_its_slot_is_still_taken_back() -> None:
    lost = [group("g1"), group("g2")]
    plan = plan_rebuild(
        lost, [], unmatched_ids=[], replicas={("Deployment", "llama"): 5}, present_pods=["g2-0", "other"]
    )
    (workload,) = plan.workloads
    assert workload.retire_pods == ("g2-0",)
    assert [s.replicas for s in workload.scales] == [3]


def test_a_lost_spare_promoted_earlier_is_replaced_in_the_serving_workload() -> None:
    """Incident 2: the spare promoted in incident 1 (still a pod of the spare workload) is lost."""
    serving = [group(f"g{i}") for i in range(4)]
    promoted_before = group("p1").model_copy(update={"workload_name": "llama-spare"})  # routed: serving
    spare = group("s1", role=GroupRole.SPARE).model_copy(update={"workload_name": "llama-spare"})
    pool = [*serving, promoted_before, spare]
    lost = [serving[0], promoted_before]
    plan = plan_rebuild(
        lost,
        [spare],
        unmatched_ids=["p1"],
        replicas={("Deployment", "llama"): 4, ("Deployment", "llama-spare"): 2},
        pool_groups=pool,
    )
    final = {s.name: s.replicas for w in plan.workloads for s in w.scales}
    # Serving: 4 - 1 lost + 1 replacement for the lost promoted spare = 4, plus 1 promoted now = 5 routed.
    assert final["llama"] == 4
    # Spare workload: 2 - 1 lost + 1 for the spare promoted now = 2 (one serving, one new warm spare).
    assert final["llama-spare"] == 2
    assert plan.expected_new == 2


def test_only_pods_of_lost_leader_worker_set_groups_on_unready_nodes_hold_a_group_back() -> None:
    from fleet.rebuild import pods_held_by_lost_nodes
    from tests.fleet.fleets import node

    lws = group("lws-0", nodes=("n1", "n2"), pods=2, kind=WorkloadKind.LEADER_WORKER_SET)
    deploy = group("d1", nodes=("n1",))
    nodes = [node("n1", ready=None), node("n2")]
    pods_on = {"lws-0-0": "n1", "lws-0-1": "n2", "d1-0": "n1"}
    assert pods_held_by_lost_nodes([lws, deploy], pods_on, nodes) == ["lws-0-0"]
    assert pods_held_by_lost_nodes([lws], pods_on, [node("n1"), node("n2")]) == []


def test_a_leader_worker_set_group_counts_as_recreated_once_every_pod_is_a_new_object() -> None:
    from fleet.rebuild import awaiting_recreation

    lws = group("lws-0", pods=2, kind=WorkloadKind.LEADER_WORKER_SET)
    before = {"lws-0-0": "u1", "lws-0-1": "u2"}
    assert awaiting_recreation([lws], before, {"lws-0-0": "u1", "lws-0-1": "u3"}) == ["lws-0"]
    assert awaiting_recreation([lws], before, {"lws-0-0": "u4", "lws-0-1": "u3"}) == []
    assert awaiting_recreation([lws], before, {}) == []  # gone, not yet recreated: pending pods say so


def test_reports_match_a_named_group_a_pods_group_and_every_group_on_a_node() -> None:
    from fleet.incident import LossReport
    from fleet.loss import match_reports
    from tests.fleet.fleets import POOL

    snap = snapshot([group("g1", nodes=("n1",)), group("g2", nodes=("n1",)), group("g3", nodes=("n2",))])
    report = LossReport(pool=POOL, fingerprint="f", alert_name="a", node="n1")
    assert sorted(match_reports(snap, [report])) == ["g1", "g2"]
    by_pod = LossReport(pool=POOL, fingerprint="f", alert_name="a", pod="g3-0")
    assert sorted(match_reports(snap, [by_pod])) == ["g3"]
    gone = LossReport(pool=POOL, fingerprint="f", alert_name="a", pod="g9-0")
    assert match_reports(snap, [gone]) == {}


def test_a_leader_worker_set_scale_down_picks_its_highest_group_index() -> None:
    from fleet.victims import GroupLoad, choose_victims

    groups = [group(f"llama-lws-{i}", pods=2, kind=WorkloadKind.LEADER_WORKER_SET) for i in range(3)]
    idle_first = {
        "llama-lws-0": GroupLoad(running=0, waiting=0),
        "llama-lws-2": GroupLoad(running=9, waiting=3),
    }
    choice = choose_victims(snapshot(groups), target_groups=2, loads=idle_first, warm_floor=1)
    assert choice.victims == ("llama-lws-2",)  # not the idle group 0: the LWS would remove index 2 anyway


def test_the_scale_up_waits_until_the_controller_lets_every_lost_pod_go() -> None:
    """Scale-down by the lost pods, then up by the replacements: a controller that saw only the second
    update removed one lost pod where two were lost, and still counts the other as a replica."""
    from fleet.observation import PodObservation
    from fleet.rebuild import still_counted

    lost = ("llama-a", "llama-b")
    coalesced = {
        "llama-a": PodObservation(pod="llama-a", deleting=True),
        "llama-b": PodObservation(pod="llama-b"),  # still Running on the dead node, counted as a replica
        "llama-c": PodObservation(pod="llama-c"),
    }
    assert still_counted(lost, coalesced) == ["llama-b"]
    both_leaving = {**coalesced, "llama-b": PodObservation(pod="llama-b", deleting=True)}
    assert still_counted(lost, both_leaving) == []
    assert still_counted(lost, {"llama-c": coalesced["llama-c"]}) == []  # already gone


def test_a_warm_spare_lost_with_its_node_is_retired_and_refilled_in_its_own_workload() -> None:
    """A whole pool on one failed node: its spare's pod would hold the spare slot until taint eviction."""
    serving = [group(f"g{i}") for i in range(3)]
    spare = group("s1", role=GroupRole.SPARE).model_copy(update={"workload_name": "llama-spare"})
    replicas = {("Deployment", "llama"): 3, ("Deployment", "llama-spare"): 1}
    plan = plan_rebuild(
        [*serving, spare],
        [],
        unmatched_ids=[g.id for g in serving],
        replicas=replicas,
        pool_groups=[*serving, spare],
    )
    by_name = {s.name: [(x.step, x.replicas) for x in w.scales] for w in plan.workloads for s in w.scales[:1]}
    assert by_name["llama-spare"] == [("retire-lost-llama-spare", 0), ("rebuild-warm-floor-llama-spare", 1)]
    assert by_name["llama"] == [("retire-lost-llama", 0), ("replace-lost-llama", 3)]
    assert "s1-0" in next(w.retire_pods for w in plan.workloads if w.scales[0].name == "llama-spare")
    assert plan.expected_new == 3  # the ramp waits for routed replacements, not for the unrouted spare
    # A recovery planned before this rule (replaying its history) leaves the spare to taint eviction.
    before = plan_rebuild(
        [*serving, spare],
        [],
        [g.id for g in serving],
        replicas,
        pool_groups=[*serving, spare],
        refill_lost_spares=False,
    )
    assert [s.name for w in before.workloads for s in w.scales] == ["llama", "llama"]
