"""Real ``fleetmend demo --keep-running`` runs shared by the demo-report, metrics and browser tests.

The demo is a subprocess exactly as ``make demo`` runs it, on free ports and a
private state directory (other test sessions run on this machine at the same
time). It writes its report before it blocks, so the tests read the report and
look at the still-running stack (Temporal UI, worker metrics), then the fixture
stops it with Ctrl-C and checks it exits cleanly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

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
# once, before any fault, with "address already in use"; it is started again on new ports, once.
PORT_TAKEN = "already in use"


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
        if report.exists() or PORT_TAKEN not in output or attempt:
            break
    return done.returncode, output, json.loads(report.read_text()) if report.exists() else {}


@pytest.fixture(scope="session")
def output_dir() -> Path:
    """Artifacts kept after the run (reports, outputs, screenshots): $TMPDIR/fleetmend-demo-test-output."""
    path = Path(tempfile.gettempdir()) / "fleetmend-demo-test-output"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _start_kept_demo(scenario: str, output_dir: Path) -> DemoProcess:
    """Start ``fleetmend demo --keep-running`` on free ports in a fresh directory; wait for its report."""
    workdir = Path(tempfile.mkdtemp(prefix="fleetmend-demo-"))
    state_dir = workdir / ".fleetmend"  # the default state dir of a command run in workdir
    env, ports = demo_env(state_dir)
    run = DemoProcess(
        env=env,
        workdir=workdir,
        state_dir=state_dir,
        report_path=output_dir / f"{scenario}.json",
        log_path=output_dir / f"{scenario}.out",
        ui_url=f"http://127.0.0.1:{ports['ui']}",
        metrics_url=f"http://127.0.0.1:{ports['metrics']}/metrics",
    )
    run.report_path.unlink(missing_ok=True)
    with run.log_path.open("wb") as log:
        run.proc = subprocess.Popen(
            [FLEETMEND, "demo", "--scenario", scenario, "--keep-running", "--report", str(run.report_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + DEMO_TIMEOUT_S
    while not run.report_path.exists():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            return run  # no report: the caller says why
        time.sleep(1)
    time.sleep(0.5)  # the file is written in one call; let it land
    run.report = json.loads(run.report_path.read_text())
    return run


def _stop(run: DemoProcess) -> None:
    assert run.proc is not None
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)  # what Ctrl-C does: the demo stops every part
        try:
            run.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
    shutil.rmtree(run.workdir, ignore_errors=True)


@contextmanager
def keep_running_demo(scenario: str, output_dir: Path) -> Iterator[DemoProcess]:
    """``fleetmend demo --scenario NAME --keep-running --report F``: yields once the report is written."""
    run = _start_kept_demo(scenario, output_dir)
    if not run.report and PORT_TAKEN in run.output():
        _stop(run)
        run = _start_kept_demo(scenario, output_dir)
    try:
        if not run.report:
            assert run.proc is not None
            pytest.fail(f"the demo ended without a report (exit {run.proc.poll()}):\n{run.output()[-4000:]}")
        yield run
    finally:
        _stop(run)


# Package scope: the kept demos (a loaded fleet each) stop when the demo tests are done, not at the
# end of the session - they would slow every later test on a 2-core machine.
@pytest.fixture(scope="package")
def kept_demo(output_dir: Path) -> Iterator[DemoProcess]:
    """The default scenario (what ``make demo`` runs), left running after its summary."""
    with keep_running_demo("gpu-node-loss", output_dir) as run:
        yield run


@pytest.fixture(scope="package")
def kept_fragmented(output_dir: Path) -> Iterator[DemoProcess]:
    """The fragmented scenario: its recovery stays open, awaiting an operator (a live workflow for the UI)."""
    with keep_running_demo("fragmented", output_dir) as run:
        yield run
