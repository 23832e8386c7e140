"""The operator's commands: ``fleetmend status`` and ``fleetmend approve|pause|resume|abort|retry|skip|resolve
WORKFLOW_ID``.

``status`` lists the open incidents, recoveries, scale-downs, node fences, node
qualifications (each of them can wait on an operator) and fleet events from Temporal
visibility (the ``FleetmendKind`` search attribute) and asks each its
``status`` query; the steering commands send the procedure's validated
Updates. A rejected Update (nothing to approve, already paused, no reason for
an abort, ...) is one error line and exit status 2: nothing changed.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import time
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from fleet.recovery import OperatorAction, ProcedureStatus
from worker.cli.common import fail, temporal_client
from worker.config import Settings, load_settings
from worker.temporal_client import execute_update

console = Console()

PROCEDURE_KINDS = (
    "incident",
    "replica-loss",
    "scale-down",
    "node-fence",
    "node-qualification",
    "fleet-event",
)
OPEN_PROCEDURES = (
    "FleetmendKind IN (" + ", ".join(f'"{k}"' for k in PROCEDURE_KINDS) + ') AND ExecutionStatus = "Running"'
)
# Figures worth a glance in the table (the full set is in --json).
KEY_FIGURES = (
    "deroute_seconds",
    "shed_tiers",
    "promoted",
    "lead_time_announced_seconds",
    "fault_class",
    "fragmentation",
    "victims",
    "cut_streams",
    "alerts_absorbed",
)


async def open_procedures(client: Client) -> list[dict[str, Any]]:
    """Every open fleetmend procedure with its kind, age and ``status`` query answer."""
    rows: list[dict[str, Any]] = []
    async for wf in client.list_workflows(OPEN_PROCEDURES):
        kind = wf.typed_search_attributes.get(_kind_key())
        row: dict[str, Any] = {
            "workflow_id": wf.id,
            "type": wf.workflow_type,
            "kind": kind,
            "started": wf.start_time.isoformat() if wf.start_time else None,
            "age_seconds": round(time.time() - wf.start_time.timestamp(), 1) if wf.start_time else None,
        }
        try:
            status = await client.get_workflow_handle(wf.id).query("status", result_type=ProcedureStatus)
        except (RPCError, Exception) as err:  # a procedure without a worker right now still shows
            row.update(phase=None, error=f"status query failed: {err}")
        else:
            row.update(
                phase=status.phase.value,
                pool=status.pool.key,
                paused=status.paused,
                awaiting=status.awaiting,
                dry_run=status.dry_run,
                figures=status.figures,
                children=status.children,
                last_decision=status.decisions[-1].summary if status.decisions else None,
            )
        rows.append(row)
    return sorted(rows, key=lambda r: r["started"] or "")


def _kind_key() -> Any:
    from fleet.search_attributes import FLEETMEND_KIND

    return FLEETMEND_KIND


def _figures_text(figures: dict[str, Any]) -> str:
    shown = [f"{k}={figures[k]}" for k in KEY_FIGURES if figures.get(k) not in (None, [], "")]
    return ", ".join(shown) or "-"


def status_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="open fleetmend procedures", title_justify="left")
    for col in ("workflow", "kind", "phase", "age", "awaiting / last decision", "key figures"):
        table.add_column(col, overflow="fold")
    for r in rows:
        phase = r.get("phase") or "?"
        if r.get("paused"):
            phase += " (paused)"
        note = (
            f"[yellow]awaiting: {r['awaiting']}[/]" if r.get("awaiting") else (r.get("last_decision") or "")
        )
        table.add_row(
            r["workflow_id"],
            r.get("kind") or r["type"],
            phase,
            f"{r['age_seconds']:.0f}s" if r.get("age_seconds") is not None else "-",
            note or r.get("error", ""),
            _figures_text(r.get("figures") or {}),
        )
    return table


def status(
    as_json: bool = typer.Option(False, "--json", help="Print JSON (every figure) instead of a table."),
) -> None:
    """List open incidents, recoveries and scale-downs: phase, age, what they await, key figures."""
    settings = load_settings()

    async def main() -> list[dict[str, Any]]:
        return await open_procedures(await temporal_client(settings))

    rows = asyncio.run(main())
    if as_json:
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    if not rows:
        console.print("no open fleetmend procedures")
        return
    console.print(status_table(rows))


async def send_update(
    settings: Settings, workflow_id: str, update: str, action: OperatorAction
) -> ProcedureStatus:
    client = await temporal_client(settings)
    handle = client.get_workflow_handle(workflow_id)
    try:
        return await execute_update(handle, update, action, result_type=ProcedureStatus)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        message = getattr(cause, "message", None) or str(cause or err)
        raise fail(f"{update} rejected by {workflow_id}: {message}", 2) from None
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise fail(
                f"no running workflow {workflow_id!r} (see `fleetmend status` for the open ones)", 2
            ) from None
        raise fail(f"{update} on {workflow_id} failed: {err.message}", 2) from None


def _steer(update: str, help_text: str) -> Any:
    def command(
        workflow_id: str = typer.Argument(..., help="Workflow id (from `fleetmend status`)."),
        operator: str = typer.Option(
            None, "--operator", help="Who is acting (default: your login name); goes into the record."
        ),
        reason: str = typer.Option("", "--reason", help="Why (required for abort); goes into the record."),
    ) -> None:
        who = operator or getpass.getuser()
        try:
            action = OperatorAction(operator=who, reason=reason)
        except ValueError as err:
            raise fail(f"bad --operator/--reason: {err.errors()[0]['msg']}", 2) from None  # type: ignore[attr-defined]
        result = asyncio.run(send_update(load_settings(), workflow_id, update, action))
        console.print(
            f"{update} accepted by {workflow_id}: phase {result.phase.value}"
            + (" (paused)" if result.paused else "")
            + (f", awaiting {result.awaiting}" if result.awaiting else "")
        )

    command.__doc__ = help_text
    return command


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("approve")(
        _steer("approve", "Approve the step a procedure waits for (its status shows what it awaits).")
    )
    app.command("pause")(_steer("pause", "Hold a procedure at its next step boundary."))
    app.command("resume")(_steer("resume", "Continue a paused procedure."))
    app.command("abort")(
        _steer("abort", "Stop a procedure at its next step boundary (needs --reason); applied effects stay.")
    )
    app.command("retry")(
        _steer("retry", "Try the refused effect (or the step whose retry budget is spent) again.")
    )
    app.command("skip")(
        _steer(
            "skip",
            "Go on without the refused effect (you did it by hand, or it is not needed; needs --reason).",
        )
    )
    app.command("resolve")(
        _steer("resolve", "Close out an incident's failed recoveries once handled (needs --reason).")
    )
