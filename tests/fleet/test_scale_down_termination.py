"""The planned scale-down's termination and verification questions, answered from one observation."""

from __future__ import annotations

from fleet.engine_metrics import EngineSnapshot
from fleet.observation import PodObservation, PoolObservation, WorkloadSelector
from fleet.pool import ReplicaGroup, WorkloadKind
from fleet.scale_down import (
    others_terminating,
    ready_without,
    serving_without,
    victim_pods,
    victims_by_workload,
    victims_present,
    workload_scale,
)
from fleet.victims import group_loads

from .fleets import group, snapshot

LWS = WorkloadKind.LEADER_WORKER_SET


def observe(
    groups: list[ReplicaGroup], workloads: list[WorkloadSelector], deleting: tuple[str, ...] = ()
) -> PoolObservation:
    pods = {p: PodObservation(pod=p, deleting=p in deleting) for g in groups for p in g.pods}
    return PoolObservation(snapshot=snapshot(groups), pods=pods, workloads=workloads, router_label="route")


def lws_groups(n: int) -> list[ReplicaGroup]:
    return [group(f"llama-lws-{i}", pods=2, kind=LWS) for i in range(n)]


def test_scaling_a_deployment_is_absolute_and_counts_only_the_victims_still_there() -> None:
    groups = [group(g) for g in ("a", "b", "c")]
    obs = observe(groups[1:], [WorkloadSelector(kind="Deployment", name="llama", replicas=3)])
    # "a" is already gone: scaling to 3 - 2 would remove a survivor as well.
    scale = workload_scale(obs, "llm", "Deployment", "llama", [groups[0], groups[1]])
    assert (scale.current, scale.replicas, scale.problem) == (3, 2, None)


def test_a_workload_that_is_gone_is_a_problem_not_a_scale() -> None:
    obs = observe([group("a")], [])
    scale = workload_scale(obs, "llm", "Deployment", "llama", [group("a")])
    assert scale.current is None
    assert scale.problem == "Deployment llm/llama of the victims is gone; nothing to scale"


def test_a_leader_worker_set_only_removes_its_highest_groups() -> None:
    groups = lws_groups(3)
    obs = observe(groups, [WorkloadSelector(kind=LWS.value, name="llama-lws", replicas=3)])
    highest = workload_scale(obs, "llm", LWS.value, "llama-lws", [groups[2]])
    assert (highest.replicas, highest.problem) == (2, None)
    lowest = workload_scale(obs, "llm", LWS.value, "llama-lws", [groups[0]])
    assert lowest.problem is not None
    assert "removes group indexes ['2']" in lowest.problem and "llama-lws-0" in lowest.problem


def test_victims_are_scaled_workload_by_workload_in_a_stable_order() -> None:
    a, lws0, b = group("a"), lws_groups(1)[0], group("b")
    grouped = victims_by_workload([lws0, b, a])
    assert list(grouped) == [("Deployment", "llama"), ("LeaderWorkerSet", "llama-lws")]
    assert [g.id for g in grouped[("Deployment", "llama")]] == ["b", "a"]
    assert victim_pods([lws0, a]) == ["llama-lws-0-0", "llama-lws-0-1", "a-0"]


def test_termination_waits_for_every_victim_and_names_other_pods_going() -> None:
    groups = [group(g) for g in ("a", "b", "c")]
    obs = observe(groups[1:], [], deleting=("b-0", "c-0"))
    assert victims_present(obs, ["a-0", "b-0"]) == ["b-0"]  # terminating still counts as present
    assert others_terminating(obs, ["a-0", "b-0"]) == ["c-0"]
    assert victims_present(obs, ["a-0"]) == []


def test_verification_expects_the_serving_groups_minus_the_victims_ready_and_routed() -> None:
    before = snapshot([group("a"), group("b"), group("c")])
    assert serving_without(before, {"a"}) == 2
    after = snapshot([group("b"), group("c", ready=False)])
    assert ready_without(after, {"a"}) == 1


def test_group_loads_come_from_each_leaders_scrape() -> None:
    loads = group_loads({"a": EngineSnapshot(running=3, waiting=2, kv_usage=0.4)})
    assert loads["a"].in_flight == 5 and loads["a"].kv_usage == 0.4
