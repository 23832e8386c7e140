"""``fleetmend demo``: a guided incident on the embedded stack (what ``make demo`` runs)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from worker import jsonlog
from worker.cli.common import UNAVAILABLE, connects_itself, fail
from worker.config import load_settings
from worker.devstack.scenarios import DEFAULT_SCENARIO, SCENARIOS
from worker.processes import StackError
from worker.startup_checks import StartupCheckError

console = Console()


def scenario_table() -> Table:
    table = Table(title="fleetmend demo scenarios", title_justify="left")
    table.add_column("scenario", style="bold", no_wrap=True)
    table.add_column("what happens", overflow="fold")
    table.add_column("passed when", overflow="fold")
    for s in SCENARIOS.values():
        name = f"{s.name} (default)" if s.name == DEFAULT_SCENARIO else s.name
        table.add_row(name, s.summary, s.passed_when)
    return table


def demo(
    scenario: str = typer.Option(
        DEFAULT_SCENARIO, "--scenario", "-s", help="Which incident to stage (--list)."
    ),
    report: Path | None = typer.Option(None, "--report", help="Write the JSON report to this file."),
    keep_running: bool = typer.Option(
        False, "--keep-running", help="Leave the stack up after the summary (Ctrl-C stops it)."
    ),
    list_: bool = typer.Option(False, "--list", help="Describe the scenarios and exit."),
) -> None:
    """Stage a GPU-node loss (or another scenario) on the embedded stack and watch fleetmend handle it.

    Starts Temporal + Web UI, Postgres, the simulated fleet, the webhook and the
    worker; loads the fleet, causes the fault, lets the alert open the incident,
    shows the phases and decisions live, and ends with a summary. Exit status 0
    only when the verdict is `passed`."""
    if list_:
        console.print(scenario_table())
        return
    chosen = SCENARIOS.get(scenario)
    if chosen is None:
        raise fail(
            f"unknown scenario {scenario!r}; choose one of: {', '.join(SCENARIOS)} "
            "(fleetmend demo --list describes them)"
        )
    from worker.devstack.demo import DemoError, run_demo  # the whole stack: loaded for this command only

    connects_itself()  # its stack's Temporal client: leave once the stack is down (worker.cli.common.leave)
    settings = load_settings()
    jsonlog.configure(file=settings.state_dir / "demo-logs" / "fleetmend.log")

    async def main() -> dict[str, object]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_demo(
            settings, chosen, console=console, keep_running=keep_running, stop=stop, report_path=report
        )

    try:
        result = asyncio.run(main())
    except (StackError, StartupCheckError, DemoError) as err:
        raise fail(str(err), UNAVAILABLE) from None
    raise typer.Exit(0 if result["verdict"] == "passed" else 1)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
