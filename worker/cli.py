"""The ``fleetmend`` command line (typer + rich).

Each command group lives in its own module (``worker/cli_*.py``) so a newcomer
finds the code behind ``fleetmend X`` in ``worker/cli_X.py``.
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from worker import (
    cli_alert,
    cli_demo,
    cli_dev,
    cli_ledger,
    cli_model,
    cli_operate,
    cli_readiness,
    cli_scale_down,
    cli_schedule,
    cli_sim,
    cli_worker,
)
from worker.config import load_settings

app = typer.Typer(
    name="fleetmend",
    help="Keep an LLM inference fleet serving when GPUs fail: durable replica-loss recovery "
    "and planned scale-down on Temporal, with an exactly-once effect ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()

app.add_typer(cli_ledger.app, name="ledger", help="Audit and reconcile the effect ledger.")
app.add_typer(cli_model.app, name="model", help="Capacity what-if models (ramp-back planning).")
cli_dev.register(app)
cli_demo.register(app)
cli_operate.register(app)
cli_sim.register(app)
cli_worker.register(app)
cli_alert.register(app)
cli_schedule.register(app)
cli_readiness.register(app)
cli_scale_down.register(app)


@app.command("config")
def show_config(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Print the effective configuration (FLEETMEND_* environment), secrets masked."""
    values = load_settings().masked()
    if as_json:
        typer.echo(json.dumps(values, indent=2, default=str))
        return
    table = Table(title="fleetmend configuration (env prefix FLEETMEND_)")
    table.add_column("setting")
    table.add_column("value")
    for name, value in values.items():
        table.add_row(f"FLEETMEND_{name.upper()}", "" if value is None else str(value))
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
