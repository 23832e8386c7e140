"""Step 1: confirm the loss (lost vs slow-but-present), size it, and find the common cause."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from fleet.loss import LossEvent, Verdict, confirm_group, correlate, size_loss
from fleet.observation import EndpointConditions, EngineHealth, PodObservation
from fleet.pool import GroupRole, ReplicaGroup
from fleet.recovery import IncidentCause
from fleet.vocabulary import NVLINK_DOMAIN_LABEL

from .fleets import POOL, group, node, snapshot


def healthy(pod: str, node_name: str) -> PodObservation:
    return PodObservation(
        pod=pod,
        node=node_name,
        engine_health=EngineHealth.OK,
        engine_progressing=True,
        endpoint=EndpointConditions(pod=pod, ready=True, serving=True, terminating=False),
    )


def test_group_model_rejects_a_leader_outside_the_group() -> None:
    with pytest.raises(ValidationError, match="leader pod"):
        ReplicaGroup(id="g", model="m", revision="r", pods=("a",), leader_pod="b", workload_name="w")


def test_snapshot_lookups() -> None:
    snap = snapshot([group("g1", ("n1",)), group("s1", ("n2",), role=GroupRole.SPARE)])
    assert snap.group_of_pod("g1-0") is not None and snap.group_of_pod("g1-0").id == "g1"  # type: ignore[union-attr]
    assert [g.id for g in snap.serving] == ["g1"] and [g.id for g in snap.spares] == ["s1"]
    assert [g.id for g in snap.groups_on_node("n2")] == ["s1"]
    with pytest.raises(KeyError, match="no replica group 'zz'"):
        snap.group("zz")


def test_dead_node_loses_the_group_and_lists_dead_but_routed_endpoints() -> None:
    g = group("g1", ("n1",))
    nodes = [node("n1", ready=None)]
    obs = {"g1-0": healthy("g1-0", "n1").model_copy(update={"engine_health": EngineHealth.UNREACHABLE})}
    verdict = confirm_group(g, obs, nodes, routed_pods={"g1-0"})
    assert verdict.verdict is Verdict.LOST
    assert verdict.lost_pods == ("g1-0",)
    assert verdict.dead_but_routed == ("g1-0",)
    assert "node n1 is Unknown" in verdict.reason


def test_a_silent_node_whose_engine_answers_is_a_partition_not_a_loss() -> None:
    """A top-of-rack switch cut: the kubelet cannot reach the API server (Ready=Unknown, the node
    controller marks the pod not ready), the engine still answers. Nothing is lost: the replica
    serves, and the verdict says so instead of derouting it on the node's condition alone."""
    g = group("g1", ("n1",))
    obs = {"g1-0": healthy("g1-0", "n1").model_copy(update={"pod_ready": False})}
    verdict = confirm_group(g, obs, [node("n1", ready=None)], routed_pods={"g1-0"})
    assert verdict.verdict is Verdict.PRESENT, verdict.reason
    assert "node n1 unreachable from the API, still serving" in verdict.reason
    assert verdict.dead_but_routed == ()
    # The same node, but the engine does not answer (or is wedged): lost, as before.
    for update in ({"engine_health": EngineHealth.UNREACHABLE}, {"engine_progressing": False}):
        silent = {"g1-0": obs["g1-0"].model_copy(update=update)}
        assert confirm_group(g, silent, [node("n1", ready=None)], routed_pods={"g1-0"}).lost
    # A terminating pod on a silent node is lost whatever its engine says.
    going = {"g1-0": obs["g1-0"].model_copy(update={"deleting": True})}
    assert confirm_group(g, going, [node("n1", ready=None)]).lost


def test_one_lost_rank_loses_the_whole_multi_node_group() -> None:
    g = group("lws-0", ("n1", "n2"), pods=2, gpus_per_pod=8)
    obs = {
        "lws-0-0": healthy("lws-0-0", "n1"),
        "lws-0-1": healthy("lws-0-1", "n2").model_copy(update={"exists": False}),
    }
    verdict = confirm_group(g, obs, [node("n1"), node("n2")])
    assert verdict.lost
    assert verdict.lost_pods == ("lws-0-1",)
    assert "1 of 2 ranks lost, so the whole group is lost" in verdict.reason


def test_slow_but_present_replica_is_not_a_loss() -> None:
    g = group("g1", ("n1",))
    # Saturated: our own serving-ready gate holds it not-ready, but containers are up and the engine answers.
    obs = {"g1-0": healthy("g1-0", "n1").model_copy(update={"pod_ready": False})}
    verdict = confirm_group(g, obs, [node("n1")], routed_pods={"g1-0"})
    assert verdict.verdict is Verdict.PRESENT
    assert "slow-but-present, not a replica loss" in verdict.reason
    assert "serving-ready gate" in verdict.reason
    assert verdict.dead_but_routed == ()


@pytest.mark.parametrize(
    "update,expected",
    [
        ({"engine_health": EngineHealth.FAILING}, "engine dead"),
        ({"waiting_reason": "CrashLoopBackOff", "containers_ready": False}, "CrashLoopBackOff"),
        ({"terminated_reason": "OOMKilled", "containers_ready": False}, "OOMKilled"),
        ({"phase": "Failed", "status_reason": "Evicted"}, "phase Failed (Evicted)"),
        ({"deleting": True}, "terminating"),
        ({"engine_progressing": False}, "wedged"),
        ({"containers_ready": False}, "readiness probe failing"),
    ],
)
def test_each_kind_of_engine_death_is_a_loss(update: dict[str, object], expected: str) -> None:
    g = group("g1", ("n1",))
    verdict = confirm_group(g, {"g1-0": healthy("g1-0", "n1").model_copy(update=update)}, [node("n1")])
    assert verdict.lost and expected in verdict.reason


def test_publish_not_ready_slices_are_judged_by_serving() -> None:
    ep_dead_but_ready = EndpointConditions(pod="p", ready=True, serving=False, terminating=False)
    assert ep_dead_but_ready.routable(publish_not_ready=False)
    assert not ep_dead_but_ready.routable(publish_not_ready=True)
    assert EndpointConditions(pod="p").routable(True) and EndpointConditions(pod="p").routable(False)
    assert not EndpointConditions(pod="p", terminating=True).routable(True)


def test_lost_pod_still_ready_in_endpointslice_is_dead_but_routed() -> None:
    g = group("g1", ("n1",))
    obs = healthy("g1-0", "n1").model_copy(update={"engine_health": EngineHealth.FAILING})
    verdict = confirm_group(g, {"g1-0": obs}, [node("n1")], routed_pods=())
    assert verdict.dead_but_routed == ("g1-0",)


def test_size_loss_counts_groups_gpus_and_domains() -> None:
    snap = snapshot(
        [group("g1", ("n1",)), group("g2", ("n2",)), group("g3", ("n3",)), group("g4", ("n4",))],
        [node("n1", "nvl-a"), node("n2", "nvl-a"), node("n3", "nvl-b"), node("n4", "nvl-b")],
    )
    size = size_loss(snap, ["g1", "g2"])
    assert (size.groups_lost, size.serving_groups, size.fraction, size.gpus_lost) == (2, 4, 0.5, 8)
    assert size.nodes == ("n1", "n2")
    assert size.domains[NVLINK_DOMAIN_LABEL] == ("nvl-a",)
    assert "2 of 4 serving = 50%" in size.summary


def _fleet():  # type: ignore[no-untyped-def]
    return snapshot(
        [
            group("g1", ("n1",)),
            group("g2", ("n2",)),
            group("g3", ("n3",), revision="r2"),
            group("g4", ("n4",)),
        ],
        [
            node("n1", "nvl-a", "z1"),
            node("n2", "nvl-a", "z1"),
            node("n3", "nvl-b", "z2"),
            node("n4", "nvl-c", "z2"),
        ],
        target_revision="r2",
        rollout_in_progress=True,
    )


def test_single_loss() -> None:
    c = correlate([LossEvent(group_id="g4", revision="r1", nodes=("n4",), at=10)], _fleet(), window_s=60)
    assert c.cause is IncidentCause.SINGLE_LOSS and c.replace


def test_loss_of_the_revision_being_rolled_out_is_a_bad_rollout() -> None:
    events = [
        LossEvent(group_id="g3", revision="r2", nodes=("n3",), at=10),
        LossEvent(group_id="g4", revision="r1", nodes=("n4",), at=30),
    ]
    c = correlate(events, _fleet(), window_s=60)
    assert c.cause is IncidentCause.BAD_ROLLOUT
    assert c.revision == "r2" and not c.replace
    assert c.group_ids == ("g3", "g4")


def test_two_nodes_of_one_nvlink_domain_is_a_domain_loss() -> None:
    events = [
        LossEvent(group_id="g1", revision="r1", nodes=("n1",), at=10),
        LossEvent(group_id="g2", revision="r1", nodes=("n2",), at=20),
    ]
    c = correlate(events, _fleet(), window_s=60)
    assert c.cause is IncidentCause.DOMAIN_LOSS and c.domain == f"{NVLINK_DOMAIN_LABEL}=nvl-a"


def test_a_multi_node_group_lost_on_ready_nodes_is_a_single_loss_not_its_domain() -> None:
    """One rank OOM-killed takes its whole two-node group (a LeaderWorkerSet re-creates it): the nodes
    under it are Ready, so their shared NVLink domain did not fail. Both nodes NotReady is the domain."""
    two_node = group("g1", ("n1", "n2"), pods=2)
    ready = snapshot([two_node], [node("n1", "nvl-a"), node("n2", "nvl-a")])
    event = LossEvent(group_id="g1", revision="r1", nodes=("n1", "n2"), at=10)
    c = correlate([event], ready, window_s=60)
    assert c.cause is IncidentCause.SINGLE_LOSS, c.reason
    down = snapshot([two_node], [node("n1", "nvl-a", ready=False), node("n2", "nvl-a", ready=None)])
    c = correlate([event], down, window_s=60)
    assert c.cause is IncidentCause.DOMAIN_LOSS and c.domain == f"{NVLINK_DOMAIN_LABEL}=nvl-a", c.reason


def test_whole_zone_lost_is_a_domain_loss() -> None:
    snap = _fleet().model_copy(update={"target_revision": None, "rollout_in_progress": False})
    events = [
        LossEvent(group_id="g3", revision="r2", nodes=("n3",), at=10),
        LossEvent(group_id="g4", revision="r1", nodes=("n4",), at=20),
    ]
    c = correlate(events, snap, window_s=60)
    assert c.cause is IncidentCause.DOMAIN_LOSS and "zone z2" in c.reason


def test_unrelated_losses_within_the_window_are_one_correlated_incident() -> None:
    snap = _fleet().model_copy(update={"target_revision": None, "rollout_in_progress": False})
    events = [
        LossEvent(group_id="g1", revision="r1", nodes=("n1",), at=10),
        LossEvent(group_id="g4", revision="r1", nodes=("n4",), at=40),
        LossEvent(group_id="g2", revision="r1", nodes=("n2",), at=500),  # outside the window
    ]
    c = correlate(events, snap, window_s=60)
    assert c.cause is IncidentCause.CORRELATED_LOSS
    assert c.group_ids == ("g1", "g4")
    with pytest.raises(ValueError):
        correlate([], snap, window_s=60)


def test_pool_ref_key() -> None:
    assert POOL.key == "llm/llama"
