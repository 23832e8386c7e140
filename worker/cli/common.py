"""What every ``fleetmend`` command shares: one way to fail, one way to reach Temporal.

A command that cannot do what was asked prints one line on stderr,
``error: <what went wrong and the fix>``, and ends with an exit status: 2 for a
request fleetmend refuses (a bad option, a rejected Update, an unknown id), 1 when
the world is not as the command needs it (Temporal unreachable, a part that did
not start). Commands ``raise fail(...)``, so the type checker sees the command end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NoReturn, TypeVar

import typer
from rich.console import Console

from worker.config import Settings, load_settings

if TYPE_CHECKING:  # Temporal's client is imported by the commands that reach it (start-up time of the rest)
    from temporalio.client import Client

REFUSED = 2  # the request was wrong or was refused: nothing changed
UNAVAILABLE = 1  # something the command needs is not there (Temporal, a database, a port)

err_console = Console(stderr=True)
T = TypeVar("T")
_connected = False  # this process tried to make a Temporal client (see ``leave``)


def fail(message: str, code: int = REFUSED) -> typer.Exit:
    """Print ``error: message`` on stderr (one line, whatever the terminal width) and return the exit to raise."""
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    return typer.Exit(code)


async def temporal_client(settings: Settings) -> Client:
    """The client every command uses (``worker.temporal_client.connect``); unreachable = one error line, exit 1."""
    from worker.startup_checks import unreachable_message
    from worker.temporal_client import connect

    global _connected
    _connected = True  # set before trying: a failed connect has already started the core runtime's threads
    try:
        return await connect(settings)
    except Exception as err:
        raise fail(unreachable_message(settings, err), UNAVAILABLE) from None


def connected() -> bool:
    return _connected


def connects_itself() -> None:
    """This command makes its Temporal client by itself (``fleetmend worker``): it leaves like a command
    that made one through ``temporal_client`` (``leave``), once its own shutdown is done."""
    global _connected
    _connected = True


def leave(code: int) -> NoReturn:
    """End the process now with ``code``, output flushed.

    The Temporal client's core runtime keeps native threads that can race Python's interpreter
    teardown (a "PyGILState_Release" fatal error: exit status -6 after the answer was printed, or in
    place of an error's exit status 1 or 2). A one-shot command that made a client has nothing left
    to clean up once it answered, so ``fleetmend`` leaves this way (``worker.cli.app``).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


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
