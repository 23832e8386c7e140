"""The DaemonSet controller and the node agents it runs, in-process (no servers): what it costs while
nothing changes, how it follows nodes, and where its pods stay when a node is lost."""

from __future__ import annotations

from typing import Any

import pytest

from sim.k8s import objects as o
from sim.k8s.controllers.daemonsets import DaemonSetController
from sim.scenario import load_scenario, shipped_scenarios
from sim.world import SimWorld

NS = "inference"
AGENT_NAMESPACES = ("gpu-operator", "kube-system")


def _world() -> SimWorld:
    return SimWorld(load_scenario(shipped_scenarios()["gpu-node-loss"]))


def _agents(world: SimWorld, node: str | None = None) -> list[dict[str, Any]]:
    return [
        p
        for ns in AGENT_NAMESPACES
        for p in world.pods(ns)
        if node is None or p["spec"].get("nodeName") == node
    ]


def test_every_gpu_node_runs_one_pod_of_each_agent_and_idle_passes_do_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = _world()
    agents = _agents(world)
    assert len(agents) == 12 and all(o.is_pod_ready(p) for p in agents)
    assert all(o.controller_ref(p)["kind"] == "DaemonSet" for p in agents)  # type: ignore[index]
    assert all(not any(c.get("resources", {}).get("limits") for c in p["spec"]["containers"]) for p in agents)
    syncs: list[str] = []
    real_sync = DaemonSetController._sync

    def counting(self: DaemonSetController, cp: Any, ds: dict[str, Any], nodes: list[Any]) -> None:
        syncs.append(o.name_of(ds))
        real_sync(self, cp, ds, nodes)

    monkeypatch.setattr(DaemonSetController, "_sync", counting)
    # A minute of ticks: leases renew, node heartbeats and pod statuses move; no DaemonSet work.
    for _ in range(12):
        world.clock.advance(5)
        world.control.reconcile()
    assert syncs == []
    # A node whose labels stop matching wakes the controller once, and loses its agents.
    world.store.mutate(
        "nodes", "", "gpu-node-3", lambda n: n["metadata"]["labels"].pop("nvidia.com/gpu.present")
    )
    world.control.reconcile()
    assert sorted(syncs) == [
        "node-problem-detector",
        "nvidia-dcgm-exporter",
        "nvidia-device-plugin-daemonset",
    ]
    world.control.settle()
    assert [p for p in _agents(world, "gpu-node-3") if not o.is_terminating(p)] == []
    (dcgm,) = [
        d for d in world.store.list("daemonsets", "gpu-operator") if o.name_of(d) == "nvidia-dcgm-exporter"
    ]
    assert dcgm["status"]["desiredNumberScheduled"] == 3


def test_a_settled_agent_pod_still_shows_its_crash_and_restart() -> None:
    world = _world()
    agent = _agents(world, "gpu-node-1")[0]
    name, namespace = o.name_of(agent), o.namespace_of(agent)
    world.control.reconcile()  # settled: up and ready, no longer re-synced each tick
    world.set_container_state(namespace, name, "crashed")
    world.control.reconcile()
    status = world.pod(namespace, name)["status"]["containerStatuses"][0]  # type: ignore[index]
    assert status["state"]["waiting"]["reason"] == "CrashLoopBackOff" and status["restartCount"] == 1
    world.clock.advance(world.scenario.timings.crash_loop_backoff_s + 3)
    world.control.reconcile()
    pod = world.pod(namespace, name)
    assert pod is not None and o.is_pod_ready(pod)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 1


def test_a_lost_node_keeps_its_agents_while_its_engines_are_evicted() -> None:
    world = _world()
    before = {o.uid_of(p) for p in _agents(world, "gpu-node-0")}
    engines = [p for p in world.pods(NS) if p["spec"]["nodeName"] == "gpu-node-0"]
    assert len(before) == 3 and engines
    world.lose_node("gpu-node-0")
    timings = world.scenario.timings
    world.clock.advance(timings.node_monitor_grace_s + 1)
    world.control.reconcile()
    world.clock.advance(timings.unreachable_toleration_s + 1)
    world.control.reconcile()
    still = [p for p in world.pods(NS) if p["spec"]["nodeName"] == "gpu-node-0"]
    assert all(o.is_terminating(p) for p in still)  # the engines' 300 s toleration ran out
    agents = _agents(world, "gpu-node-0")
    # The agents tolerate unreachable without a limit: the same pods, not terminating, not recreated.
    assert {o.uid_of(p) for p in agents} == before and not any(o.is_terminating(p) for p in agents)
    assert len(_agents(world)) == 12
