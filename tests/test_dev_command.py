"""``fleetmend dev`` as a user runs it: a subprocess that starts, answers, stops clean and keeps its state.

Runs on free ports (FLEETMEND_* env) with its state in the test's temp dir.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import kubernetes
import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from ledger.migrate import is_at_head
from worker.payloads import data_converter
from worker.processes import free_port
from workflows.smoke import FleetmendSmoke

pytestmark = pytest.mark.e2e

FLEETMEND = str(Path(sys.executable).parent / "fleetmend")


@dataclass
class DevRun:
    proc: subprocess.Popen[bytes]
    stdout: Path

    def output(self) -> str:
        return self.stdout.read_text(errors="replace")


@dataclass
class DevConfig:
    state_dir: Path
    env: dict[str, str]
    grpc_port: int
    ui_port: int
    metrics_port: int
    task_queue: str
    started_on: set[int] = field(default_factory=set)  # the ports of every stack of this config that came up

    def pick_ports(self) -> None:
        """Free ports for every part (the stack takes them from the FLEETMEND_* environment)."""
        self.grpc_port, self.ui_port, self.metrics_port = free_port(), free_port(), free_port()
        self.env.update(
            {
                "FLEETMEND_TEMPORAL_ADDRESS": f"127.0.0.1:{self.grpc_port}",
                "FLEETMEND_TEMPORAL_UI_PORT": str(self.ui_port),
                "FLEETMEND_WORKER_METRICS_PORT": str(self.metrics_port),
                **{name: str(free_port()) for name in PICKED_PORTS},
            }
        )

    @property
    def ports(self) -> list[int]:
        return [
            self.grpc_port,
            self.ui_port,
            self.metrics_port,
            int(self.env["FLEETMEND_WEBHOOK_PORT"]),
            int(self.env["FLEETMEND_SIM_PORT"]),
        ]


@pytest.fixture
def dev_root() -> Iterator[Path]:
    """A scratch dir outside pytest's numbered temp dirs.

    Concurrent pytest sessions on one machine prune each other's old numbered dirs;
    a stack living for tens of seconds must not have its state deleted under it.
    """
    root = Path(tempfile.mkdtemp(prefix="fleetmend-dev-test-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


# The ports besides Temporal's, the UI's and the worker's metrics that the test picks for the stack.
PICKED_PORTS = (
    "FLEETMEND_WEBHOOK_PORT",
    "FLEETMEND_SIM_PORT",
    "FLEETMEND_GATEWAY_LISTEN_PORT",
    "FLEETMEND_GATEWAY_ADMIN_PORT",
    "FLEETMEND_XDS_PORT",
)
# How the stack names a port another process holds: its start-up check, the sim, Envoy, uvicorn.
TAKEN_PORT = re.compile(
    r"port [\d.]+:(\d+) is already in use|cannot listen on [\d.]+:(\d+)|cannot bind '[\d.]+:(\d+)'"
    r"|bind on address \('[\d.]+', (\d+)\): address already in use"
)


@pytest.fixture
def dev_config(dev_root: Path) -> DevConfig:
    tmp_path = dev_root
    task_queue = f"dev-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update(
        {
            "FLEETMEND_STATE_DIR": str(tmp_path / "state"),
            "FLEETMEND_TASK_QUEUE": task_queue,
            "COLUMNS": "400",  # one table row per line, so the test can read it
        }
    )
    config = DevConfig(tmp_path / "state", env, 0, 0, 0, task_queue)
    config.pick_ports()
    return config


def start_dev(config: DevConfig, tag: str, timeout_s: float = 120.0) -> DevRun:
    """``fleetmend dev`` until it says it is up. The test picks the stack's ports free, and another process on
    the machine can take one before the stack binds it: the stack then exits naming the port, and starts
    again on fresh ports (three tries). Not when the port is one an earlier stack of this config listened
    on: that port is still held by what the earlier stack left running, and the test fails."""
    for attempt in range(3):
        out = config.state_dir.parent / f"dev-{tag}-{attempt}.out"
        with out.open("wb") as sink:
            proc = subprocess.Popen([FLEETMEND, "dev"], stdout=sink, stderr=subprocess.STDOUT, env=config.env)
        run = DevRun(proc, out)
        failure = _wait_until_up(run, config, timeout_s)
        if failure is None:
            config.started_on.update(config.ports)
            return run
        taken = TAKEN_PORT.search(failure)
        port = int(next(g for g in taken.groups() if g)) if taken else None
        if port is None or port in config.started_on or attempt == 2:
            pytest.fail(failure)
        config.pick_ports()
    raise AssertionError("unreachable")


def _wait_until_up(run: DevRun, config: DevConfig, timeout_s: float) -> str | None:
    """None once the stack is up; else what it said (it was stopped)."""
    deadline = time.monotonic() + timeout_s
    while "fleetmend dev is up" not in run.output():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            exited = run.proc.poll()
            stop_dev(run, signal.SIGKILL)
            log = config.state_dir / "logs" / "fleetmend.log"
            tail = log.read_text(errors="replace")[-4000:] if log.is_file() else "(no log)"
            return f"fleetmend dev did not come up (exit {exited}):\n{run.output()}\n--- {log} (tail) ---\n{tail}"
        time.sleep(0.2)
    return None


def stop_dev(run: DevRun, sig: signal.Signals = signal.SIGINT) -> int:
    run.proc.send_signal(sig)
    return run.proc.wait(timeout=60)


def processes_using(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (temporal --db-filename, postgres -D)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (entry / "status").read_text()
        except OSError:
            continue
        if str(path) in cmdline and "State:\tZ" not in status:
            found.append(f"{entry.name}: {cmdline}")
    return found


def listeners_left(config: DevConfig) -> list[str]:
    """The stack's ports something of this stack still listens on: a LISTEN socket on one of them
    whose process was started by this stack (its environment names the stack's state dir).

    Not a bind test: the other tests running beside this one open client sockets, and one of
    those may hold a just-freed port number as its own local port for a while (a CI run saw a
    port "not free" that way after every process of the stack had exited)."""
    listening: dict[str, int] = {}  # socket inode -> port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if fields[3] == "0A" and port in config.ports:  # 0A: TCP_LISTEN
                    listening[fields[9]] = port
    if not listening:
        return []
    left = []
    marker = str(config.state_dir).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes():
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
                if inode in listening:
                    left.append(f"port {listening[inode]} held by pid {entry.name}")
        except OSError:
            continue
    return left


def assert_nothing_left(config: DevConfig) -> None:
    deadline = time.monotonic() + 10
    while (processes_using(config.state_dir) or listeners_left(config)) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = config.state_dir / "logs" / "fleetmend.log"
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    assert processes_using(config.state_dir) == [], tail
    assert listeners_left(config) == [], tail


@pytest.fixture
def cleanup() -> Iterator[list[DevRun]]:
    runs: list[DevRun] = []
    yield runs
    for run in runs:  # a failed assertion must not leave a stack running
        if run.proc.poll() is None:
            stop_dev(run, signal.SIGKILL)


async def test_dev_starts_answers_stops_clean_and_keeps_history(
    dev_config: DevConfig, cleanup: list[DevRun]
) -> None:
    run = start_dev(dev_config, "first")
    cleanup.append(run)
    output = run.output()
    assert f"http://127.0.0.1:{dev_config.ui_port}" in output

    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"http://127.0.0.1:{dev_config.ui_port}/")).status_code == 200
        metrics = await http.get(f"http://127.0.0.1:{dev_config.metrics_port}/metrics")
        assert "temporal_worker_task_slots_available" in metrics.text
        webhook = f"http://127.0.0.1:{dev_config.env['FLEETMEND_WEBHOOK_PORT']}/healthz"
        assert (await http.get(webhook)).status_code == 200

    # The sim answers the official Kubernetes client through the kubeconfig the stack wrote.
    kubeconfig = dev_config.state_dir / "sim" / "kubeconfig"
    api = kubernetes.client.CoreV1Api(
        kubernetes.config.new_client_from_config(config_file=str(kubeconfig), context="sim")
    )
    assert api.list_node().items

    # The ledger database named in the table is migrated.
    match = re.search(r"(postgresql\+psycopg://\S+)", output)
    assert match, output
    assert is_at_head(match.group(1))

    # A workflow runs end to end through the stack's own worker.
    client = await Client.connect(f"127.0.0.1:{dev_config.grpc_port}", data_converter=data_converter)
    workflow_id = f"smoke-{uuid.uuid4().hex[:8]}"
    result = await client.execute_workflow(
        FleetmendSmoke.run, "dev", id=workflow_id, task_queue=dev_config.task_queue
    )
    assert result.reply.echo == "dev"

    assert stop_dev(run, signal.SIGINT) == 0
    assert "stopped." in run.output()
    assert_nothing_left(dev_config)

    # Restart on the same state: the earlier workflow is still there.
    again = start_dev(dev_config, "second")
    cleanup.append(again)
    client = await Client.connect(f"127.0.0.1:{dev_config.grpc_port}", data_converter=data_converter)
    described = await client.get_workflow_handle(workflow_id).describe()
    assert described.status == WorkflowExecutionStatus.COMPLETED
    listed = [wf.id async for wf in client.list_workflows(f'WorkflowId="{workflow_id}"')]
    assert listed == [workflow_id]

    assert stop_dev(again, signal.SIGTERM) == 0
    assert_nothing_left(dev_config)


def test_failed_migration_is_one_error_line_and_leaves_nothing_running(dev_config: DevConfig) -> None:
    unreachable = f"postgresql+psycopg://fm:secret-pw@127.0.0.1:{free_port()}/ledger"
    env = {**dev_config.env, "FLEETMEND_DATABASE_URL": unreachable}
    done = subprocess.run([FLEETMEND, "dev"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ledger migrations failed"), done.stderr
    assert "FLEETMEND_DATABASE_URL" in lines[0] and "secret-pw" not in lines[0]
    assert_nothing_left(dev_config)


def test_a_part_that_dies_stops_the_whole_stack(
    dev_config: DevConfig, cleanup: list[DevRun], pg_url: str
) -> None:
    dev_config.env["FLEETMEND_DATABASE_URL"] = pg_url  # an external ledger: no initdb, faster
    run = start_dev(dev_config, "crash")
    cleanup.append(run)
    temporal = processes_using(dev_config.state_dir / "temporal.db")
    assert len(temporal) == 1, temporal
    os.kill(int(temporal[0].split(":")[0]), signal.SIGKILL)
    assert run.proc.wait(timeout=60) == 1
    assert "the Temporal dev server exited" in run.output()
    assert_nothing_left(dev_config)


def test_a_killed_supervisor_takes_temporal_with_it_and_a_restart_adopts_postgres(
    dev_config: DevConfig, cleanup: list[DevRun]
) -> None:
    run = start_dev(dev_config, "killed")
    cleanup.append(run)
    run.proc.kill()  # SIGKILL: no chance to clean up
    run.proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while processes_using(dev_config.state_dir / "temporal.db") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_using(dev_config.state_dir / "temporal.db") == []  # died with its parent
    # Postgres runs detached (pg_ctl) and survives; the next start adopts it and stops it.
    again = start_dev(dev_config, "adopt")
    cleanup.append(again)
    assert stop_dev(again) == 0
    assert_nothing_left(dev_config)
