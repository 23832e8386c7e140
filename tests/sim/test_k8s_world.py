"""The hooks the serving layer drives (container deaths, readiness, watches), garbage collection,
and API timeouts that leave the caller not knowing whether the change happened."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import urllib3
from kubernetes import watch
from kubernetes.client.exceptions import NotFoundException

from sim.k8s.store import WatchEvent
from tests.sim.support import Kube, assert_valid_objects, wait_for

NS = "inference"


def first_serving(kube: Kube) -> Any:
    return kube.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=serving").items[0]


def test_an_oom_killed_engine_shows_restart_count_crash_loop_and_comes_back(kube: Kube) -> None:
    name = first_serving(kube).metadata.name
    since = kube.core.list_namespaced_pod(NS).metadata.resource_version
    kube.sim.world.set_container_state(NS, name, "oomkilled")
    # The back-off lasts 10 simulated seconds (0.1 s here): read from the pod's watch, which sees every
    # change, not by polling, which a loaded machine can let slip past it.
    status = None
    for event in watch.Watch().stream(
        kube.core.list_namespaced_pod,
        NS,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=30,
    ):
        statuses = event["object"].status.container_statuses or []
        if statuses and statuses[0].state.waiting:
            status = statuses[0]
            break
    assert status is not None, "no CrashLoopBackOff seen on the pod's watch within 30 s"
    assert (
        status.state.waiting.reason == "CrashLoopBackOff"
        and status.restart_count == 1
        and status.ready is False
    )
    assert (status.last_state.terminated.reason, status.last_state.terminated.exit_code) == ("OOMKilled", 137)
    assert kube.core.read_namespaced_pod(name, NS).status.phase == "Running"
    assert_valid_objects(kube)  # CrashLoopBackOff with lastState.terminated
    # back-off 10 s, then the engine reloads its weights (150 s) before the readiness probe passes
    wait_for(
        lambda: kube.core.read_namespaced_pod(name, NS).status.container_statuses[0].ready,
        what="the restarted engine to be ready",
    )
    assert kube.core.read_namespaced_pod(name, NS).status.container_statuses[0].restart_count == 1


def test_container_readiness_override_drives_ready_and_the_endpointslice(kube: Kube) -> None:
    name = first_serving(kube).metadata.name
    kube.sim.world.set_container_ready(NS, name, False)

    def endpoint() -> Any:
        (slice_,) = kube.discovery.list_namespaced_endpoint_slice(NS).items
        return next(e for e in slice_.endpoints if e.target_ref.name == name)

    wait_for(lambda: endpoint().conditions.serving is False, what="serving=false")
    ready = {c.type: c for c in kube.core.read_namespaced_pod(name, NS).status.conditions}["Ready"]
    assert (ready.status, ready.reason) == ("False", "ContainersNotReady")
    kube.sim.world.set_container_ready(NS, name, None)
    wait_for(lambda: endpoint().conditions.serving is True, what="serving=true again")


def test_store_watchers_see_every_change(kube: Kube) -> None:
    seen: list[WatchEvent] = []
    unsubscribe = kube.sim.world.store.watch(seen.append)
    try:
        name = first_serving(kube).metadata.name
        kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"watched": "yes"}}})
        kube.core.delete_namespaced_pod(name, NS, grace_period_seconds=0)
        wait_for(
            lambda: any(e.type == "ADDED" and e.resource == "pods" for e in seen),
            what="the replacement's ADDED",
        )
    finally:
        unsubscribe()
    mine = [
        (e.type, e.object["metadata"]["labels"].get("watched"))
        for e in seen
        if e.resource == "pods" and e.object["metadata"]["name"] == name
    ]
    assert mine[0] == ("MODIFIED", "yes") and mine[-1][0] == "DELETED"


def test_deleting_a_deployment_garbage_collects_its_replicasets_and_pods(kube: Kube) -> None:
    kube.apps.delete_namespaced_deployment("llama-spare", NS)
    wait_for(
        lambda: not kube.apps.list_namespaced_replica_set(NS, label_selector="fleetmend.io/role=spare").items,
        what="RS gone",
    )
    # the spare pod is deleted gracefully (60 s grace) and then gone
    wait_for(
        lambda: not kube.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=spare").items,
        what="spare pod gone",
    )
    assert len(kube.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=serving").items) == 5
    with pytest.raises(NotFoundException):
        kube.apps.read_namespaced_deployment("llama-spare", NS)


def test_a_timed_out_request_may_still_have_been_applied(kube: Kube) -> None:
    rule = {
        "verbs": ["PATCH"],
        "path_contains": "/pods/",
        "error": "timeout",
        "delay_s": 1.0,
        "apply_before_timeout": True,
        "count": 1,
    }
    httpx.put(f"{kube.sim.base_url}/sim/v1/api-faults", json={"rules": [rule]}).raise_for_status()
    name = first_serving(kube).metadata.name
    started = time.monotonic()
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        kube.core.patch_namespaced_pod(
            name, NS, {"metadata": {"labels": {"outcome": "unknown"}}}, _request_timeout=0.3
        )
    assert time.monotonic() - started < 1.0
    # The caller saw a timeout, but the change happened: only probing the target tells.
    assert kube.core.read_namespaced_pod(name, NS).metadata.labels["outcome"] == "unknown"
    wait_for(
        lambda: any(a["status"] == 504 for a in httpx.get(f"{kube.sim.base_url}/sim/v1/actions").json()),
        what="the 504 in the action log",
    )
