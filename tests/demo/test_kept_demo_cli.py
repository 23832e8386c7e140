"""A kept demo is found by the CLI with no settings at all.

``fleetmend demo --keep-running`` leaves its stack up on its own ports, with its
own ledger and webhook token under ``.fleetmend/demo``. The operator then opens
another shell in the same directory and types ``fleetmend status``: every
client command must find that stack by itself (``.fleetmend/demo/stack.env``,
read by ``worker.config.adopt_kept_stack``), without one ``FLEETMEND_*``
variable set. The kept ``fragmented`` demo is used: its recovery stays open,
awaiting an operator, so there is something to list.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.demo.support import FLEETMEND, DemoProcess

pytestmark = pytest.mark.slow


def fleetmend(demo: DemoProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """A command typed in another shell in the demo's directory: no FLEETMEND_* setting at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETMEND_")}
    env["COLUMNS"] = "200"
    return subprocess.run(
        [FLEETMEND, *args], cwd=demo.workdir, env=env, capture_output=True, text=True, timeout=120
    )


def test_status_ledger_alert_and_config_find_the_kept_demo(kept_fragmented: DemoProcess) -> None:
    demo = kept_fragmented
    recovery = demo.report["workflow_id"]

    config = fleetmend(demo, "config", "--json")
    assert config.returncode == 0, config.stderr
    values = json.loads(config.stdout)
    assert values["temporal_address"] == demo.env["FLEETMEND_TEMPORAL_ADDRESS"]
    assert values["state_dir"] == str((demo.state_dir / "demo").resolve())

    status = fleetmend(demo, "status", "--json")
    assert status.returncode == 0, status.stderr
    rows = {row["workflow_id"]: row for row in json.loads(status.stdout)}
    assert recovery in rows, rows
    assert rows[recovery]["awaiting"] and rows[recovery]["figures"].get("fragmentation"), rows[recovery]

    ledger = fleetmend(demo, "ledger", "list", "--workflow", recovery, "--json")
    assert ledger.returncode == 0, ledger.stderr
    items = json.loads(ledger.stdout)["items"]
    assert items and all(item["workflow_id"] == recovery for item in items), items

    # The webhook's bearer token is the demo's own (generated under its state dir).
    example = fleetmend(
        demo, "alert", "--example", "node-not-ready", "--label", "node=gpu-node-3", "--resolved"
    )
    assert example.returncode == 0, example.stderr
    payload = demo.workdir / "resolved.json"
    payload.write_text(example.stdout)
    posted = fleetmend(demo, "alert", "--file", str(payload))
    assert posted.returncode == 0, posted.stdout + posted.stderr
    assert "HTTP 200" in posted.stdout


def test_a_second_demo_refuses_to_wipe_the_kept_one(kept_fragmented: DemoProcess) -> None:
    demo = kept_fragmented
    done = fleetmend(demo, "demo", "--scenario", "slow-replica")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, (done.returncode, done.stdout, done.stderr)
    assert "a demo is already running" in lines[0]
    assert (demo.state_dir / "demo" / "stack.env").exists()  # the kept demo's state is untouched
    assert fleetmend(demo, "status").returncode == 0
