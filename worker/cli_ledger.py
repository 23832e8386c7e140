"""`fleetmend ledger` commands (being built; see the README's status section)."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)
