"""The shipped ``fleet-512`` scenario: a real fleet's size and shape, and the same shape at smaller sizes."""

from __future__ import annotations

from collections import Counter

import pytest

from sim.k8s.manifests import build_nodes
from sim.scenario import Scenario, ScenarioError, parse_scenario, scaled_scenario, shipped_scenarios

RACK = "topology.kubernetes.io/rack"
ZONE = "topology.kubernetes.io/zone"
NVLINK = "fleetmend.io/nvlink-domain"


def _gpus_asked(scenario: Scenario) -> int:
    total = 0
    for workload in scenario.workloads:
        model = scenario.model(workload.model)
        total += (workload.replicas + workload.warm_spares) * model.gpus_per_replica
    return total


def test_fleet_512_is_512_nodes_of_8_gpus_in_32_racks_of_16_over_two_zones() -> None:
    scenario = parse_scenario_file("fleet-512")
    nodes = build_nodes(scenario)
    assert len(nodes) == 512
    assert {n["status"]["capacity"]["nvidia.com/gpu"] for n in nodes} == {"8"}
    racks = Counter(n["metadata"]["labels"][RACK] for n in nodes)
    assert len(racks) == 32 and set(racks.values()) == {16}
    # A rack is 16 consecutive nodes, wholly in one zone; the zones hold 16 racks each.
    zone_of_rack = {n["metadata"]["labels"][RACK]: n["metadata"]["labels"][ZONE] for n in nodes}
    assert all(zone_of_rack[n["metadata"]["labels"][RACK]] == n["metadata"]["labels"][ZONE] for n in nodes)
    assert Counter(zone_of_rack.values()) == {"zone-a": 16, "zone-b": 16}
    assert [n["metadata"]["name"] for n in nodes[:17:16]] == ["gpu-node-000", "gpu-node-016"]
    assert nodes[0]["metadata"]["labels"][RACK] != nodes[16]["metadata"]["labels"][RACK]
    domains = Counter(n["metadata"]["labels"][NVLINK] for n in nodes)
    assert len(domains) == 256 and set(domains.values()) == {2}


def test_fleet_512_has_128_pools_of_mixed_tensor_parallelism_with_multi_node_groups_and_room() -> None:
    scenario = parse_scenario_file("fleet-512")
    assert len(scenario.workloads) == 128
    tp = Counter(
        (w.kind, scenario.model(w.model).gpus_per_pod, scenario.model(w.model).pods_per_replica)
        for w in scenario.workloads
    )
    assert {size for _, size, _ in tp} == {1, 2, 4, 8}
    multi_node = [w for w in scenario.workloads if w.kind == "LeaderWorkerSet"]
    assert multi_node and all(scenario.model(w.model).pods_per_replica == 2 for w in multi_node)
    assert all(w.topology_key == NVLINK for w in multi_node)
    deployments = [w for w in scenario.workloads if w.kind == "Deployment"]
    assert deployments and all(w.warm_spares >= 1 for w in deployments)
    # Every pool serves a model of its own, so load can be sent to one pool by its model's name.
    served = [scenario.model(w.model).served_name for w in scenario.workloads]
    assert len(set(served)) == len(served) == 128
    # 448 of 512 nodes' GPUs asked for: 64 nodes' worth free for recoveries.
    assert _gpus_asked(scenario) == 448 * 8
    assert scenario.scheduler.scoring == "MostAllocated"
    assert not scenario.faults and "traffic" not in scenario.load  # no load starts by itself


@pytest.mark.parametrize("nodes", [64, 128, 256])
def test_the_same_shape_scales_to_smaller_fleets(nodes: int) -> None:
    scenario = scaled_scenario("fleet-512", nodes)
    built = build_nodes(scenario)
    assert len(built) == nodes
    racks = Counter(n["metadata"]["labels"][RACK] for n in built)
    assert len(racks) == nodes // 16 and set(racks.values()) == {16}
    assert {n["metadata"]["labels"][ZONE] for n in built} == {"zone-a", "zone-b"}
    assert len(scenario.workloads) == nodes // 4
    assert _gpus_asked(scenario) == nodes * 8 * 7 // 8
    kinds = Counter(w.kind for w in scenario.workloads)
    assert kinds["LeaderWorkerSet"] == nodes // 64
    assert scenario.name == f"fleet-512-at-{nodes}"


def test_a_size_the_shape_does_not_divide_into_is_refused_with_sizes_that_do() -> None:
    with pytest.raises(
        ScenarioError, match=r"pool_sets\.0\.count \(8\) does not scale to 100 nodes.*\(e\.g\. 64, 128, 256\)"
    ):
        scaled_scenario("fleet-512", 100)


def test_at_64_nodes_every_pod_is_placed_and_whole_nodes_stay_free() -> None:
    from sim.k8s import objects as o
    from sim.world import SimWorld

    scenario = scaled_scenario("fleet-512", 64)
    world = SimWorld(scenario)
    gpu_pods = [p for p in world.pods() if o.pod_gpus(p)]
    assert gpu_pods and all(p["spec"].get("nodeName") and p["status"]["phase"] == "Running" for p in gpu_pods)
    used = Counter(p["spec"]["nodeName"] for p in gpu_pods)
    assert len(world.nodes()) - len(used) == 8  # bin-packed: the free GPUs are whole nodes
    # Each multi-node group sits in one NVLink domain of its own.
    domain_of = {o.name_of(n): o.labels(n)[NVLINK] for n in world.nodes()}
    groups: dict[str, set[str]] = {}
    for pod in gpu_pods:
        key = o.labels(pod).get("leaderworkerset.sigs.k8s.io/group-key")
        if key:
            groups.setdefault(key, set()).add(domain_of[pod["spec"]["nodeName"]])
    assert len(groups) == 2 and all(len(d) == 1 for d in groups.values())
    assert len(set.union(*groups.values())) == 2


def test_a_pool_set_naming_an_unknown_model_names_the_field() -> None:
    document = {
        "name": "bad",
        "nodes": [{"prefix": "n", "count": 1, "gpus": 8}],
        "models": [
            {"name": "m", "served_name": "m", "gpus_per_pod": 1, "revisions": [{"name": "r1", "image": "i"}]}
        ],
        "pool_sets": [{"prefix": "p", "count": 2, "model": "nope", "replicas": 1}],
    }
    with pytest.raises(ScenarioError, match=r"pool_sets\.0\.model: unknown model 'nope'"):
        parse_scenario(document)


def parse_scenario_file(name: str) -> Scenario:
    from sim.scenario import load_scenario

    return load_scenario(shipped_scenarios()[name])
