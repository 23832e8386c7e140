"""The gateway's desired state and Envoy's answers, in the ledger's Postgres database.

``GatewayStore`` is shared by the two sides: the gateway adapter writes a pool's policy (inside a
ledger effect) and reads Envoy's ACKs to know it was applied; the control plane reads policies
to render Envoy resources and records every ACK or NACK it receives.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import ColumnElement, Connection, Engine, and_, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert

from fleet.gateway import GatewayPolicy, JournalEntry, request_operation_ids
from gateway.outcomes import journal_entry
from ledger.models import effects_table, gateway_acks_table, gateway_policies_table, gateway_requests_table

_EFFECT_KEYS_PER_QUERY = 4000  # bound parameters per IN list

log = logging.getLogger("fleetmend.xds")

# Postgres channel a policy write notifies (payload: the pool), delivered when its transaction commits.
POLICY_CHANNEL = "fleetmend_gateway_policy"

# An Envoy counts as connected while the control plane holding its stream re-marks its rows: every
# ``ENVOY_LIVENESS_S / 3`` (``ControlPlane.run_heartbeat``). A row nobody re-marked for
# ``ENVOY_LIVENESS_S`` belonged to a control plane that died without closing it (kill -9, a lost
# node): that Envoy is not connected, and neither waiting for its ACK nor reading its admin makes
# sense. Without it one crash left a row "connected" forever, and every policy then waited on it.
ENVOY_LIVENESS_S = 30.0


def version_string(revision: int, digest: str) -> str:
    """An xDS resource version: ``p<policy revision>.<content digest>``."""
    return f"p{revision}.{digest}"


def revision_of(version: str | None) -> int:
    """The policy revision a version string carries (-1 for none or a foreign one)."""
    if not version or not version.startswith("p"):
        return -1
    head = version[1:].partition(".")[0]
    return int(head) if head.isdigit() else -1


@dataclass(frozen=True)
class StoredPolicy:
    pool: str
    revision: int
    policy: GatewayPolicy


@dataclass(frozen=True)
class EnvoyAnswer:
    """The last thing one Envoy said about one resource type."""

    node_id: str
    type_url: str
    acked_version: str | None
    nacked_version: str | None
    error: str | None
    connected: bool
    updated_at: datetime
    admin_url: str | None = None


class GatewayStore:
    def __init__(self, engine: Engine, *, liveness_s: float = ENVOY_LIVENESS_S) -> None:
        self.engine = engine
        self.liveness_s = liveness_s
        # The ledger's engine autocommits each statement; a policy write is read-then-write, so it
        # runs in a real transaction (the row lock serializes two writers of one pool).
        self._transactional = engine.execution_options(isolation_level="READ COMMITTED")

    # ------------------------------------------------------------- policies
    def put(self, pool: str, policy: GatewayPolicy) -> int:
        """Store ``policy`` as the pool's whole policy; returns its revision (unchanged if equal)."""
        body = policy.model_dump(mode="json")
        with self._transactional.begin() as conn:
            current = conn.execute(
                select(gateway_policies_table.c.revision, gateway_policies_table.c.policy)
                .where(gateway_policies_table.c.pool == pool)
                .with_for_update()
            ).first()
            if current is not None and current.policy == body:
                return int(current.revision)
            revision = int(conn.execute(text("SELECT nextval('gateway_policy_revision')")).scalar_one())
            stmt = insert(gateway_policies_table).values(pool=pool, revision=revision, policy=body)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["pool"],
                    set_={"revision": revision, "policy": body, "updated_at": text("now()")},
                )
            )
            conn.execute(text("SELECT pg_notify(:channel, :pool)"), {"channel": POLICY_CHANNEL, "pool": pool})
            return revision

    def get(self, pool: str) -> StoredPolicy | None:
        with self.engine.connect() as conn:
            row = conn.execute(
                select(gateway_policies_table).where(gateway_policies_table.c.pool == pool)
            ).first()
        if row is None:
            return None
        return StoredPolicy(row.pool, int(row.revision), GatewayPolicy.model_validate(row.policy))

    def policy_mark(self) -> tuple[int, int]:
        """The highest policy revision and the number of policy rows: one indexed query that moves
        whenever any pool's policy is written (revisions come from one sequence)."""
        t = gateway_policies_table
        with self.engine.connect() as conn:
            row = conn.execute(select(func.coalesce(func.max(t.c.revision), 0), func.count())).one()
        return int(row[0]), int(row[1])

    def listen(self, on_change: Callable[[], None], stop: threading.Event, timeout_s: float = 0.5) -> None:
        """Call ``on_change`` whenever a pool's policy is written (Postgres LISTEN on its own
        connection), until ``stop``; run it on a thread. A lost connection is opened again after a
        pause and reported as a change, since a write may have gone unheard meanwhile."""
        import psycopg

        conninfo = self.engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        failures = 0
        while not stop.is_set():
            try:
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(f"LISTEN {POLICY_CHANNEL}")
                    if failures:
                        on_change()
                    failures = 0
                    while not stop.is_set():
                        for _ in conn.notifies(timeout=timeout_s):
                            on_change()
            except psycopg.Error as err:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("listening for gateway policy writes failed (%s): retrying", err)
                stop.wait(min(5.0, 0.25 * 2 ** min(failures, 5)))

    def all(self) -> list[StoredPolicy]:
        """Every pool's policy; a row that no longer validates (written by another version) is skipped."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(gateway_policies_table)).all()
        out: list[StoredPolicy] = []
        for r in rows:
            try:
                out.append(StoredPolicy(r.pool, int(r.revision), GatewayPolicy.model_validate(r.policy)))
            except ValidationError as err:
                log.warning(
                    "gateway policy of %s (revision %s) is invalid, ignored: %s", r.pool, r.revision, err
                )
        return out

    # ---------------------------------------------------------------- acks
    def record_answer(
        self, node_id: str, type_url: str, *, acked: str | None = None, nacked: str | None = None,
        error: str | None = None, admin_url: str | None = None,
    ) -> None:  # fmt: skip
        values: dict[str, object] = {"connected": True, "updated_at": text("now()")}
        if admin_url:
            values["admin_url"] = admin_url
        if acked is not None:
            values.update(acked_version=acked, nacked_version=None, error=None)
        if nacked is not None:
            values.update(nacked_version=nacked, error=error)
        stmt = insert(gateway_acks_table).values(node_id=node_id, type_url=type_url, **values)
        with self.engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_update(index_elements=["node_id", "type_url"], set_=values))

    def mark(self, node_ids: Collection[str], *, connected: bool) -> None:
        """These Envoys' streams are open (``connected``: a control plane's heartbeat re-marks its own
        every third of ``ENVOY_LIVENESS_S``) or closed (a control plane shutting down closes all of its own)."""
        if not node_ids:
            return
        with self.engine.begin() as conn:
            conn.execute(
                update(gateway_acks_table)
                .where(gateway_acks_table.c.node_id.in_(list(node_ids)))
                .values(connected=connected, updated_at=text("now()"))
            )

    def _live(self) -> ColumnElement[bool]:
        """Connected, and re-marked by a living control plane within ``ENVOY_LIVENESS_S``."""
        t = gateway_acks_table
        return and_(t.c.connected.is_(True), t.c.updated_at > func.now() - timedelta(seconds=self.liveness_s))

    def admin_urls(self) -> list[str]:
        """The admin URLs the Envoys connected to the control plane announced (their bootstrap's node
        metadata ``admin_url``), sorted."""
        t = gateway_acks_table
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(t.c.admin_url).where(self._live(), t.c.admin_url.is_not(None)).distinct()
            ).all()
        return sorted({str(r.admin_url).rstrip("/") for r in rows if r.admin_url})

    def answers(self) -> list[EnvoyAnswer]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(gateway_acks_table, self._live().label("live"))).all()
        return [
            EnvoyAnswer(
                r.node_id,
                r.type_url,
                r.acked_version,
                r.nacked_version,
                r.error,
                bool(r.live),
                r.updated_at,
                r.admin_url,
            )
            for r in rows
        ]

    # ------------------------------------------------------------ requests
    def add_requests(self, rows: list[dict[str, object]]) -> None:
        if rows:
            with self.engine.begin() as conn:
                conn.execute(gateway_requests_table.insert(), rows)

    def requests(
        self, pool: str, *, replica: str | None = None, since: float | None = None
    ) -> list[JournalEntry]:
        t = gateway_requests_table
        query = select(t).where(t.c.pool == pool).order_by(t.c.started_at)
        if replica is not None:
            query = query.where(t.c.replica == replica)
        if since is not None:
            # Requests that *ended* at or after ``since`` (as the sim router's journal pages): a stream
            # in flight when a drain began, cut later, started before it and must be counted.
            query = query.where(t.c.started_at + t.c.duration_s >= since)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
            entries = [journal_entry(dict(r)) for r in rows]
            proposed = self._proposed(conn, {e.request_id for e in entries})
        return [
            e.model_copy(update={"effect_operation_ids": proposed[e.request_id]})
            if e.request_id in proposed
            else e
            for e in entries
        ]

    @staticmethod
    def _proposed(conn: Connection, request_ids: Collection[str]) -> dict[str, list[str]]:
        """The ledger's operation ids each request proposed (``fleet.gateway.request_operation_ids``):
        exact keys on the ledger's primary key, in chunks."""
        keys = [op for rid in sorted(request_ids) for op in request_operation_ids(rid)]
        out: dict[str, list[str]] = {}
        t = effects_table
        for i in range(0, len(keys), _EFFECT_KEYS_PER_QUERY):
            chunk = keys[i : i + _EFFECT_KEYS_PER_QUERY]
            for (op_id,) in conn.execute(select(t.c.op_id).where(t.c.op_id.in_(chunk))).all():
                out.setdefault(op_id.rsplit("/", 1)[0], []).append(op_id)
        return {rid: sorted(ops) for rid, ops in out.items()}

    def prune_requests(self, older_than: float) -> int:
        """Delete requests that started before ``older_than`` (unix s); returns how many."""
        t = gateway_requests_table
        with self.engine.begin() as conn:
            return int(conn.execute(delete(t).where(t.c.started_at < older_than)).rowcount or 0)


def envoy_admin_urls(configured: Sequence[str], store: GatewayStore | None) -> list[str]:
    """Where Envoy's own view (routing set, host health, counters) is read: the configured admin URLs
    (``FLEETMEND_GATEWAY_ADMIN_URLS``), else those of every Envoy connected to the control plane."""
    if configured:
        return [u.rstrip("/") for u in configured]
    return store.admin_urls() if store is not None else []
