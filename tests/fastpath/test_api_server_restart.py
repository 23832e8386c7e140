"""The API server restarts mid-watch: what a client sees, and the fast path misses no loss meanwhile.

The simulated API server restarts as a real one does (``POST /sim/v1/api-server/restart``): open
watches break mid-stream, connections are refused for a few seconds, then it serves again from a
fresh watch cache, so a watch resuming from an old resourceVersion gets 410. The world keeps
changing behind it, as a cluster does behind one API server a client cannot reach. The informers
re-list when it is back and report what changed meanwhile; the fast path reports a node lost
while it could not watch.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from kubernetes import client, config, watch

from fleet.vocabulary import MODEL_LABEL, ROUTER_LABEL
from gateway.world import RoutingWatch
from kube.client import kube_apis
from kube.informer import BACKOFF_MAX_S, Informer
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from worker.config import load_settings
from worker.devstack.sim_wiring import settings_for_running_sim
from worker.fastpath.service import FAST_PATH_ALERT, FastPath
from worker.intake.intake import Delivery
from worker.intake.routing import RoutedReport
from worker.intake.topology import PoolTopology

pytestmark = pytest.mark.timeout(90)

NS = "inference"
DOWN_S = 3.0
# Once the API server is back, an informer is back within its longest back-off, then one list.
BACK_WITHIN_S = BACKOFF_MAX_S + 5.0


def _core(sim: RunningSim) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(sim.kubeconfig), context="sim"))


async def _api_server(sim: RunningSim) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
        r = await http.get("/sim/v1/api-server")
        r.raise_for_status()
        return dict(r.json())


async def _restart(sim: RunningSim, down_s: float = DOWN_S) -> None:
    async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
        r = await http.post("/sim/v1/api-server/restart", json={"down_s": down_s})
        assert r.status_code == 202, r.text
        assert r.json()["serving"] is False, r.text  # down from the answer on


async def _until(condition: Callable[[], Any], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


async def test_a_restart_breaks_open_watches_refuses_then_old_resource_versions_are_gone_and_a_relist_misses_nothing() -> (
    None
):
    sim = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0, serving=False)
    try:
        core = _core(sim)
        listed = json.loads(core.list_namespaced_pod(NS, _preload_content=False).data)
        old_rv = listed["metadata"]["resourceVersion"]
        routed = sorted(
            p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=ROUTER_LABEL).items
        )
        events: list[tuple[str, str]] = []
        pods = Informer(
            "pods",
            core.list_pod_for_all_namespaces,
            lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
            label_selector=MODEL_LABEL,
        )
        raw_watch: list[str] = []

        def watch_raw() -> None:  # a plain watch: how it ends is what the client sees
            try:
                for _ in watch.Watch().stream(core.list_node, resource_version=old_rv, timeout_seconds=60):
                    pass
                raw_watch.append("ended cleanly")
            except Exception as err:
                raw_watch.append(type(err).__name__)

        halt = threading.Event()
        threading.Thread(target=pods.run, args=(halt,), daemon=True).start()
        threading.Thread(target=watch_raw, daemon=True).start()
        try:
            await _until(lambda: pods.lists == 1, "the informer listed", 20)
            await _until(lambda: _opened(sim, 2), "both watches open", 20)
            events.clear()

            await _restart(sim)
            await _until(lambda: raw_watch, "the open watch ended", 10)
            assert raw_watch == ["ProtocolError"], raw_watch  # broken mid-stream, not a clean end
            assert await asyncio.to_thread(_refused, sim.kube_port)  # connection refused while down
            # Meanwhile the cluster changes behind it (another API server, the controllers): a routed
            # pod goes for good.
            assert sim.world.store.remove("pods", NS, routed[0]) is not None
            assert not (await _api_server(sim))["serving"]

            await _until(lambda: _serving(sim), "the API server is back", DOWN_S + 10)
            state = await _api_server(sim)
            assert state["restarts"] == 1 and state["watch_cache_starts_at"] > int(old_rv), state
            with pytest.raises(client.exceptions.ApiException) as gone:
                for _ in watch.Watch().stream(core.list_node, resource_version=old_rv, timeout_seconds=5):
                    pass
            assert gone.value.status == 410 and "too old resource version" in str(gone.value.reason)

            # The informer was refused while the server was down, re-listed once it was back, and its
            # diff reports the pod that went while it could not watch.
            await _until(
                lambda: ("DELETED", routed[0]) in events, "the informer reports the lost pod", BACK_WITHIN_S
            )
            assert pods.relists_after_error >= 1 and f"{NS}/{routed[0]}" not in pods.cache
            assert int(str(pods.resource_version)) >= state["watch_cache_starts_at"]
        finally:
            halt.set()
            pods.stop()
    finally:
        sim.stop()


async def _opened(sim: RunningSim, count: int) -> bool:
    return int((await _api_server(sim))["open_watches"]) >= count


async def _serving(sim: RunningSim) -> bool:
    return bool((await _api_server(sim))["serving"])


async def test_a_node_lost_while_the_api_server_is_down_is_reported_by_the_fast_path_once_it_is_back() -> (
    None
):
    """The fast path leads, watches and has seen the pool; the API server restarts; while it refuses
    connections a GPU node serving the pool dies (its kubelet goes silent, the node controller marks
    it Ready=Unknown). Nothing can be watched meanwhile (no engines answer /health in this sim: only
    the watches can tell). Once the server is back the informers re-list, and the fast path reports
    the loss to the pool's incident, still the leader."""
    sim = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0, serving=False)
    try:
        settings = load_settings(**settings_for_running_sim(sim), fastpath_lease_namespace=NS)
        delivered: list[RoutedReport] = []

        async def deliver(reports: list[RoutedReport]) -> list[Delivery | None]:
            delivered.extend(reports)
            return [None] * len(reports)

        fast = FastPath(
            settings, deliver, PoolTopology.from_settings(settings), identity="fastpath-under-test"
        )
        core = _core(sim)
        routed = core.list_namespaced_pod(NS, label_selector=ROUTER_LABEL).items
        node = str(routed[0].spec.node_name)
        stop = asyncio.Event()
        running = asyncio.create_task(fast.run(stop))
        try:
            await _until(
                lambda: (
                    fast.elector.leading and len(fast.informers) == 3 and all(i.lists for i in fast.informers)
                ),
                "the fast path leads and has listed",
                20,
            )
            await _until(lambda: _opened(sim, 3), "its three watches are open", 20)

            await _restart(sim)
            async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
                r = await http.post(f"/sim/v1/nodes/{node}/lose")
                assert r.status_code == 202, r.text

            def not_ready() -> bool:
                found = sim.world.store.find("nodes", "", node) or {}
                conditions = (found.get("status") or {}).get("conditions") or []
                return any(c["type"] == "Ready" and c["status"] != "True" for c in conditions)

            await _until(not_ready, f"{node} is NotReady in the cluster", DOWN_S)
            assert not (await _api_server(sim))["serving"]  # the loss happened while the server was down

            async def back_with_nothing_seen_while_down() -> bool:
                seen = list(delivered)  # before asking: if it is still down then, it was down for these
                if await _serving(sim):
                    return True
                assert seen == []  # nothing can be seen while it is down
                return False

            await _until(back_with_nothing_seen_while_down, "the API server is back", DOWN_S + 10)
            back = time.monotonic()

            await _until(lambda: delivered, "the fast path reports the loss", BACK_WITHIN_S)
            print(f"API server back -> loss reported: {time.monotonic() - back:.2f} s")
        finally:
            stop.set()
            await asyncio.wait_for(running, timeout=15)
    finally:
        sim.stop()
    on_node = {f"pod:{NS}/{p.metadata.name}" for p in routed if p.spec.node_name == node}
    losses = [d for d in fast.detections if d.loss]
    assert losses and all(d.entity in on_node | {f"node:{node}"} for d in losses), fast.detections
    reports = [r.report for r in delivered]
    assert all(r.alert_name == FAST_PATH_ALERT and r.source == "fastpath" for r in reports), reports
    assert all(r.pool.namespace == NS and (r.node == node or r.pod) for r in reports), reports
    assert any(i.relists_after_error >= 1 for i in fast.informers), [
        (i.name, i.lists, i.relists_after_error) for i in fast.informers
    ]
    assert fast.elector.transitions_won == 1  # it kept the Lease through the outage


async def test_the_gateways_routing_set_drops_a_pod_derouted_while_the_api_server_was_down() -> None:
    """The gateway control plane's routing set comes from the same informers: a pod whose router
    label went while the API server was down leaves Envoy's hosts once the server is back."""
    sim = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0, serving=False)
    try:
        settings = load_settings(**settings_for_running_sim(sim))
        routing = RoutingWatch(kube_apis(settings)).start()
        try:

            def hosts() -> set[str]:
                return {h.pod for pool in routing().values() for h in pool}

            await _until(lambda: hosts(), "the routing set has hosts", 20)
            pod = sorted(hosts())[0]
            await _until(lambda: _opened(sim, 3), "its three watches are open", 20)
            await _restart(sim)

            def deroute(obj: dict[str, Any]) -> None:
                obj["metadata"]["labels"].pop(ROUTER_LABEL)

            assert sim.world.store.mutate("pods", NS, pod, deroute) is not None
            assert pod in hosts()  # nothing can be seen while the server is down
            await _until(lambda: _serving(sim), "the API server is back", DOWN_S + 10)
            await _until(lambda: pod not in hosts(), f"{pod} leaves the routing set", BACK_WITHIN_S)
            await _until(
                lambda: all(i.relists_after_error >= 1 for i in routing.informers),
                "all three gateway informers re-listed",
                BACK_WITHIN_S,
            )
        finally:
            routing.stop()
    finally:
        sim.stop()
