"""Apply and check the ledger schema (alembic migrations shipped inside the package).

The dev stack calls :func:`upgrade_head` at start; the worker calls :func:`is_at_head`
and refuses to start with a clear message when the schema is behind.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine

_MIGRATIONS = Path(__file__).parent / "migrations"
VERSION_TABLE = "ledger_alembic_version"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the ledger ships at least one migration"
    return head


def _engine(url: str | Engine) -> tuple[Engine, bool]:
    if isinstance(url, Engine):
        return url, False
    return create_engine(url, poolclass=None), True


def upgrade_head(url: str | Engine) -> str:
    """Bring the ledger schema at ``url`` up to the newest migration; return that revision."""
    engine, owned = _engine(url)
    try:
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    finally:
        if owned:
            engine.dispose()
    return head_revision()


def current_revision(url: str | Engine) -> str | None:
    """The schema revision recorded in the database, or None when the ledger was never migrated."""
    engine, owned = _engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return ctx.get_current_revision()
    finally:
        if owned:
            engine.dispose()


def is_at_head(url: str | Engine) -> bool:
    """True when the database holds the newest ledger schema this code expects."""
    return current_revision(url) == head_revision()
