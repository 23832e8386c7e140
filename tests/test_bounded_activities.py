"""Every activity a fleetmend workflow runs is bounded in attempts *and* time (issue #32).

Temporal's default activity retry is unlimited with no schedule-to-close: a persistent failure
spins silently in a pending activity. So the one place a workflow may run an activity is the
toolkit (``workflows/procedure.py``: ``run_bounded``, under ``bounded_call(budget)``):

(a) an ``ast`` scan of ``workflows/`` fails on any ``execute_activity*`` / ``start_activity*`` /
    ``execute_local_activity*`` / ``start_local_activity*`` call (or import of one) elsewhere -
    and is shown here to catch a planted call;
(b) the toolkit's own calls all pass ``retry_policy`` and ``schedule_to_close_timeout``, and the
    policy builder refuses a budget without attempts or with unbounded time.
"""

from __future__ import annotations

import ast
import asyncio
import math
import re
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio import activity, workflow
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.act import EffectReport, NotifyRequest
from activities.readiness import GateSyncRequest, GateSyncResult
from fleet.incident import PoolRef
from fleet.recovery import IncidentInput, Phase, RecoveryTimings, RetryBudget
from workflows.incident import FleetIncident
from workflows.procedure import bounded_call, run_bounded
from workflows.readiness_keeper import KeeperInput, ReadinessKeeper, sample_budget

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / "workflows"
TOOLKIT = WORKFLOWS / "procedure.py"

ACTIVITY_CALL = re.compile(r"^(execute|start)_(local_)?activity(_method|_class)?$")


def activity_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every activity call or import of an activity-running function in ``source``.

    Matches attribute calls on any object (``workflow.x``, an alias ``wf.x``) and bare names
    (``from temporalio.workflow import execute_activity``), so an alias cannot hide one.
    """
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if ACTIVITY_CALL.match(name):
                found.append((node.lineno, name))
        elif isinstance(node, ast.ImportFrom):
            found += [(node.lineno, f"import {a.name}") for a in node.names if ACTIVITY_CALL.match(a.name)]
    return found


def outside_toolkit(root: Path, toolkit: Path) -> list[str]:
    """Every activity call in ``root``'s modules other than ``toolkit``, as ``path:line: name``."""
    return [
        f"{path.relative_to(root)}:{line}: {name}"
        for path in sorted(root.rglob("*.py"))
        if path.resolve() != toolkit.resolve()
        for line, name in activity_calls(path.read_text())
    ]


def test_no_workflow_module_runs_an_activity_outside_the_toolkit() -> None:
    assert outside_toolkit(WORKFLOWS, TOOLKIT) == []
    # The scan sees the workflows at all: the toolkit's own call is found where it is.
    assert [name for _, name in activity_calls(TOOLKIT.read_text())] == ["execute_activity"]


@pytest.mark.parametrize(
    "planted",
    [
        "await workflow.execute_activity(probe, 1, start_to_close_timeout=timedelta(seconds=5))",
        "await workflow.execute_activity_method(Acts.probe, 1, start_to_close_timeout=timedelta(seconds=5))",
        "handle = workflow.start_activity(probe, 1, start_to_close_timeout=timedelta(seconds=5))",
        "await wf.execute_local_activity(probe, 1, start_to_close_timeout=timedelta(seconds=5))",
        "await execute_activity_class(Probe, 1)",
    ],
)
def test_a_planted_activity_call_outside_the_toolkit_is_caught(tmp_path: Path, planted: str) -> None:
    pkg = tmp_path / "workflows"
    pkg.mkdir()
    (pkg / "procedure.py").write_text(TOOLKIT.read_text())
    (pkg / "innocent.py").write_text("async def run() -> None:\n    return None\n")
    assert outside_toolkit(pkg, pkg / "procedure.py") == []
    (pkg / "sneaky.py").write_text(
        textwrap.dedent(
            """\
            from temporalio import workflow
            from temporalio import workflow as wf

            class Sneaky:
                async def run(self) -> None:
                    {planted}
            """
        ).format(planted=planted)
    )
    caught = outside_toolkit(pkg, pkg / "procedure.py")
    assert len(caught) == 1 and caught[0].startswith("sneaky.py:6: "), caught


def test_importing_an_activity_runner_outside_the_toolkit_is_caught(tmp_path: Path) -> None:
    (tmp_path / "procedure.py").write_text("")
    (tmp_path / "keeper.py").write_text("from temporalio.workflow import execute_activity as ea\n")
    assert outside_toolkit(tmp_path, tmp_path / "procedure.py") == ["keeper.py:1: import execute_activity"]


def test_every_toolkit_activity_call_passes_attempts_and_schedule_to_close() -> None:
    calls = [
        node
        for node in ast.walk(ast.parse(TOOLKIT.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and ACTIVITY_CALL.match(node.func.attr)
    ]
    assert calls, "the toolkit runs activities somewhere"
    for call in calls:
        keywords = {k.arg for k in call.keywords}
        assert None not in keywords, f"line {call.lineno}: **kwargs could drop the bounds"
        assert {"retry_policy", "schedule_to_close_timeout", "start_to_close_timeout"} <= keywords, (
            f"line {call.lineno}: {sorted(k for k in keywords if k)}"
        )


def test_the_bounded_call_carries_the_budget() -> None:
    budget = RetryBudget(attempts=4, budget_s=90.0, call_timeout_s=20.0)
    call = bounded_call(budget)
    assert call.retry_policy.maximum_attempts == 4
    assert call.schedule_to_close == timedelta(seconds=90) and call.start_to_close == timedelta(seconds=20)
    assert call.heartbeat is None
    # A long wait (await_derouted) gets its own attempt timeout and room for two attempts.
    long = bounded_call(budget, timeout_s=300.0, heartbeat_s=10.0)
    assert long.start_to_close == timedelta(seconds=300) and long.schedule_to_close == timedelta(seconds=600)
    assert long.heartbeat == timedelta(seconds=10) and long.retry_policy.maximum_attempts == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attempts": 0}, "maximum attempt count"),
        ({"attempts": -3}, "maximum attempt count"),
        ({"budget_s": math.inf}, "schedule-to-close"),
        ({"budget_s": math.nan}, "schedule-to-close"),
        ({"budget_s": 0.0}, "schedule-to-close"),
        ({"call_timeout_s": math.inf}, "start-to-close"),
    ],
)
def test_the_policy_builder_refuses_an_unbounded_budget(change: dict[str, Any], message: str) -> None:
    # model_construct skips validation: the builder must not rely on whoever built the budget.
    unbounded = RetryBudget.model_construct(**{**RetryBudget().model_dump(), **change})
    with pytest.raises(ValueError, match=message):
        bounded_call(unbounded)


def test_a_budget_without_attempts_or_time_does_not_validate() -> None:
    with pytest.raises(ValidationError):
        RetryBudget(attempts=0)
    with pytest.raises(ValidationError):
        RetryBudget(budget_s=0)


def test_run_bounded_hands_temporal_both_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """What reaches Temporal: the budget's attempts and schedule-to-close, for any activity."""
    seen: dict[str, Any] = {}

    async def fake_execute_activity(activity: Any, arg: Any, **options: Any) -> str:
        seen.update(options, activity=activity, arg=arg)
        return "done"

    monkeypatch.setattr(workflow, "execute_activity", fake_execute_activity)
    budget = RetryBudget(attempts=3, budget_s=45.0, call_timeout_s=15.0)
    result = asyncio.run(run_bounded(len, "x", budget=budget, summary="s" * 300))
    assert result == "done"
    assert seen["retry_policy"].maximum_attempts == 3
    assert seen["schedule_to_close_timeout"] == timedelta(seconds=45)
    assert seen["start_to_close_timeout"] == timedelta(seconds=15)
    assert len(seen["summary"]) <= 190
    # An unbounded budget never reaches Temporal.
    seen.clear()
    with pytest.raises(ValueError):
        asyncio.run(
            run_bounded(
                len,
                "x",
                budget=RetryBudget.model_construct(**{**budget.model_dump(), "attempts": 0}),
                summary="s",
            )
        )
    assert seen == {}


# ---------------------------------------------------------------- the two calls that used to spin silently


class _Flaky:
    """Fake activities under the real names: fail while ``broken``, counting every attempt."""

    def __init__(self) -> None:
        self.broken = True
        self.attempts: list[int] = []
        self.attempts_when_told: list[int] = []
        self.notes: list[str] = []

    def _fail_or_pass(self) -> None:
        self.attempts.append(activity.info().attempt)
        if self.broken:
            raise ApplicationError("settings file unreadable: /etc/fleetmend/policy.yaml (permission denied)")

    @activity.defn(name="load_incident_config")
    async def load_incident_config(self, pool: PoolRef) -> IncidentInput:
        self._fail_or_pass()
        return IncidentInput(pool=pool, timings=RecoveryTimings(cooldown_s=1))

    @activity.defn(name="notify")
    async def notify(self, req: NotifyRequest) -> EffectReport:
        self.notes.append(req.text)
        self.attempts_when_told.append(len(self.attempts))
        self.broken = False  # the operator heard of it and fixed the worker's configuration
        return EffectReport(op_id=req.step, kind="notify", target=req.topic, state="applied")

    @activity.defn(name="sync_readiness_gates")
    async def sync_readiness_gates(self, req: GateSyncRequest) -> GateSyncResult:
        self._fail_or_pass()
        return GateSyncResult(gates=req.gates, verdicts={"llama-0": "ready"})


async def _eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.1)


async def test_a_persistent_policy_load_failure_is_said_not_retried_forever(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """FleetIncident's policy load: the budget's attempts, then awaiting-operator and the channel;
    read again after the fix, and the incident goes on (it closes after its cool-down)."""
    client, queue, fake = time_skipping_env.client, f"bounded-{uuid.uuid4().hex[:8]}", _Flaky()
    pool = PoolRef(namespace="inference", service=f"llama-{uuid.uuid4().hex[:6]}")
    async with Worker(
        client,
        task_queue=queue,
        workflows=[FleetIncident],
        activities=[fake.load_incident_config, fake.notify],
    ):
        handle = await client.start_workflow(
            FleetIncident.run, pool, id=f"incident-{pool.service}", task_queue=queue
        )
        result = await handle.result()
    text_ = "\n".join(d.summary for d in result.decisions)
    assert result.phase == Phase.DONE, text_
    # Exactly the budget's attempts before anyone was told (Temporal's default would never stop).
    assert fake.attempts_when_told == [RetryBudget().attempts], fake.attempts
    assert max(fake.attempts) == RetryBudget().attempts
    [note] = fake.notes
    assert "cannot read its incident policy" in note and "permission denied" in note, note
    assert "stopped: the worker cannot read its incident policy" in text_ and "policy for" in text_, text_
    assert result.awaiting is None


async def test_a_persistently_failing_readiness_sample_is_recorded_and_the_keeper_samples_on(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """The ReadinessKeeper's sample: bounded attempts, the error in its status, the gates left as they
    were; the next sample after the fix clears it."""
    client, queue, fake = time_skipping_env.client, f"bounded-{uuid.uuid4().hex[:8]}", _Flaky()
    pool = PoolRef(namespace="inference", service=f"llama-{uuid.uuid4().hex[:6]}")
    async with Worker(
        client, task_queue=queue, workflows=[ReadinessKeeper], activities=[fake.sync_readiness_gates]
    ):
        handle = await client.start_workflow(
            ReadinessKeeper.run,
            KeeperInput(pool=pool, interval_s=1.0),
            id=f"keeper-{pool.service}",
            task_queue=queue,
        )

        async def failed() -> bool:
            return (await handle.query(ReadinessKeeper.status)).last_error is not None

        await _eventually(failed, "the keeper records the failed sample")
        status = await handle.query(ReadinessKeeper.status)
        assert status.last_error is not None and "permission denied" in status.last_error, status
        assert "retry budget spent (attempts)" in status.last_error, status.last_error
        assert max(fake.attempts) == sample_budget(1.0).attempts and status.samples == 0, fake.attempts
        fake.broken = False

        async def recovered() -> bool:
            s = await handle.query(ReadinessKeeper.status)
            return s.last_error is None and s.samples > 0

        await _eventually(recovered, "the next sample after the fix clears the error")
        assert max(fake.attempts) == sample_budget(1.0).attempts  # never more than the budget
        await handle.terminate("test over")
