"""``fleetmend scale-down``: start a planned scale-down now, and answer its drain deadline (extend / accept-cut).

``start`` runs ``PlannedScaleDown`` under the pool's workflow id
(``scale-down/<namespace>/<service>``), so one pool has at most one manual
scale-down at a time. At the drain deadline the workflow waits for an
operator: ``extend`` gives the victims more time, ``accept-cut`` terminates
them with what is still streaming (recorded in the report). Pause, resume and
abort are ``fleetmend pause|resume|abort WORKFLOW_ID`` like every procedure.
"""

from __future__ import annotations

import getpass

import typer
from pydantic import ValidationError
from rich.console import Console
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from fleet.incident import PLANNED_SCALE_DOWN_WORKFLOW, scale_down_workflow_id
from fleet.recovery import OperatorAction, ProcedureStatus
from fleet.scale_down import ScaleDownInput
from worker.cli.common import fail, with_client
from worker.config import load_settings
from worker.schedules import ScheduleError, parse_duration, parse_pool
from worker.temporal_client import execute_update

app = typer.Typer(no_args_is_help=True)
console = Console()


class ScaleDownCliError(Exception):
    pass


# What a command refuses (one error line, exit status 2): a bad pool or duration, a refused start.
REFUSALS = (ScheduleError, ScaleDownCliError)


@app.command("start")
def start(
    pool: str = typer.Option(..., "--pool", help="NAMESPACE/SERVICE of the serving pool."),
    to: int | None = typer.Option(None, "--to", help="Serving replica groups to keep (absolute)."),
    victim: list[str] = typer.Option([], "--victim", help="Explicit victim group or pod (repeatable)."),
    drain_deadline: str | None = typer.Option(
        None, "--drain-deadline", help="How long a victim may drain (default FLEETMEND_DRAIN_DEADLINE_S)."
    ),
    group_capacity_tokens: float | None = typer.Option(
        None, "--group-capacity-tokens", help="Tokens/s one warm group sustains (for the capacity guard)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Record every effect as planned; perform none."),
) -> None:
    """Scale POOL down now: to N replica groups (--to) or by named victims (--victim)."""
    try:
        ref = parse_pool(pool)
        inp = ScaleDownInput(
            pool=ref,
            target_groups=to,
            victims=list(victim) or None,
            drain_deadline_s=parse_duration(drain_deadline)
            if drain_deadline
            else load_settings().drain_deadline_s,
            dry_run=dry_run,
            group_capacity_tokens_per_s=group_capacity_tokens,
            requested_by=getpass.getuser(),
        )
    except ScheduleError as err:
        raise fail(str(err)) from None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in err.errors()
        )
        raise fail(f"bad scale-down: {problems}") from None
    settings = load_settings()

    async def go(client: Client) -> str:
        try:
            handle = await client.start_workflow(
                PLANNED_SCALE_DOWN_WORKFLOW,
                inp,
                id=scale_down_workflow_id(ref),
                task_queue=settings.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                static_summary=f"Scale-down of {ref.key}",
            )
        except WorkflowAlreadyStartedError:
            raise ScaleDownCliError(
                f"a scale-down of {ref.key} is already running ({scale_down_workflow_id(ref)}): "
                "see `fleetmend status`, or abort it first"
            ) from None
        return handle.id

    wid = with_client(go, settings=settings, refusals=REFUSALS)
    what = f"to {to} replica groups" if to is not None else f"removing {', '.join(victim)}"
    console.print(f"started {wid}: {ref.key} {what}{' (dry-run)' if dry_run else ''}")


def _answer(workflow_id: str, update: str, action: OperatorAction) -> ProcedureStatus:
    async def go(client: Client) -> ProcedureStatus:
        handle = client.get_workflow_handle(workflow_id)
        try:
            return await execute_update(handle, update, action, result_type=ProcedureStatus)
        except WorkflowUpdateFailedError as err:
            raise ScaleDownCliError(f"{update} refused: {err.cause or err}") from None
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise ScaleDownCliError(
                    f"no running workflow {workflow_id!r}: see `fleetmend status`"
                ) from None
            raise ScaleDownCliError(f"{update} not delivered: {err.message}") from None

    return with_client(go, refusals=REFUSALS)


@app.command("extend")
def extend(
    workflow_id: str = typer.Argument(..., help="The scale-down's workflow id."),
    by: str = typer.Option(..., "--by", help="How much longer to drain (e.g. 5m)."),
    reason: str = typer.Option("", "--reason", help="Why (goes into the record)."),
) -> None:
    """Give a drain that reached its deadline more time."""
    try:
        seconds = parse_duration(by)
    except ScheduleError as err:
        raise fail(str(err)) from None
    _answer(
        workflow_id, "extend", OperatorAction(operator=getpass.getuser(), reason=reason, extend_s=seconds)
    )
    console.print(f"{workflow_id}: drain extended by {seconds:g} s")


@app.command("accept-cut")
def accept_cut(
    workflow_id: str = typer.Argument(..., help="The scale-down's workflow id."),
    reason: str = typer.Option(..., "--reason", help="Why cutting the remaining streams is acceptable."),
) -> None:
    """Terminate the victims now, cutting what still streams (recorded in the report)."""
    _answer(workflow_id, "accept_cut", OperatorAction(operator=getpass.getuser(), reason=reason))
    console.print(f"{workflow_id}: cut accepted; terminating")


def register(root: typer.Typer) -> None:
    root.add_typer(
        app, name="scale-down", help="Planned scale-down now; extend or accept-cut at its deadline."
    )
