"""What the demo package's tests share: the fleetmend command, a demo process and its report (package-local support: see tests/support.py)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.devstack.scenarios import DEFAULT_SCENARIO
from worker.processes import free_port

REPO = Path(__file__).resolve().parents[2]


FLEETMEND = str(REPO / ".venv" / "bin" / "fleetmend")


DEMO_TIMEOUT_S = 240


@dataclass
class DemoProcess:
    env: dict[str, str]
    workdir: Path  # the demo's state is workdir/.fleetmend/demo: what `fleetmend demo` run in workdir uses
    state_dir: Path
    report_path: Path
    log_path: Path
    ui_url: str
    metrics_url: str
    proc: subprocess.Popen[bytes] | None = None
    report: dict[str, Any] = field(default_factory=dict)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def demo_env(state_dir: Path) -> tuple[dict[str, str], dict[str, int]]:
    ports = {name: free_port() for name in ("temporal", "ui", "sim", "webhook", "metrics")}
    env = {
        **os.environ,
        "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{ports['temporal']}",
        "FLEETMEND_TEMPORAL_UI_PORT": str(ports["ui"]),
        "FLEETMEND_SIM_PORT": str(ports["sim"]),
        "FLEETMEND_WEBHOOK_PORT": str(ports["webhook"]),
        "FLEETMEND_WORKER_METRICS_PORT": str(ports["metrics"]),
        "FLEETMEND_STATE_DIR": str(state_dir),
        "COLUMNS": "120",
    }
    env.pop("FLEETMEND_DATABASE_URL", None)  # the demo's own embedded ledger: reconcile sees only this run
    return env, ports


# A free port is free when it is picked, not necessarily when the demo binds it a few seconds later (other
# test sessions share this machine, and outgoing connections take ephemeral ports): the demo then stops at
# once, before any fault, with "address already in use" (or, from the simulator, "cannot listen on
# 127.0.0.1:N"); it is started again on new ports, once.
PORT_TAKEN = ("already in use", "cannot listen on")


def port_was_taken(output: str) -> bool:
    return any(taken in output for taken in PORT_TAKEN)


def run_demo_cli(
    scenario: str, workdir: Path, timeout_s: float = DEMO_TIMEOUT_S
) -> tuple[int, str, dict[str, Any]]:
    """``fleetmend demo --scenario NAME --report F`` to the end: exit status, output, report."""
    report = workdir / f"{scenario}.json"
    for attempt in range(2):
        env, _ = demo_env(workdir / "state")
        done = subprocess.run(
            [FLEETMEND, "demo", "--scenario", scenario, "--report", str(report)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        output = done.stdout + done.stderr
        (workdir / f"{scenario}.out").write_text(output)
        if report.exists() or not port_was_taken(output) or attempt:
            break
    return done.returncode, output, json.loads(report.read_text()) if report.exists() else {}


# The kept demos, and the scenario each one is: a test of that scenario reads the kept run instead of
# running the demo again.
KEPT = {DEFAULT_SCENARIO: "kept_demo", "fragmented": "kept_fragmented"}
