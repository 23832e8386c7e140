"""What every ``fleetmend`` command shares: one way to fail, one way to reach Temporal.

A command that cannot do what was asked prints one line on stderr,
``error: <what went wrong and the fix>``, and ends with an exit status: 2 for a
request fleetmend refuses (a bad option, a rejected Update, an unknown id), 1 when
the world is not as the command needs it (Temporal unreachable, a part that did
not start). Commands ``raise fail(...)``, so the type checker sees the command end.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer
from rich.console import Console
from temporalio.client import Client

from worker.config import Settings, load_settings
from worker.startup_checks import unreachable_message
from worker.temporal_client import connect

REFUSED = 2  # the request was wrong or was refused: nothing changed
UNAVAILABLE = 1  # something the command needs is not there (Temporal, a database, a port)

err_console = Console(stderr=True)
T = TypeVar("T")


def fail(message: str, code: int = REFUSED) -> typer.Exit:
    """Print ``error: message`` on stderr (one line, whatever the terminal width) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    return typer.Exit(code)


async def temporal_client(settings: Settings) -> Client:
    """The client every command uses (``worker.temporal_client.connect``); unreachable = one error line, exit 1."""
    try:
        return await connect(settings)
    except Exception as err:
        raise fail(unreachable_message(settings, err), UNAVAILABLE) from None


def with_client(
    work: Callable[[Client], Awaitable[T]],
    *,
    settings: Settings | None = None,
    refusals: tuple[type[Exception], ...] = (),
) -> T:
    """Connect, run ``work(client)`` to the end, return its result.

    An exception of a type in ``refusals`` (the command's own "bad request" errors) becomes one error line
    with exit status 2.
    """
    settings = settings or load_settings()

    async def run() -> T:
        return await work(await temporal_client(settings))

    try:
        return asyncio.run(run())
    except refusals as err:
        raise fail(str(err)) from None
