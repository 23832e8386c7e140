"""``fleetmend worker``: run the worker against a Temporal cluster and the ledger database."""

from __future__ import annotations

import asyncio
import signal

import typer

from worker import jsonlog
from worker.cli.common import UNAVAILABLE, connects_itself, fail
from worker.config import Settings, load_settings
from worker.processes import StackError
from worker.startup_checks import StartupCheckError


async def _run(settings: Settings, database_url: str) -> None:
    # Every workflow and activity: loaded for this command only (the operator's commands start without them).
    from worker.worker import metrics_runtime, run_worker

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await run_worker(settings, stop=stop, database_url=database_url, runtime=metrics_runtime(settings))


def worker(
    log_level: str = typer.Option("INFO", "--log-level", help="Python log level of the JSON logs on stderr."),
) -> None:
    """Run the fleetmend worker (workflows + activities) until SIGINT/SIGTERM.

    Checks at start-up that Temporal answers, the namespace exists, fleetmend's
    search attributes are registered and the ledger schema is at head."""
    jsonlog.configure(log_level)
    # Its graceful shutdown (in-flight activities finish, the fast path lets go of its Lease) is done when
    # ``run_worker`` returns; the process then leaves at once, before the Temporal core's native threads
    # can race the interpreter's teardown (a "PyGILState_Release" abort, exit status -6).
    connects_itself()
    settings = load_settings()
    database_url = settings.database_url_value()
    try:
        if database_url is None:
            raise StartupCheckError(
                "FLEETMEND_DATABASE_URL is not set: the worker records every action in the ledger; point it "
                "at Postgres (postgresql+psycopg://user:pass@host/db), or use `fleetmend dev`, which runs an "
                "embedded one"
            )
        asyncio.run(_run(settings, database_url))
    except (StartupCheckError, StackError) as err:
        raise fail(str(err), UNAVAILABLE) from None


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("worker")(worker)
