"""``fleetmend readiness``: run the per-pool ReadinessKeeper that keeps ``fleetmend.io/serving-ready`` in sync."""

from __future__ import annotations

import json

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from fleet.incident import PoolRef
from fleet.readiness import ReadinessThresholds
from worker.cli.common import fail, with_client
from worker.config import load_settings
from worker.schedules import ScheduleError, parse_duration, parse_pool

app = typer.Typer(no_args_is_help=True)
console = Console()


class ReadinessCliError(Exception):
    pass


# What a command refuses (one error line, exit status 2): a bad pool or duration, a refused start.
REFUSALS = (ScheduleError, ReadinessCliError)


@app.command("start")
def start(
    pool: str = typer.Option(..., "--pool", help="NAMESPACE/SERVICE of the serving pool."),
    interval: str = typer.Option("2s", "--interval", help="Time between samples (e.g. 2s)."),
    kv_ceiling: float = typer.Option(0.8, "--kv-ceiling", help="Not ready at or above this KV-cache usage."),
    kv_release: float = typer.Option(0.7, "--kv-release", help="Ready again only below this KV usage."),
    queue_bound: int = typer.Option(5, "--queue-bound", help="Not ready at or above this many waiting."),
    queue_release: int = typer.Option(2, "--queue-release", help="Ready again only at or below this queue."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Record gate writes as planned; perform none."),
) -> None:
    """Start keeping the pool's serving-ready readiness gates in sync with its engines' KV and queue."""
    # The keeper's workflow module (and the workflow sandbox it brings) loads for these commands only.
    from workflows.readiness_keeper import (
        READINESS_KEEPER_WORKFLOW,
        KeeperInput,
        readiness_keeper_workflow_id,
    )

    try:
        ref = parse_pool(pool)
        inp = KeeperInput(
            pool=ref,
            interval_s=parse_duration(interval),
            dry_run=dry_run,
            thresholds=ReadinessThresholds(
                kv_ceiling=kv_ceiling,
                kv_release=kv_release,
                queue_bound=queue_bound,
                queue_release=queue_release,
            ),
        )
    except ScheduleError as err:
        raise fail(str(err)) from None
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
        raise fail(f"bad readiness settings: {problems}") from None
    settings = load_settings()

    async def go(client: Client) -> str:
        try:
            handle = await client.start_workflow(
                READINESS_KEEPER_WORKFLOW,
                inp,
                id=readiness_keeper_workflow_id(ref),
                task_queue=settings.task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                static_summary=f"Readiness gates of {ref.key}",
            )
        except WorkflowAlreadyStartedError:
            raise ReadinessCliError(
                f"a readiness keeper already runs for {ref.key}; `fleetmend readiness stop --pool {ref.key}` first"
            ) from None
        return handle.id

    wid = with_client(go, settings=settings, refusals=REFUSALS)
    console.print(f"readiness keeper {wid} started for {inp.pool.key} (every {inp.interval_s:g} s)")


@app.command("status")
def status(
    pool: str = typer.Option(..., "--pool", help="NAMESPACE/SERVICE of the serving pool."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Every replica's readiness verdict and the recent gate writes."""
    from workflows.readiness_keeper import KeeperStatus, readiness_keeper_workflow_id

    ref = _pool(pool)

    async def go(client: Client) -> KeeperStatus:
        try:
            return await client.get_workflow_handle(readiness_keeper_workflow_id(ref)).query(
                "status", result_type=KeeperStatus
            )
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise ReadinessCliError(
                    f"no readiness keeper for {ref.key}: `fleetmend readiness start --pool {ref.key}`"
                ) from None
            raise

    result = with_client(go, refusals=REFUSALS)
    if as_json:
        typer.echo(result.model_dump_json())
        return
    table = Table(title=f"readiness of {ref.key} ({result.samples} samples, {result.writes} gate writes)")
    table.add_column("pod", overflow="fold")
    table.add_column("verdict")
    for pod, verdict in sorted(result.verdicts.items()):
        table.add_row(pod, verdict)
    for pod, why in sorted(result.skipped.items()):
        table.add_row(pod, f"left alone: {why}")
    console.print(table)
    if result.recent_writes:
        console.print(json.dumps([w.model_dump() for w in result.recent_writes[-10:]], indent=1))


@app.command("stop")
def stop(pool: str = typer.Option(..., "--pool", help="NAMESPACE/SERVICE of the serving pool.")) -> None:
    """Stop the keeper (the gates keep their last value)."""
    from workflows.readiness_keeper import readiness_keeper_workflow_id

    ref = _pool(pool)

    async def go(client: Client) -> None:
        handle = client.get_workflow_handle(readiness_keeper_workflow_id(ref))
        try:
            desc = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise ReadinessCliError(f"no readiness keeper for {ref.key}") from None
            raise
        if desc.status != WorkflowExecutionStatus.RUNNING:
            raise ReadinessCliError(f"the readiness keeper of {ref.key} is not running")
        await handle.cancel()

    with_client(go, refusals=REFUSALS)
    console.print(f"readiness keeper of {ref.key} stopped; the gates keep their last value")


def _pool(text: str) -> PoolRef:
    try:
        return parse_pool(text)
    except ScheduleError as err:
        raise fail(str(err)) from None


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="readiness", help="Keep readiness gates = 'can take more work' (per pool).")
