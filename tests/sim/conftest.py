"""Fixtures for the simulated cluster: a real sim server on a free loopback port, and
official ``kubernetes`` client APIs pointed at it through its generated kubeconfig.

``sim_server`` serves ``gpu-node-loss`` by default; pick another scenario with
``@pytest.mark.parametrize("sim_server", ["rank-lost"], indirect=True)``.
It serves the Kubernetes side without the serving layer, so these tests see the
control plane's own timing (an idle engine would otherwise exit at once on SIGTERM).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes import client, config

from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.sim.support import TEST_SPEED, Kube


@pytest.fixture
def sim_server(request: pytest.FixtureRequest) -> Iterator[RunningSim]:
    name = getattr(request, "param", "gpu-node-loss")
    running = start_sim(shipped_scenarios()[name], speed=TEST_SPEED, serving=False)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def kube(sim_server: RunningSim) -> Iterator[Kube]:
    api_client = config.new_client_from_config(config_file=str(sim_server.kubeconfig), context="sim")
    try:
        yield Kube(
            api_client,
            client.CoreV1Api(api_client),
            client.AppsV1Api(api_client),
            client.DiscoveryV1Api(api_client),
            client.PolicyV1Api(api_client),
            client.CustomObjectsApi(api_client),
            sim_server,
        )
    finally:
        api_client.close()
