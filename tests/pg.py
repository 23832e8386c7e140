"""Postgres for tests: one server per session, a fresh database per test.

Loaded as a pytest plugin by ``tests/conftest.py``, so every test package can use the
fixtures ``pg_server`` (session), ``pg_url`` (an empty database of its own) and
``ledger_url`` (a database migrated to the ledger's head schema). Where the server comes
from (env URL, testcontainers, embedded) is ``ledger.scratch``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ledger.scratch import ENV_URL, PgServer, acquire_server, docker_engine_answers, start_embedded_server

__all__ = ["ENV_URL", "PgServer", "acquire_server", "docker_engine_answers", "start_embedded_server"]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = acquire_server()
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """An empty database of this test's own on the session server."""
    url = pg_server.create_database()
    yield url
    pg_server.drop_database(url)


@pytest.fixture(scope="session")
def migrated_template(pg_server: PgServer) -> str:
    """A database migrated to the ledger's head schema once per session, which ``ledger_url`` copies
    (``CREATE DATABASE ... TEMPLATE``: a fraction of the second that running the migrations takes)."""
    from ledger.migrate import upgrade_head

    url = pg_server.create_database("ledger_template")
    upgrade_head(url)
    return url


@pytest.fixture
def ledger_url(pg_server: PgServer, migrated_template: str) -> Iterator[str]:
    """A database of this test's own with the ledger schema at head (a copy of ``migrated_template``)."""
    url = pg_server.create_database(template=migrated_template)
    yield url
    pg_server.drop_database(url)


def dispose_all(*engines: Any) -> None:
    for engine in engines:
        engine.dispose()
