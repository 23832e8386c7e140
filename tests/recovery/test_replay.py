"""Recorded recoveries replay on today's workflow code without nondeterminism.

A worker upgrade replays every open recovery on the new code: a change to the runbook that
reorders or drops a command must be guarded by ``workflow.patched`` so that a recovery started
on the old code replays as it ran. ``tests/histories/*.json`` are histories recorded from earlier
code (re-record with ``FLEETMEND_RECORD_HISTORIES=tests/histories``, see
``tests/recovery/conftest.py``); each is replayed with every workflow the worker serves and
the data converter the worker uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from tests.recovery.support import IDS
from worker.payloads import data_converter
from worker.registry import WORKFLOWS

ROOT = Path(__file__).parent.parent / "histories"
# tests/histories/*.json: recorded before the node workflow existed (its hardware path replays inline);
# tests/histories/node-workflow/*.json: recorded since (a recovery and its node's workflow);
# tests/histories/procedures-before-split/*.json: scale-downs, readiness keepers and an incident recorded
# before their waits became the toolkit's poll/window.
HISTORIES = sorted(p for p in ROOT.rglob("*.json") if p.name != IDS)


def test_there_are_histories_to_replay() -> None:
    names = {p.stem for p in HISTORIES}
    # A plain GPU-node loss (shedding, ramp), the hardware path (quarantine, qualification Jobs,
    # repair watch) and an operator's skip of a refused effect.
    assert {"gpu_node_lost_under_load_alert_storm_one_recovery"} <= names, names
    assert any("xid_79" in n for n in names) and any("refused" in n for n in names), names
    # ... and, recorded since, a recovery with its node's own workflow (the hardware path as a child).
    assert any(p.parent != ROOT and p.stem.endswith("-node") for p in HISTORIES), HISTORIES
    # ... and the other procedures as they ran before the toolkit's poll/window (PlannedScaleDown with its
    # drain answers, the ReadinessKeeper, FleetIncident), recorded from that commit's own tests.
    kinds = {
        json.loads(p.read_text())["events"][0]["workflowExecutionStartedEventAttributes"]["workflowType"][
            "name"
        ]
        for p in HISTORIES
    }
    assert {"PlannedScaleDown", "ReadinessKeeper", "FleetIncident", "ReplicaLossRecovery"} <= kinds, kinds


@pytest.mark.parametrize("path", HISTORIES, ids=[str(p.relative_to(ROOT)) for p in HISTORIES])
async def test_a_recorded_recovery_replays_without_nondeterminism(path: Path) -> None:
    # The recorded workflow id: the node workflows' ids (and their start commands) derive from the recovery's.
    workflow_id = json.loads((path.parent / IDS).read_text())[path.name]
    history = WorkflowHistory.from_json(workflow_id, path.read_text())
    replayer = Replayer(workflows=WORKFLOWS, data_converter=data_converter)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure!r}"
