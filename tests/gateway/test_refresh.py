"""The control plane rebuilds on change: a watch event marks only the pools it touches, a read
recomputes only those, and the xDS snapshot renders only the pools whose hosts or policy moved.

The routing index is fed Kubernetes objects in their API JSON form (as the informers hand them
over); the control plane's policies live in the ledger's Postgres.
"""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from fleet.gateway import GatewayPolicy
from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE
from gateway.resources import ENDPOINT_TYPE, DataPlaneSettings
from gateway.run import ControlPlaneThread
from gateway.server import ControlPlane, build_snapshot
from gateway.store import GatewayStore
from gateway.world import SERVICE_NAME_LABEL, RoutingIndex, hosts_from
from ledger.store import make_engine

NS = "inference"
Obj = dict[str, Any]


def service(name: str, annotations: dict[str, str] | None = None) -> Obj:
    return {"metadata": {"namespace": NS, "name": name, "annotations": annotations or {}}}


def pod(name: str, routed: bool = True, phase: str = "Running") -> Obj:
    labels = {ROUTER_LABEL: ROUTER_LABEL_VALUE} if routed else {}
    return {"metadata": {"namespace": NS, "name": name, "labels": labels}, "status": {"phase": phase}}


def endpoint_slice(pool: str, pods: dict[str, bool], suffix: str = "a") -> Obj:
    """A slice of Service ``pool`` with an endpoint per pod (value: ready)."""
    return {
        "metadata": {"namespace": NS, "name": f"{pool}-{suffix}", "labels": {SERVICE_NAME_LABEL: pool}},
        "ports": [{"port": 8000}],
        "endpoints": [
            {
                "addresses": [f"10.0.{sum(map(ord, name)) % 250}.{len(name)}"],
                "conditions": {"ready": ready, "serving": ready},
                "targetRef": {"kind": "Pod", "name": name},
                "nodeName": f"node-{name}",
            }
            for name, ready in pods.items()
        ],
    }


def fleet(pools: int = 3, replicas: int = 2) -> RoutingIndex:
    index = RoutingIndex()
    for p in range(pools):
        name = f"pool{p}"
        index.on_event("services", "ADDED", service(name))
        names = [f"{name}-{r}" for r in range(replicas)]
        for n in names:
            index.on_event("pods", "ADDED", pod(n))
        index.on_event("endpointslices", "ADDED", endpoint_slice(name, dict.fromkeys(names, True)))
    return index


def test_an_event_in_one_pool_recomputes_only_that_pool() -> None:
    index = fleet()
    before = index()
    assert index.recomputed_pools == 3
    assert {p: len(h) for p, h in before.items()} == {f"{NS}/pool{i}": 2 for i in range(3)}

    index.on_event("pods", "MODIFIED", pod("pool1-0", routed=False))  # derouted
    assert index.dirty == {f"{NS}/pool1"}
    after = index()
    assert index.recomputed_pools == 4
    assert [h.pod for h in after[f"{NS}/pool1"]] == ["pool1-1"]
    for other in (f"{NS}/pool0", f"{NS}/pool2"):
        assert after[other] is before[other]  # untouched pools keep their very tuple

    index.on_event("endpointslices", "MODIFIED", endpoint_slice("pool2", {"pool2-0": True, "pool2-1": False}))
    assert index.dirty == {f"{NS}/pool2"}
    assert [h.pod for h in index()[f"{NS}/pool2"]] == ["pool2-0"]
    assert index.recomputed_pools == 5


def node(name: str, ready: str) -> Obj:
    return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}


def test_an_endpoint_made_not_ready_by_a_silent_kubelet_stays_a_host_until_it_terminates() -> None:
    """A partition: the node's kubelet stops posting status (Ready=Unknown) and the node controller
    marks its pods not ready, while the engines still serve. The host stays (Envoy's health check
    decides); a not-ready endpoint on a node that is Ready (its own readiness probe failing), or one
    that is terminating, does not."""
    index = fleet(pools=2)
    index()
    index.on_event("nodes", "MODIFIED", node("node-pool1-0", "True"))
    assert not index.dirty  # a Ready node changes nothing
    index.on_event("endpointslices", "MODIFIED", endpoint_slice("pool1", {"pool1-0": False, "pool1-1": True}))
    assert [h.pod for h in index()[f"{NS}/pool1"]] == ["pool1-1"]  # its own probe failed: out

    index.on_event("nodes", "MODIFIED", node("node-pool1-0", "Unknown"))
    assert index.dirty == {f"{NS}/pool1"}  # only the pool with an endpoint on that node
    assert [h.pod for h in index()[f"{NS}/pool1"]] == ["pool1-0", "pool1-1"]

    going = endpoint_slice("pool1", {"pool1-0": False, "pool1-1": True})
    going["endpoints"][0]["conditions"]["terminating"] = True
    index.on_event("endpointslices", "MODIFIED", going)
    assert [h.pod for h in index()[f"{NS}/pool1"]] == ["pool1-1"]  # evicted: out, silent node or not

    index.on_event("endpointslices", "MODIFIED", endpoint_slice("pool1", {"pool1-0": False, "pool1-1": True}))
    index.on_event(
        "nodes", "MODIFIED", node("node-pool1-0", "True")
    )  # the partition healed, probe still failing
    assert [h.pod for h in index()[f"{NS}/pool1"]] == ["pool1-1"]


def test_an_unchanged_world_rebuilds_nothing() -> None:
    index = fleet()
    first = index()
    version, recomputed = index.version, index.recomputed_pools
    assert index() is first
    # Events that cannot move a host: a routed pod's status, a Service's annotations.
    index.on_event("pods", "MODIFIED", pod("pool0-0", phase="Running"))
    index.on_event("services", "MODIFIED", service("pool0", {"note": "touched"}))
    assert index.generation > 0 and index.version == version and not index.dirty
    assert index() is first and index.recomputed_pools == recomputed


def test_a_burst_of_events_wakes_a_listener_once_until_the_next_read() -> None:
    index = fleet()
    index()
    woken: list[int] = []
    unsubscribe = index.subscribe(lambda: woken.append(1))
    index.on_event("pods", "MODIFIED", pod("pool0-0", routed=False))
    index.on_event("pods", "MODIFIED", pod("pool2-1", routed=False))
    assert len(woken) == 1 and index.dirty == {f"{NS}/pool0", f"{NS}/pool2"}
    index()
    index.on_event("services", "DELETED", service("pool1"))
    assert len(woken) == 2 and f"{NS}/pool1" not in index()
    unsubscribe()
    index.on_event("services", "ADDED", service("pool1"))
    assert len(woken) == 2 and index()[f"{NS}/pool1"]  # its slices were kept: back with its hosts


def test_the_per_pool_routing_set_agrees_with_the_full_rebuild_through_any_events() -> None:
    rng = random.Random(34)
    index = RoutingIndex()
    services: dict[str, Obj] = {}
    slices: dict[str, Obj] = {}
    pods: dict[str, Obj] = {}
    names = [f"pool{i}-{r}" for i in range(4) for r in range(3)]
    for _ in range(400):
        kind = rng.choice(["services", "endpointslices", "pods"])
        if kind == "services":
            obj, objs = service(f"pool{rng.randrange(4)}"), services
        elif kind == "pods":
            obj, objs = pod(rng.choice(names), routed=rng.random() < 0.7), pods
        else:
            p = rng.randrange(4)
            members = {
                n: rng.random() < 0.8 for n in names if n.startswith(f"pool{p}-") and rng.random() < 0.8
            }
            obj, objs = endpoint_slice(f"pool{p}", members, suffix=rng.choice("ab")), slices
        key = obj["metadata"]["name"]
        event = "DELETED" if key in objs and rng.random() < 0.3 else ("MODIFIED" if key in objs else "ADDED")
        if event == "DELETED":
            obj = objs.pop(key)
        else:
            objs[key] = obj
        index.on_event(kind, event, copy.deepcopy(obj))
        if rng.random() < 0.3:
            assert index() == hosts_from(services.values(), slices.values(), pods.values())
    assert index() == hosts_from(services.values(), slices.values(), pods.values())


# ------------------------------------------------------------------ the xDS snapshot, per pool


@pytest.fixture
def store(ledger_url: str) -> Iterator[GatewayStore]:
    s = GatewayStore(make_engine(ledger_url, pool_size=2))
    yield s
    s.engine.dispose()


def test_the_snapshot_renders_only_the_pools_whose_hosts_or_policy_moved(store: GatewayStore) -> None:
    index = fleet(pools=4)
    plane = ControlPlane(index, store)
    first = asyncio.run(plane.refresh())
    assert plane.pools_rendered == 4 and plane.snapshots_built == 1

    assert asyncio.run(plane.refresh()) is first  # nothing moved: nothing rendered, nothing built
    assert plane.pools_rendered == 4 and plane.snapshots_built == 1

    index.on_event("pods", "MODIFIED", pod("pool3-1", routed=False))
    second = asyncio.run(plane.refresh())
    assert plane.pools_rendered == 5 and plane.snapshots_built == 2
    assert second.versions[ENDPOINT_TYPE] != first.versions[ENDPOINT_TYPE]
    # The same snapshot, versions included, as rendering every pool afresh.
    assert second == build_snapshot(index(), store.all(), DataPlaneSettings())

    revision = store.put(f"{NS}/pool1", GatewayPolicy(weights={"pool1-0": 3.0, "pool1-1": 1.0}))
    third = asyncio.run(plane.refresh())
    assert plane.pools_rendered == 6 and plane.snapshots_built == 3
    assert all(v.startswith(f"p{revision}.") for v in third.versions.values())
    assert third == build_snapshot(index(), store.all(), DataPlaneSettings())


def test_a_refresh_that_failed_after_reading_the_routing_set_is_done_again(
    store: GatewayStore, ledger_url: str
) -> None:
    index = fleet(pools=2)
    plane = ControlPlane(index, store)
    asyncio.run(plane.refresh())
    index.on_event("pods", "MODIFIED", pod("pool0-0", routed=False))
    missing = make_url(ledger_url).set(database="no_such_database")
    plane.store = GatewayStore(make_engine(missing.render_as_string(hide_password=False), pool_size=1))
    with pytest.raises(OperationalError):  # Postgres refuses after the routing set was read
        asyncio.run(plane.refresh())
    plane.store.engine.dispose()
    plane.store = store
    snap = asyncio.run(plane.refresh())
    assert [str(e["endpoint"]["hostname"]) for e in lbs(snap.resources[ENDPOINT_TYPE][f"{NS}/pool0"])] == [
        "pool0-1"
    ]


def test_a_routing_change_wakes_the_running_plane_without_waiting_for_its_interval(ledger_url: str) -> None:
    index = fleet(pools=2)
    # The policy interval is long: only the routing index's wake-up can explain a prompt rebuild.
    plane = ControlPlaneThread(index, ledger_url, refresh_s=60.0).start()
    try:
        assert plane.plane is not None
        running = plane.plane
        wait_for(lambda: running.snapshot is not None and running.refreshes >= 1)
        built = running.snapshots_built
        pool0 = f"{NS}/pool0"

        def hosts() -> list[str]:
            snap = running.snapshot
            assert snap is not None
            return [str(e["endpoint"]["hostname"]) for e in lbs(snap.resources[ENDPOINT_TYPE][pool0])]

        assert hosts() == ["pool0-0", "pool0-1"]
        threading.Thread(
            target=index.on_event, args=("pods", "MODIFIED", pod("pool0-0", routed=False))
        ).start()
        wait_for(lambda: hosts() == ["pool0-1"], timeout_s=10.0)
        assert running.snapshots_built == built + 1
    finally:
        plane.stop()


def test_a_policy_write_wakes_the_running_plane_without_waiting_for_its_check(
    ledger_url: str, store: GatewayStore
) -> None:
    index = fleet(pools=2)
    # Both intervals are long: only Postgres's notification of the write can explain a prompt rebuild.
    plane = ControlPlaneThread(index, ledger_url, refresh_s=60.0, policy_check_s=60.0).start()
    try:
        assert plane.plane is not None
        running = plane.plane
        wait_for(lambda: running.snapshot is not None and running.refreshes >= 2)
        revision = store.put(f"{NS}/pool1", GatewayPolicy(weights={"pool1-0": 1.0, "pool1-1": 4.0}))

        def weights() -> dict[str, int]:
            snap = running.snapshot
            assert snap is not None
            assignment = snap.resources[ENDPOINT_TYPE][f"{NS}/pool1"]
            return {str(e["endpoint"]["hostname"]): int(e["load_balancing_weight"]) for e in lbs(assignment)}

        wait_for(
            lambda: running.snapshot is not None and weights()["pool1-1"] == 4 * weights()["pool1-0"], 10.0
        )
        snap = running.snapshot
        assert snap is not None and all(v.startswith(f"p{revision}.") for v in snap.versions.values())
    finally:
        plane.stop()


def lbs(assignment: dict[str, Any]) -> list[dict[str, Any]]:
    return [lb for group in assignment["endpoints"] for lb in group["lb_endpoints"]]


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.02)
