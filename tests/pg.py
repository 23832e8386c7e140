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


@pytest.fixture
def ledger_url(pg_url: str) -> str:
    """A database of this test's own with the ledger schema migrated to head."""
    from ledger.migrate import upgrade_head

    upgrade_head(pg_url)
    return pg_url


def dispose_all(*engines: Any) -> None:
    for engine in engines:
        engine.dispose()
