"""An idle simulated fleet costs what happens in it, not its size: controllers run on changes and on
their own timers, the store finds objects by label and owner, and engines answer health checks
without the HTTP framework (the same answers, over kept-alive connections)."""

from __future__ import annotations

import asyncio
import socket

from sim.clock import SimClock
from sim.k8s import objects as o
from sim.k8s.store import ObjectStore
from sim.scenario import load_scenario, shipped_scenarios
from sim.world import SimWorld
from tests.sim.serving_fixtures import NAMESPACE, running_serving, scenario


def _world() -> SimWorld:
    return SimWorld(load_scenario(shipped_scenarios()["gpu-node-loss"]))


def test_an_idle_cluster_runs_no_controller_until_a_timer_comes_due() -> None:
    world = _world()
    control = world.control
    control.reconcile()
    # Settled: the only timer left is the node leases' renewal, 10 s on.
    assert world.clock.now() < control.next_due() <= world.clock.now() + 10
    assert control.reconcile_due() is False
    world.lose_node("gpu-node-0")
    control.reconcile()
    lost_at = control.lost_nodes["gpu-node-0"]
    grace = world.scenario.timings.node_monitor_grace_s
    assert control.next_due() <= lost_at + grace
    world.clock.advance(grace + 0.5)
    assert control.reconcile_due() is True  # the node lifecycle's timer, without a whole pass
    node = world.store.get("nodes", "", "gpu-node-0")
    assert o.condition_status(node, "Ready") == "Unknown"


def test_a_crashed_container_restarts_and_turns_ready_on_the_kubelets_timers() -> None:
    world = _world()
    control = world.control
    pod = world.pods(label_selector="fleetmend.io/role=serving")[0]
    name = pod["metadata"]["name"]
    world.set_container_state(NAMESPACE, name, "crashed")
    control.reconcile()
    crashed = world.pod(NAMESPACE, name)
    assert crashed is not None and not o.is_pod_ready(crashed)
    runtime = control.runtime(NAMESPACE, name)
    assert runtime is not None and runtime.crashed_at is not None
    restart_at = runtime.crashed_at + world.scenario.timings.crash_loop_backoff_s
    assert control.next_due() <= restart_at
    world.clock.advance(restart_at - world.clock.now() + 0.01)
    assert control.reconcile_due() is True
    runtime = control.runtime(NAMESPACE, name)
    assert runtime is not None and runtime.started_at is not None
    ready_at = runtime.extra["ready_at"]
    restarted = world.pod(NAMESPACE, name)
    assert restarted is not None and not o.is_pod_ready(restarted)  # loading its weights
    assert control.next_due() <= ready_at
    world.clock.advance(ready_at - world.clock.now() + 0.01)
    control.reconcile_due()
    ready = world.pod(NAMESPACE, name)
    assert ready is not None and o.is_pod_ready(ready) and o.restart_count(ready) == 1


def test_the_store_finds_objects_by_label_and_owner_as_they_change() -> None:
    store = ObjectStore(SimClock())

    def pod(name: str, labels: dict[str, str], owner: str | None = None) -> None:
        meta: dict[str, object] = {"name": name, "namespace": "ns", "labels": labels}
        if owner:
            meta["ownerReferences"] = [{"kind": "ReplicaSet", "name": "rs", "uid": owner, "controller": True}]
        store.create("pods", {"metadata": meta, "spec": {}})

    def names(objects: list[dict[str, object]]) -> list[str]:
        return [o.name_of(obj) for obj in objects]

    pod("b", {"app": "x"}, owner="rs-1")
    pod("a", {"app": "x", "tier": "1"}, owner="rs-1")
    pod("c", {"app": "y"})
    assert names(store.select("pods", "ns", {"app": "x"})) == ["a", "b"]
    assert names(store.select("pods", "other", {"app": "x"})) == []
    assert names(store.list_view("pods", "ns", "app=x,tier==1")) == ["a"]
    assert names(store.owned_by("pods", "rs-1")) == ["a", "b"]

    def relabel(obj: dict[str, object]) -> None:
        obj["metadata"]["labels"] = {"app": "y"}  # type: ignore[index]
        obj["metadata"]["ownerReferences"] = []  # type: ignore[index]

    store.mutate("pods", "ns", "b", relabel)
    assert names(store.select("pods", "ns", {"app": "x"})) == ["a"]
    assert names(store.select("pods", "ns", {"app": "y"})) == ["b", "c"]
    assert names(store.owned_by("pods", "rs-1")) == ["a"]
    store.remove("pods", "ns", "a")
    assert store.select("pods", "ns", {"app": "x"}) == [] and store.owned_by("pods", "rs-1") == []
    assert names(store.list_view("pods", "ns", "app=y")) == ["b", "c"]
    assert names(store.list_view("pods", "ns", "app!=y")) == []


async def test_health_checks_are_answered_on_a_kept_alive_connection_until_the_engine_dies() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        host, port = sim.pod_url(pod).removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), family=socket.AF_INET)
        try:
            # Two checks pipelined, as one kept-alive connection carries them.
            writer.write(
                b"GET /health HTTP/1.1\r\nHost: e\r\nUser-Agent: Envoy/HC\r\n\r\n"
                b"HEAD /health HTTP/1.1\r\nHost: e\r\nX-Request-Id: hc-2\r\n\r\n"
            )
            first = await reader.readuntil(b"\r\n\r\n")
            second = await reader.readuntil(b"\r\n\r\n")
            assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 0" in first
            assert second.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-request-id: hc-2" in second
            engine = sim.layer.supervisor.get(f"{NAMESPACE}/{pod}")
            assert engine is not None
            engine.kill("test: the engine core died", sim.world.clock.now())
            writer.write(b"GET /health HTTP/1.1\r\nHost: e\r\nUser-Agent: Envoy/HC\r\n\r\n")
            dead = await reader.readuntil(b"\r\n\r\n")
            status = engine.health_status()
            assert status != 200 and dead.startswith(b"HTTP/1.1 %d " % status)
            # The scrape on the same connection still answers (the server lingers until the watchdog).
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: e\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            body = await reader.readexactly(length)
            assert head.startswith(b"HTTP/1.1 200 OK") and b"vllm:num_requests_running" in body
        finally:
            writer.close()
        served = sim.layer.engine_servers.served_to
        assert served[("/health", "Envoy/HC")] >= 2 and served[("/metrics", "")] >= 1


def test_the_store_finds_a_nodes_pods_by_index_as_they_are_bound_moved_and_removed() -> None:
    """``spec.nodeName=<node>`` reads one node's pods from an index (the taint manager asks it for every
    tainted node each pass: 200 lost nodes x 2,808 pods a pass at 512 nodes before the index)."""
    store = ObjectStore(SimClock())
    for name, node in (("a", "n1"), ("b", "n1"), ("c", "n2"), ("d", "")):
        store.create("pods", {"metadata": {"name": name, "namespace": "ns"}, "spec": {"nodeName": node}})

    def names(selector: str) -> list[str]:
        return [o.name_of(p) for p in store.list_view("pods", field_selector=selector)]

    assert names("spec.nodeName=n1") == ["a", "b"] and names("spec.nodeName==n2") == ["c"]
    assert names("spec.nodeName=") == ["d"]  # unscheduled: no index entry, read the slow way
    assert names("spec.nodeName!=n1") == ["c", "d"]

    def bind(obj: dict[str, object]) -> None:
        obj["spec"] = {"nodeName": "n2"}

    store.mutate("pods", "ns", "d", bind)
    store.mutate("pods", "ns", "a", bind)
    assert names("spec.nodeName=n1") == ["b"] and names("spec.nodeName=n2") == ["a", "c", "d"]
    store.remove("pods", "ns", "c")
    assert names("spec.nodeName=n2") == ["a", "d"] and names("spec.nodeName=n3") == []
