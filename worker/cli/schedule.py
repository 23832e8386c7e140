"""``fleetmend schedule``: scheduled planned scale-downs (Temporal Schedules, overlap policy skip)."""

from __future__ import annotations

import json

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from worker import schedules
from worker.cli.common import fail, with_client
from worker.config import load_settings
from worker.schedules import ScaleDownSchedule, ScheduleError

app = typer.Typer(no_args_is_help=True)
console = Console()
REFUSALS = (ScheduleError,)  # a bad schedule or id: one error line, exit status 2


@app.command("create")
def create(
    pool: str = typer.Option(..., "--pool", help="NAMESPACE/SERVICE of the serving pool."),
    to: int = typer.Option(..., "--to", help="Serving replica groups to keep (absolute)."),
    cron: str = typer.Option(..., "--cron", help="Cron spec, e.g. '0 2 * * *' (02:00 daily)."),
    timezone: str = typer.Option("UTC", "--timezone", help="IANA time zone of the cron spec."),
    jitter: str = typer.Option("0", "--jitter", help="Random delay up to this (30s, 5m, 1h)."),
    drain_deadline: str | None = typer.Option(
        None, "--drain-deadline", help="How long a victim may drain (default FLEETMEND_DRAIN_DEADLINE_S)."
    ),
    group_capacity_tokens: float | None = typer.Option(
        None, "--group-capacity-tokens", help="Tokens/s one warm group sustains (for the capacity guard)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Record every effect as planned; perform none."),
    note: str = typer.Option("", "--note", help="Why this schedule exists."),
    schedule_id: str | None = typer.Option(
        None, "--id", help="Schedule id (default scale-down/NS/SVC/to-N)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the created schedule as JSON."),
) -> None:
    """Create a schedule that scales POOL down to N replica groups on CRON."""
    try:
        req = ScaleDownSchedule(
            pool=schedules.parse_pool(pool),
            to=to,
            cron=cron,
            timezone=timezone,
            jitter_s=schedules.parse_duration(jitter),
            drain_deadline_s=schedules.parse_duration(drain_deadline)
            if drain_deadline
            else load_settings().drain_deadline_s,
            dry_run=dry_run,
            group_capacity_tokens_per_s=group_capacity_tokens,
            note=note,
            schedule_id=schedule_id,
        )
    except ScheduleError as err:
        raise fail(str(err)) from None
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise fail(f"bad schedule: {problems}") from None
    settings = load_settings()
    created = with_client(
        lambda c: schedules.create_schedule(c, req, settings.task_queue), settings=settings, refusals=REFUSALS
    )
    if as_json:
        typer.echo(json.dumps({"id": created, **req.model_dump(mode="json")}))
        return
    console.print(
        f"created schedule [bold]{created}[/]: {req.pool.key} -> {req.to} replica groups on '{req.cron}' "
        f"({req.timezone}), drain deadline {req.drain_deadline_s:g} s, overlap: skip"
    )


@app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the scale-down schedules with their next runs."""
    views = with_client(schedules.list_schedules, refusals=REFUSALS)
    if as_json:
        typer.echo(json.dumps([v.model_dump(mode="json") for v in views]))
        return
    table = Table(title="fleetmend scale-down schedules")
    for column in ("id", "pool", "to", "cron", "tz", "state", "next run", "note"):
        # Ids and crons are copied into other commands: fold them, never cut them with an ellipsis.
        table.add_column(column, overflow="fold" if column in ("id", "pool", "cron") else "ellipsis")
    for v in views:
        table.add_row(
            v.id,
            v.pool or "",
            "" if v.to is None else str(v.to),
            ", ".join(v.cron),
            v.timezone,
            "paused" if v.paused else "active",
            v.next_runs[0].isoformat(timespec="seconds") if v.next_runs else "",
            v.note,
        )
    console.print(table)


@app.command("describe")
def describe(
    schedule_id: str = typer.Argument(..., help="Schedule id (see `fleetmend schedule list`)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a schedule: spec, state and note, next and recent runs."""
    view = with_client(lambda c: schedules.describe_schedule(c, schedule_id), refusals=REFUSALS)
    if as_json:
        typer.echo(view.model_dump_json())
        return
    table = Table(title=f"schedule {view.id}", show_header=False)
    for key, value in view.model_dump(mode="json").items():
        table.add_row(key, json.dumps(value) if isinstance(value, list | dict) else str(value))
    console.print(table)


@app.command("pause")
def pause(
    schedule_id: str = typer.Argument(...),
    note: str = typer.Option(..., "--note", help="Why it is paused (shown in list and the UI)."),
) -> None:
    """Pause a schedule (runs in progress continue)."""
    with_client(lambda c: schedules.pause_schedule(c, schedule_id, note), refusals=REFUSALS)
    console.print(f"paused {schedule_id}: {note}")


@app.command("unpause")
def unpause(
    schedule_id: str = typer.Argument(...),
    note: str = typer.Option(..., "--note", help="Why it runs again."),
) -> None:
    """Resume a paused schedule."""
    with_client(lambda c: schedules.unpause_schedule(c, schedule_id, note), refusals=REFUSALS)
    console.print(f"unpaused {schedule_id}: {note}")


@app.command("trigger")
def trigger(schedule_id: str = typer.Argument(...)) -> None:
    """Run the scale-down now (skipped if one of this schedule is still running)."""
    with_client(lambda c: schedules.trigger_schedule(c, schedule_id), refusals=REFUSALS)
    console.print(f"triggered {schedule_id}")


@app.command("delete")
def delete(schedule_id: str = typer.Argument(...)) -> None:
    """Delete a schedule (a run in progress keeps running; abort it with its `abort` Update)."""
    with_client(lambda c: schedules.delete_schedule(c, schedule_id), refusals=REFUSALS)
    console.print(f"deleted {schedule_id}")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="schedule", help="Scheduled planned scale-downs (Temporal Schedules).")
