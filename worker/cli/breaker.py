"""``fleetmend breaker status|reset``: the fleet's removal breaker (``fleet.breaker``, ``workflows/breaker.py``).

``status`` asks the ``RemovalBreaker`` workflow's ``status`` query: tripped or closed, why, what is
held, what was granted in the window. ``reset`` sends its validated ``reset`` Update: a reason is
required and goes into the record; a breaker that is not tripped refuses (exit status 2, nothing
changed). The held procedures then read the world again and decide anew.
"""

from __future__ import annotations

import asyncio
import getpass
import json

import typer
from rich.console import Console
from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from fleet.breaker import BreakerStatus, breaker_workflow_id
from fleet.recovery import OperatorAction
from worker.cli.common import fail, temporal_client
from worker.config import load_settings
from worker.temporal_client import execute_update

app = typer.Typer(no_args_is_help=True)
console = Console()


async def _status() -> BreakerStatus | None:
    settings = load_settings()
    client = await temporal_client(settings)
    try:
        return await client.get_workflow_handle(breaker_workflow_id(settings.task_queue)).query(
            "status", result_type=BreakerStatus
        )
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return None  # nothing has asked it yet: it starts with the first ask
        raise


@app.command("status")
def status(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text.")) -> None:
    """Whether the removal breaker is tripped, why, and what it holds."""
    current = asyncio.run(_status())
    if as_json:
        typer.echo(json.dumps(current.model_dump(mode="json") if current else None, indent=2))
        return
    if current is None:
        console.print("removal breaker: closed (nothing has asked it yet)")
        return
    if current.trip is not None:
        console.print(f"[red]removal breaker: TRIPPED[/] - {current.trip.reason}")
        for h in current.held:
            console.print(
                f"  held: {h.request.action} {h.request.node} for {h.request.requester} ({h.request.signal})"
            )
        console.print("reset with: fleetmend breaker reset --reason '...'")
    else:
        console.print(
            f"removal breaker: closed - {len(current.granted_in_window)} serving node(s) granted in the window"
            f" (cap {current.cap_for_last_fleet}); {current.dead_passed} dead-capacity fence(s) passed"
        )


@app.command("reset")
def reset(
    reason: str = typer.Option(
        ..., "--reason", help="Why the signal can be trusted again (into the record)."
    ),
    operator: str = typer.Option(None, "--operator", help="Who is acting (default: your login name)."),
) -> None:
    """Close a tripped breaker: each held procedure reads the world again and decides anew."""
    try:
        action = OperatorAction(operator=operator or getpass.getuser(), reason=reason)
    except ValueError as err:
        raise fail(f"bad --operator/--reason: {err}", 2) from None

    async def main() -> BreakerStatus:
        settings = load_settings()
        client = await temporal_client(settings)
        handle = client.get_workflow_handle(breaker_workflow_id(settings.task_queue))
        try:
            return await execute_update(handle, "reset", action, result_type=BreakerStatus)
        except WorkflowUpdateFailedError as err:
            message = getattr(err.cause, "message", None) or str(err.cause or err)
            raise fail(f"reset rejected: {message}", 2) from None
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise fail(
                    "the removal breaker has not started (nothing asked it): nothing to reset", 2
                ) from None
            raise fail(f"reset failed: {err.message}", 2) from None

    after = asyncio.run(main())
    released = after.resets[-1].released if after.resets else []
    console.print(
        f"removal breaker reset; {len(released)} held procedure(s) decide again: {', '.join(released) or '-'}"
    )
