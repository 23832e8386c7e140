"""The ``fleetmend`` command line (typer + rich).

Each command group lives in its own module (``worker/cli/*.py``) so a newcomer
finds the code behind ``fleetmend X`` in ``worker/cli/X.py``.
"""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from worker.cli import (
    alert,
    breaker,
    common,
    demo,
    dev,
    gateway,
    ledger,
    model,
    operate,
    readiness,
    scale_down,
    schedule,
    sim,
    worker,
)
from worker.config import adopt_kept_stack, load_settings


class _Fleetmend(typer.Typer):
    """The console script's entry point: a command that made a Temporal client leaves at once when done."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as done:
            if common.connected():
                code = done.code
                common.leave(code if isinstance(code, int) else (0 if code is None else 1))
            raise


app = _Fleetmend(
    name="fleetmend",
    help="Keep an LLM inference fleet serving when GPUs fail: durable replica-loss recovery "
    "and planned scale-down on Temporal, with an exactly-once effect ledger.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
console = Console()

# Commands that start their own stack or server: they read only their own settings, never a kept demo's.
STACK_COMMANDS = frozenset({"dev", "demo", "worker", "webhook", "sim", "gateway"})


@app.callback()
def _root(ctx: typer.Context) -> None:
    # Every other command (status, approve, alert, ledger, schedule, config, ...) finds a running
    # `fleetmend demo`'s stack by itself, as if its printed export lines were set (worker.config.adopt_kept_stack).
    if ctx.invoked_subcommand not in STACK_COMMANDS:
        adopt_kept_stack()


app.add_typer(ledger.app, name="ledger", help="Audit and reconcile the effect ledger.")
app.add_typer(model.app, name="model", help="Capacity what-if models (ramp-back planning).")
app.add_typer(gateway.app, name="gateway", help="The Envoy gateway's control plane and bootstrap.")
app.add_typer(breaker.app, name="breaker", help="The fleet's removal breaker: status, reset.")
dev.register(app)
demo.register(app)
operate.register(app)
sim.register(app)
worker.register(app)
alert.register(app)
schedule.register(app)
readiness.register(app)
scale_down.register(app)


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
