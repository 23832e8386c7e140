"""fleet.fleet_event: two or more nodes of one failure domain, in two or more pools, are one cause."""

from __future__ import annotations

from fleet.fleet_event import NodeLoss, common_cause, fleet_event_workflow_id
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
