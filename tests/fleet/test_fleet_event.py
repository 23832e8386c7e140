"""fleet.fleet_event: two or more nodes of one failure domain, in two or more pools, are one cause."""

from __future__ import annotations

from fleet.fleet_event import AttributeTally, NodeAttribute, NodeLoss, common_cause, fleet_event_workflow_id
from fleet.incident import PoolRef

RACK = "topology.kubernetes.io/rack"


def loss(node: str, *pools: str, at: float = 100.0) -> NodeLoss:
    return NodeLoss(
        node=node,
        pools=[PoolRef(namespace="inference", service=p) for p in pools],
        evidence="Ready=Unknown",
        at=at,
    )


def test_a_rack_taking_several_pools_is_one_common_cause_named_with_its_pools() -> None:
    cause = common_cause(
        RACK, "rack-03", [loss("n1", "a", "b"), loss("n2", "c", at=101.5), loss("n3", "a")], 5.0
    )
    assert cause.common
    assert cause.nodes == ["n1", "n2", "n3"] and cause.pools == ["inference/a", "inference/b", "inference/c"]
    assert (
        "common cause: topology.kubernetes.io/rack=rack-03 lost 3 nodes within 1.5 s, hitting 3 pools"
        in cause.summary
    )


def test_one_node_or_one_pool_is_not_a_fleet_event() -> None:
    assert not common_cause(RACK, "rack-03", [loss("n1", "a", "b")], 5.0).common
    single_pool = common_cause(RACK, "rack-03", [loss("n1", "a"), loss("n2", "a")], 5.0)
    assert not single_pool.common and "no common cause across pools" in single_pool.summary


def test_one_event_per_domain() -> None:
    assert fleet_event_workflow_id(RACK, "rack-03") == "fleet-event/topology.kubernetes.io/rack/rack-03"


def test_a_zone_event_stays_quiet_when_one_rack_holds_every_loss() -> None:
    zone = "topology.kubernetes.io/zone"
    in_rack = [
        loss("n1", "a").model_copy(update={"domains": {RACK: "r1", zone: "z"}}),
        loss("n2", "b").model_copy(update={"domains": {RACK: "r1", zone: "z"}}),
    ]
    quiet = common_cause(zone, "z", in_rack, 5.0, narrower=[RACK])
    assert (
        not quiet.common
        and "topology.kubernetes.io/rack=r1: that domain's event names the cause" in quiet.summary
    )
    two_racks = [*in_rack, loss("n3", "c").model_copy(update={"domains": {RACK: "r2", zone: "z"}})]
    assert common_cause(zone, "z", two_racks, 5.0, narrower=[RACK]).common


DRIVER = "nvidia.com/cuda.driver-version.full"
ZONE = "topology.kubernetes.io/zone"
TOPOLOGY = [RACK, ZONE]


def on_driver(
    node: str, pool: str, rack: str, zone: str, holding: int, carrying: int = 512, down_elsewhere: int = 0
) -> NodeLoss:
    share = NodeAttribute(
        value="570.86.15",
        holding=holding,
        carrying=carrying,
        down_holding=2,
        down_carrying=2 + down_elsewhere,
    )
    return loss(node, pool).model_copy(
        update={"domains": {RACK: rack, ZONE: zone}, "attributes": {DRIVER: share}}
    )


def test_a_driver_shared_by_losses_across_racks_and_by_part_of_the_fleet_is_a_suspected_cause() -> None:
    losses = [on_driver("n1", "a", "r1", "za", 128), on_driver("n2", "b", "r2", "zb", 128)]
    cause = common_cause(DRIVER, "570.86.15", losses, 5.0, narrower=TOPOLOGY)
    assert cause.common and cause.suspected, cause
    assert cause.summary.startswith(f"suspected node-level cause: {DRIVER}=570.86.15 on all 2 nodes"), cause
    assert "topology.kubernetes.io/rack r1/r2" in cause.summary and "128 of the fleet's 512" in cause.summary


def test_a_burst_that_hits_every_driver_names_none() -> None:
    """Unrelated losses hit each driver in proportion: a node down elsewhere on another driver."""
    losses = [on_driver("n1", "a", "r1", "za", 128, down_elsewhere=1), on_driver("n2", "b", "r2", "zb", 128)]
    cause = common_cause(DRIVER, "570.86.15", losses, 5.0, narrower=TOPOLOGY)
    assert not cause.common and "1 of the 3 node(s) down" in cause.summary, cause


def test_a_driver_every_node_runs_is_no_evidence() -> None:
    losses = [on_driver("n1", "a", "r1", "za", 512), on_driver("n2", "b", "r2", "zb", 512)]
    cause = common_cause(DRIVER, "570.86.15", losses, 5.0, narrower=TOPOLOGY)
    assert not cause.common and "shared by all, no evidence" in cause.summary, cause


def test_a_driver_whose_losses_lie_in_one_rack_leaves_the_cause_to_the_racks_event() -> None:
    losses = [on_driver("n1", "a", "r1", "za", 128), on_driver("n2", "b", "r1", "za", 128)]
    cause = common_cause(DRIVER, "570.86.15", losses, 5.0, narrower=TOPOLOGY)
    assert not cause.common and f"every loss is in {RACK}=r1" in cause.summary, cause
    # A topology event is a fact, not a suspect.
    assert not common_cause(RACK, "r1", [loss("n1", "a"), loss("n2", "b")], 5.0).suspected


def test_the_tally_counts_each_nodes_attributes_from_its_events_and_forgets_a_deleted_node() -> None:
    tally = AttributeTally([DRIVER])
    tally.update("n1", {DRIVER: "570", RACK: "r1"})
    tally.update("n2", {DRIVER: "550"})
    tally.update("n3", {DRIVER: "550"})
    tally.update("cpu-1", {RACK: "r1"})  # no driver label: not counted
    assert tally.attributes("n1") == {DRIVER: NodeAttribute(value="570", holding=1, carrying=3)}
    tally.update("n2", {DRIVER: "570"}, down=True)  # upgraded, and down now
    assert tally.attributes("n1")[DRIVER] == NodeAttribute(
        value="570", holding=2, carrying=3, down_holding=1, down_carrying=1
    )
    tally.update("n3", {DRIVER: "550"}, down=True)
    assert tally.attributes("n1")[DRIVER].down_carrying == 2
    tally.update("n3", None)  # deleted
    tally.update("n2", {DRIVER: "570"})  # Ready again
    assert tally.attributes("n2") == {DRIVER: NodeAttribute(value="570", holding=2, carrying=2)}
    assert tally.attributes("n3") == {} and tally.attributes("cpu-1") == {}
