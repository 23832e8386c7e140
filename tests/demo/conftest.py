"""Real ``fleetmend demo --keep-running`` runs shared by the demo-report, metrics and browser tests.

The demo is a subprocess exactly as ``make demo`` runs it, on free ports and a
private state directory (other test sessions run on this machine at the same
time). It writes its report before it blocks, so the tests read the report and
look at the still-running stack (Temporal UI, worker metrics), then the fixture
stops it with Ctrl-C and checks it exits cleanly.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.demo.support import (
    DEMO_TIMEOUT_S,
    FLEETMEND,
    KEPT,
    DemoProcess,
    demo_env,
    port_was_taken,
)
from worker.devstack.scenarios import DEFAULT_SCENARIO


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
        time.sleep(0.5)
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
    if not run.report and port_was_taken(run.output()):
        _stop(run)
        run = _start_kept_demo(scenario, output_dir)
    try:
        if not run.report:
            assert run.proc is not None
            pytest.fail(f"the demo ended without a report (exit {run.proc.poll()}):\n{run.output()[-4000:]}")
        yield run
    finally:
        _stop(run)


_RUNNING: dict[str, DemoProcess] = {}  # kept fixture name -> its running demo
_LAST_USER: dict[str, str] = {}  # kept fixture name -> nodeid of the last test that uses it


def kept_fixtures(item: pytest.Item) -> set[str]:
    """The kept demos a test uses: as fixtures, or through its ``scenario`` parameter."""
    names = {n for n in KEPT.values() if n in getattr(item, "fixturenames", ())}
    callspec = getattr(item, "callspec", None)
    scenario = callspec.params.get("scenario") if callspec is not None else None
    if isinstance(scenario, str) and scenario in KEPT:
        names.add(KEPT[scenario])
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run each kept demo's tests one after another, the default demo's first and the fragmented one's
    last, and note each one's last user: the kept demo stops right after it (a kept demo is a loaded
    fleet of its own, and on 2 cores it slows every demo run beside it)."""
    order = {"kept_demo": 0, "kept_fragmented": 2}
    demo = [i for i in items if i.nodeid.startswith("tests/demo/")]
    if not demo:
        return

    def rank(item: pytest.Item) -> int:
        kept = kept_fixtures(item)
        return min((order[k] for k in kept), default=1)

    first = items.index(demo[0])
    others = [i for i in items if not i.nodeid.startswith("tests/demo/")]
    ordered = sorted(demo, key=rank)  # stable: file order within a group
    items[:] = others[:first] + ordered + others[first:]
    for item in ordered:
        for name in kept_fixtures(item):
            _LAST_USER[name] = item.nodeid


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, last in _LAST_USER.items():
        if item.nodeid == last and name in _RUNNING:
            _stop(_RUNNING.pop(name))


@pytest.fixture(scope="package")
def kept_demo(output_dir: Path) -> Iterator[DemoProcess]:
    """The default scenario (what ``make demo`` runs), left running after its summary until its last test."""
    with keep_running_demo(DEFAULT_SCENARIO, output_dir) as run:
        _RUNNING["kept_demo"] = run
        yield run
        _RUNNING.pop("kept_demo", None)


@pytest.fixture(scope="package")
def kept_fragmented(output_dir: Path) -> Iterator[DemoProcess]:
    """The fragmented scenario: its recovery stays open, awaiting an operator (a live workflow for the UI)."""
    with keep_running_demo("fragmented", output_dir) as run:
        _RUNNING["kept_fragmented"] = run
        yield run
        _RUNNING.pop("kept_fragmented", None)
