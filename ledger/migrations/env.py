"""Alembic environment for the ledger schema.

Run through :mod:`ledger.migrate` (``upgrade_head(url)``), which hands over an open
connection. The ``alembic`` CLI works too:
``alembic -c ledger/alembic.ini -x url=postgresql+psycopg://... upgrade head``.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, create_engine

from ledger.models import metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, version_table="ledger_alembic_version")
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
        or os.environ.get("FLEETMEND_DATABASE_URL")
    )
    if not url:
        raise SystemExit(
            "no database URL: pass -x url=postgresql+psycopg://... or set FLEETMEND_DATABASE_URL"
        )
    engine = create_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()
