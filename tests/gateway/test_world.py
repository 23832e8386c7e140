"""The control plane's routing set, read from a Kubernetes API server (the simulated one, over
HTTPS with the official client): ready endpoints of each Service whose pods carry the router label.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from fleet.vocabulary import ROUTER_LABEL
from gateway.resources import RoutedHost
from gateway.run import hosts_reader
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.support import component_kubeconfig

pytestmark = pytest.mark.timeout(120)
POOL = "inference/llama"


@pytest.fixture(scope="module")
def sim() -> Iterator[RunningSim]:
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0, serving=False)
    yield running
    running.stop()


def settle(read: object, want: int, timeout_s: float = 60.0) -> tuple[RoutedHost, ...]:
    deadline = time.monotonic() + timeout_s
    hosts: tuple[RoutedHost, ...] = ()
    while time.monotonic() < deadline:
        hosts = read()[POOL]  # type: ignore[operator]
        if len(hosts) == want:
            return hosts
        time.sleep(0.2)
    raise AssertionError(f"{POOL} has {len(hosts)} routed hosts, not {want}: {hosts}")


def test_the_routing_set_is_ready_endpoints_with_the_router_label_and_follows_a_deroute(
    sim: RunningSim,
) -> None:
    read = hosts_reader(component_kubeconfig(sim.kubeconfig, "gateway"), None)
    try:
        check_routing_set(sim, read)
    finally:
        read.stop()


def check_routing_set(sim: RunningSim, read: object) -> None:
    hosts = settle(read, 5)  # 5 serving replicas; the warm spare carries no router label
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(sim.kubeconfig)))
    pods = {p.metadata.name: p for p in api.list_namespaced_pod("inference").items}
    for host in hosts:
        assert host.address == pods[host.pod].status.pod_ip
        assert pods[host.pod].metadata.labels[ROUTER_LABEL] == "true"
        assert host.node == pods[host.pod].spec.node_name
    spare = [n for n, p in pods.items() if ROUTER_LABEL not in (p.metadata.labels or {})]
    assert spare and not set(spare) & {h.pod for h in hosts}

    derouted = hosts[0].pod
    api.patch_namespaced_pod(derouted, "inference", {"metadata": {"labels": {ROUTER_LABEL: None}}})
    after = settle(read, 4)  # the pods watch saw the label go
    assert derouted not in {h.pod for h in after}


def test_a_service_selector_limits_the_pools(sim: RunningSim) -> None:
    read = hosts_reader(
        component_kubeconfig(sim.kubeconfig, "gateway"), None, service_selector="app=nothing-matches"
    )
    try:
        assert read() == {}
    finally:
        read.stop()
