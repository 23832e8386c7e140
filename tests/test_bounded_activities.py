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
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio import workflow

from fleet.recovery import RetryBudget
from workflows.procedure import bounded_call, run_bounded

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
