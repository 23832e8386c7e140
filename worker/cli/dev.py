"""``fleetmend dev``: the embedded stack in the foreground (``fleetmend demo`` lives in ``worker/cli/demo.py``)."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING
from urllib.parse import quote

import typer
from rich.console import Console
from rich.table import Table

from worker import jsonlog
from worker.cli.common import UNAVAILABLE, connects_itself, fail
from worker.config import Settings, load_settings
from worker.processes import StackError
from worker.startup_checks import StartupCheckError

if TYPE_CHECKING:
    from worker.devstack.stack import DevStack

console = Console()


def workflow_ui_url(settings: Settings, workflow_id: str) -> str:
    ns = quote(settings.temporal_namespace, safe="")
    return f"{settings.temporal_ui_url.rstrip('/')}/namespaces/{ns}/workflows/{quote(workflow_id, safe='')}"


def _endpoint_table(stack: DevStack) -> Table:
    table = Table(title="fleetmend embedded stack", title_justify="left")
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("where", style="cyan", overflow="fold")
    for row in stack.endpoints():
        table.add_row(row.what, row.url)
    return table


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _serve(settings: Settings) -> None:
    from worker.devstack.stack import DevStack  # the whole stack: loaded for this command only

    stop = asyncio.Event()
    _stop_on_signals(stop)  # a Ctrl-C during start-up stops the stack right after it is up
    async with DevStack(settings) as stack:
        console.print(_endpoint_table(stack))
        console.print(
            "[green]fleetmend dev is up.[/] Ctrl-C stops every part; state is kept for the next start."
        )
        stopped = asyncio.create_task(stop.wait())
        died = asyncio.create_task(stack.watch())
        await asyncio.wait({stopped, died}, return_when=asyncio.FIRST_COMPLETED)
        for task in (stopped, died):
            task.cancel()
        console.print("stopping ...")
        if not stop.is_set():  # a part died: stop the rest and say which
            reason = died.result()
            await stack.stop()
            raise StackError(f"{reason}; every other part was stopped")
    console.print("stopped.")


def _run(coro_factory: object) -> None:
    try:
        asyncio.run(coro_factory)  # type: ignore[arg-type]
    except (StackError, StartupCheckError) as err:
        raise fail(str(err), UNAVAILABLE) from None


def dev() -> None:
    """Run the embedded stack in the foreground (Temporal + Web UI, Postgres, sim, webhook, worker).

    Temporal dev server with its Web UI, the ledger Postgres (migrated), the sim,
    the webhook API and the worker, each waited on until it answers. Ctrl-C stops
    everything; a restart keeps workflow history and the ledger."""
    connects_itself()  # its stack's Temporal client: leave once the stack is down (worker.cli.common.leave)
    settings = load_settings()
    jsonlog.configure(file=settings.state_dir / "logs" / "fleetmend.log")
    _run(_serve(settings))


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("dev")(dev)
