"""The effect ledger's one entry point: :meth:`EffectLedger.perform`.

Protocol per operation id (READ COMMITTED; every guard is one conditional statement
that re-reads the latest row version, and the primary key is the arbiter):

1. **claim** — ``INSERT … ON CONFLICT (op_id) DO NOTHING RETURNING``: the row is
   created already leased to us with fencing token 1. It is durably committed before
   the target is touched.
2. **apply** — outside any transaction, with the op id for the target's idempotency key.
3. **record** — ``UPDATE … WHERE op_id AND fence = ours AND state = 'claimed'``. Zero
   rows means our lease was taken over: nothing is written, :class:`FencedOut` is raised.

The fast path is exactly those two single-statement transactions. Everything else
is recovery: a caller that finds the row applied/failed returns/raises the stored
outcome; a live lease is waited on; an expired lease is taken over with ``fence+1``
and — because the previous holder may have applied — the new holder **probes** the
target before applying (kinds without a probe follow their declared delivery).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

import psycopg
from pydantic import BaseModel
from sqlalchemy import (
    Connection,
    Engine,
    Interval,
    Table,
    bindparam,
    create_engine,
    func,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.postgresql.psycopg import dialect as psycopg_dialect
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

from ledger.canonical import canonical_json, canonical_object, fingerprint_of_canonical, to_json_object
from ledger.effect import Attempt, Effect, EffectContext
from ledger.errors import (
    DivergentOperation,
    EffectAttemptError,
    EffectFailed,
    FencedOut,
    InvalidEffectRequest,
    LedgerUnavailable,
    NeedsOperator,
    OperationInProgress,
    PermanentEffectError,
)
from ledger.metrics import FENCE_REJECTIONS, PERFORMS, PROBES
from ledger.models import (
    MAX_OPERATION_ID_LENGTH,
    Delivery,
    DivergenceRecord,
    EffectRecord,
    EffectState,
)
from ledger.outcome import EffectOutcome

log = logging.getLogger("fleetmend.ledger")

EFFECTS = cast(Table, EffectRecord.__table__)
DIVERGENCES = cast(Table, DivergenceRecord.__table__)
_C = EFFECTS.c

_CLAIM_COLUMNS = (
    "op_id kind target params fingerprint delivery state attempts fence lease_owner action_signature "
    "workflow_id run_id step request_id alert_fingerprints requested_by"
).split()


def _compiled(statement: Any) -> str:
    """SQL text of a Core statement for the driver. The two statements on every perform's path are
    compiled once here: building and cache-keying them per call cost more than the round trip."""
    return str(statement.compile(dialect=psycopg_dialect()))


# 1. claim: the row is created already leased to us, fence 1.
_CLAIM_SQL = _compiled(
    pg_insert(EFFECTS)
    .values(
        {name: bindparam(name) for name in _CLAIM_COLUMNS}
        | {"lease_expires_at": func.now() + bindparam("lease", type_=Interval)}
    )
    .on_conflict_do_nothing(index_elements=["op_id"])
    .returning(_C.fence)
)
# 3. record: only under our fencing token, only while still claimed.
_RECORD_SQL = _compiled(
    update(EFFECTS)
    .where(
        _C.op_id == bindparam("op_id"),
        _C.fence == bindparam("fence"),
        _C.state == literal_column(f"'{EffectState.CLAIMED.value}'"),
    )
    .values(
        state=bindparam("state"),
        result=bindparam("result"),
        error=bindparam("error"),
        lease_owner=null(),
        lease_expires_at=null(),
        updated_at=func.now(),
        resolved_at=func.now(),
    )
    .returning(_C.attempts, _C.divergences, _C.created_at, _C.updated_at, _C.resolved_at)
)

DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_WAIT_SECONDS = 10.0
# Do not start an apply when less than this share of our lease is left by our own clock.
_LEASE_SAFETY = 0.8


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20, pre_ping: bool = False) -> Engine:
    """An engine fit for the ledger: autocommit READ COMMITTED statements, synchronous commit forced on,
    a shared pool.

    No pre-ping (it would double the round trips of every perform); a connection broken
    by a database restart is discarded on first use and the caller's retry gets a fresh one.
    """
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=30,
        # Most recently used first: a quiet worker keeps reusing one warm connection (and its prepared
        # statements) instead of cycling through the whole pool.
        pool_use_lifo=True,
        # Readers outside the ledger's hot path (the rig's and the demo's gateway reads) ask for a
        # ping, so a database restart costs them nothing.
        pool_pre_ping=pre_ping,
        # Every ledger write is one conditional statement, so each runs as its own READ COMMITTED
        # transaction (one round trip, durable on return); multi-statement work asks for a transaction.
        isolation_level="AUTOCOMMIT",
        connect_args={
            "connect_timeout": 10,
            "application_name": "fleetmend-ledger",
            # The intent must be durable before the external call (Postgres docs on async commit).
            "options": r"-c synchronous_commit=on -c default_transaction_isolation=read\ committed",
        },
    )


def default_owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class EffectLedger:
    """Performs external effects at most once per operation id, and resolves every intent.

    Thread-safe and multi-process safe: share one instance per process (it owns a
    connection pool). ``owner`` identifies this instance's leases in audit.
    """

    def __init__(
        self,
        engine: Engine | str,
        *,
        owner: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        wait_seconds: float = DEFAULT_WAIT_SECONDS,
    ) -> None:
        self.engine = make_engine(engine) if isinstance(engine, str) else engine
        # Single-statement transactions run in autocommit: one round trip each, durable on return.
        # Engines from make_engine are autocommit already; a caller's own engine is switched per use.
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._transactional = self.engine.execution_options(isolation_level="READ COMMITTED")
        self.owner = owner or default_owner()
        self.lease_seconds = lease_seconds
        self.wait_seconds = wait_seconds
        # perform() calls in flight in this instance, per op id. A lease of ours on an op with no other
        # call in flight belongs to an attempt that already ended (it raised), so a retry may take it over
        # at once instead of waiting for the lease to expire. Counted from *before* the claim, so a
        # concurrent call of the same op in this process never mistakes a fresh claim for an ended one.
        self._in_flight: Counter[str] = Counter()
        self._in_flight_lock = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ public API

    def perform(
        self,
        op_id: str,
        kind: str,
        target: str,
        params: Mapping[str, Any] | BaseModel,
        effect: Effect,
        *,
        context: EffectContext | None = None,
        dry_run: bool = False,
        lease_seconds: float | None = None,
    ) -> EffectOutcome:
        """Perform ``effect`` for ``op_id`` at most once and return the recorded outcome.

        Returns the outcome (``applied`` — first time and every repeat alike — or
        ``planned`` for a dry run). Raises :class:`EffectFailed`, :class:`DivergentOperation`
        or :class:`NeedsOperator` (non-retryable, recorded) or a
        :class:`~ledger.errors.RetryableLedgerError` (retry the same call).
        """
        request = _Request.build(
            op_id, kind, target, params, effect, context, lease_seconds or self.lease_seconds
        )
        with self._in_flight_lock:
            self._in_flight[op_id] += 1
        try:
            if dry_run:
                outcome = self._plan(request)
            else:
                outcome = self._perform(request)
        except (
            OperationalError,
            InterfaceError,
            PoolTimeoutError,
            psycopg.OperationalError,
            psycopg.InterfaceError,
        ) as exc:
            PERFORMS.labels(kind, "ledger_unavailable").inc()
            raise LedgerUnavailable(
                f"ledger database unavailable while performing {op_id!r}: {exc.__class__.__name__}: {exc}; "
                "retry the same operation id (an effect that may have landed is probed, never repeated)"
            ) from exc
        except Exception as exc:
            PERFORMS.labels(kind, type(exc).__name__).inc()
            raise
        finally:
            with self._in_flight_lock:
                self._in_flight[op_id] -= 1
                if not self._in_flight[op_id]:
                    del self._in_flight[op_id]
        PERFORMS.labels(kind, "replayed" if outcome.replayed else outcome.state).inc()
        return outcome

    async def perform_async(self, *args: Any, **kwargs: Any) -> EffectOutcome:
        """:meth:`perform` from async code (runs in a worker thread)."""
        return await asyncio.to_thread(self.perform, *args, **kwargs)

    def get(self, op_id: str) -> EffectOutcome | None:
        with self._autocommit.connect() as conn:
            row = conn.execute(select(EFFECTS).where(_C.op_id == op_id)).mappings().first()
        return EffectOutcome.from_row(row) if row else None

    # ------------------------------------------------------------------ protocol

    def _plan(self, req: _Request) -> EffectOutcome:
        with self._autocommit.connect() as conn:
            row = (
                conn.execute(
                    pg_insert(EFFECTS)
                    .values(**req.insert_values(state=EffectState.PLANNED, fence=0, attempts=0, owner=None))
                    .on_conflict_do_nothing(index_elements=["op_id"])
                    .returning(*EFFECTS.c)
                )
                .mappings()
                .first()
            )
            if row is not None:
                return EffectOutcome.from_row(row)
            existing = self._read(conn, req.op_id)
        if existing is None:  # pruned between the two statements: plan again
            return self._plan(req)
        self._check_same_request(req, existing)
        return self._resolved_or_raise(existing, allow_claimed=True)

    def _perform(self, req: _Request) -> EffectOutcome:
        deadline = time.monotonic() + self.wait_seconds
        backoff = 0.005
        while True:
            with self._driver_connection() as pg:
                claimed = pg.execute(
                    _CLAIM_SQL,
                    req.driver_values(
                        state=EffectState.CLAIMED,
                        fence=1,
                        attempts=1,
                        owner=self.owner,
                        lease=timedelta(seconds=req.lease_seconds),
                    ),
                ).fetchone()
            if claimed is not None:
                return self._drive(req, fence=1, attempt=1, outcome_unknown=False)
            with self._autocommit.connect() as conn:
                existing = self._read(conn, req.op_id)
            if existing is None:
                continue  # pruned in between; claim again
            self._check_same_request(req, existing)
            state = existing["state"]
            if state == EffectState.CLAIMED:
                taken = self._try_take_over(req, existing)
                if taken is not None:
                    return self._drive(
                        req, fence=taken["fence"], attempt=taken["attempts"], outcome_unknown=True
                    )
            elif state == EffectState.PLANNED:
                taken = self._promote_planned(req, existing)
                if taken is not None:
                    return self._drive(
                        req, fence=taken["fence"], attempt=taken["attempts"], outcome_unknown=False
                    )
            else:
                return self._resolved_or_raise(existing, allow_claimed=False)
            if time.monotonic() >= deadline:
                raise OperationInProgress(
                    f"operation {req.op_id!r} is being performed by {existing['lease_owner']} "
                    f"(lease until {existing['lease_expires_at']}); retry later with the same operation id"
                )
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.2)

    def _drive(self, req: _Request, *, fence: int, attempt: int, outcome_unknown: bool) -> EffectOutcome:
        """We hold the lease with ``fence``: resolve the operation (probe if needed, apply, record)."""
        leased_at = time.monotonic()
        attempt_info = Attempt(req.op_id, req.kind, req.target, req.params, fence, attempt)
        return self._resolve(req, attempt_info, outcome_unknown, leased_at)

    def _resolve(
        self, req: _Request, attempt: Attempt, outcome_unknown: bool, leased_at: float
    ) -> EffectOutcome:
        fence = attempt.fence
        effect = req.effect
        if outcome_unknown:
            if effect.delivery == Delivery.EXACTLY_ONCE:
                try:
                    found = effect.probe(attempt)
                except Exception as exc:
                    self._release(req, fence, f"probe failed: {exc!r}")
                    raise EffectAttemptError(
                        f"could not probe the target of {req.op_id!r} ({req.kind}): {exc!r}; "
                        "the outcome of an earlier attempt is still unknown, retry"
                    ) from exc
                PROBES.labels(req.kind, str(found is not None).lower()).inc()
                if found is not None:
                    log.info("op %s: earlier attempt had landed (probe); recording it", req.op_id)
                    outcome = self._record(req, fence, EffectState.APPLIED, result=_result_object(found))
                    return outcome.model_copy(update={"replayed": True})
                log.info("op %s: probe found nothing; applying under fence %d", req.op_id, fence)
            elif effect.delivery == Delivery.AT_MOST_ONCE:
                outcome = self._record(
                    req,
                    fence,
                    EffectState.NEEDS_OPERATOR,
                    error=(
                        f"an earlier attempt of {req.kind} may or may not have been delivered and this kind "
                        "cannot be probed (declared at-most-once): check the target by hand"
                    ),
                )
                raise NeedsOperator(f"operation {req.op_id!r} needs an operator: {outcome.error}", outcome)
            # AT_LEAST_ONCE: repeat, accepting a possible duplicate (visible in audit: delivery + attempts).
        if time.monotonic() - leased_at > req.lease_seconds * _LEASE_SAFETY:
            raise FencedOut(
                f"lease on {req.op_id!r} ran out before the effect could be applied; retry with the same id"
            )
        try:
            result = effect.apply(attempt)
        except PermanentEffectError as exc:
            outcome = self._record(req, fence, EffectState.FAILED, error=str(exc) or type(exc).__name__)
            raise EffectFailed(f"operation {req.op_id!r} failed: {outcome.error}", outcome) from exc
        except Exception as exc:
            self._release(req, fence, f"apply raised {exc!r}")
            raise EffectAttemptError(
                f"applying {req.op_id!r} ({req.kind}) raised {exc!r}; the outcome is unknown and the next "
                "attempt will resolve it"
            ) from exc
        return self._record(req, fence, EffectState.APPLIED, result=_result_object(result))

    def _record(
        self,
        req: _Request,
        fence: int,
        state: EffectState,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> EffectOutcome:
        """Write the outcome under our fencing token; refuse if someone took the lease over."""
        values = {
            "op_id": req.op_id,
            "fence": fence,
            "state": state.value,
            "result": None if result is None else canonical_json(result),
            "error": error,
        }
        with self._driver_connection() as pg:
            row = pg.execute(_RECORD_SQL, values).fetchone()
        if row is None:
            FENCE_REJECTIONS.labels(req.kind).inc()
            log.warning("op %s: write under fence %d refused, the lease was taken over", req.op_id, fence)
            raise FencedOut(
                f"operation {req.op_id!r}: this attempt's lease (fence {fence}) was taken over before it could "
                "record its outcome; retry with the same operation id to read the recorded outcome"
            )
        attempts, divergences, created_at, updated_at, resolved_at = row
        # Built from what we know rather than RETURNING every column: this is on every perform's path.
        return EffectOutcome.model_construct(
            op_id=req.op_id,
            kind=req.kind,
            target=req.target,
            state=state.value,
            delivery=req.effect.delivery.value,
            params=req.params,
            fingerprint=req.fingerprint,
            result=result,
            error=error,
            attempts=attempts,
            fence=fence,
            lease_owner=None,
            lease_expires_at=None,
            action_signature=req.signature,
            workflow_id=req.context.workflow_id,
            run_id=req.context.run_id,
            step=req.context.step,
            request_id=req.context.request_id,
            alert_fingerprints=list(req.context.alert_fingerprints),
            requested_by=req.context.requested_by,
            divergences=divergences,
            created_at=created_at,
            updated_at=updated_at,
            resolved_at=resolved_at,
            replayed=False,
        )

    @contextmanager
    def _driver_connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled psycopg connection in autocommit, for the claim and record statements.

        The fast path skips SQLAlchemy's execution layer (its per-statement bookkeeping cost as much as
        the database round trip); the pool, the statements (compiled from Core) and the schema stay
        SQLAlchemy's. A connection broken mid-statement is invalidated, never returned to the pool.
        """
        pooled = self.engine.raw_connection()
        pg = cast(psycopg.Connection[Any], pooled.driver_connection)
        switched = not pg.autocommit  # only for a caller-supplied, non-autocommit engine
        try:
            if switched:
                pg.autocommit = True
            yield pg
        except (psycopg.OperationalError, psycopg.InterfaceError):
            pooled.invalidate()
            raise
        finally:
            if switched and not pg.closed:
                try:
                    pg.autocommit = False  # the pool's other users expect their engine's default
                except psycopg.Error:
                    pooled.invalidate()  # interrupted mid-statement: not reusable
            pooled.close()

    def _release(self, req: _Request, fence: int, why: str) -> None:
        """After a transient error, end our lease now so the retry probes at once instead of waiting it out."""
        try:
            with self._autocommit.connect() as conn:
                conn.execute(
                    update(EFFECTS)
                    .where(_C.op_id == req.op_id, _C.fence == fence, _C.state == EffectState.CLAIMED)
                    .values(lease_expires_at=func.now(), error=why[:2000], updated_at=func.now())
                )
        except (OperationalError, InterfaceError, PoolTimeoutError, psycopg.Error):
            log.warning("op %s: could not release the lease; it will expire on its own", req.op_id)

    def _try_take_over(self, req: _Request, row: Mapping[Any, Any]) -> Mapping[Any, Any] | None:
        expired = row["lease_expired"] is not False
        ours_and_idle = row["lease_owner"] == self.owner and self._only_call_in_flight(req.op_id)
        if not (expired or ours_and_idle):
            return None
        condition = (
            or_(_C.lease_expires_at.is_(None), _C.lease_expires_at <= func.now())
            if not ours_and_idle
            else _C.lease_owner == self.owner
        )
        with self._autocommit.connect() as conn:
            return (
                conn.execute(
                    update(EFFECTS)
                    .where(
                        _C.op_id == req.op_id,
                        _C.state == EffectState.CLAIMED,
                        _C.fence == row["fence"],
                        condition,
                    )
                    .values(
                        fence=_C.fence + 1,
                        attempts=_C.attempts + 1,
                        lease_owner=self.owner,
                        lease_expires_at=func.now() + timedelta(seconds=req.lease_seconds),
                        updated_at=func.now(),
                    )
                    .returning(_C.fence, _C.attempts)
                )
                .mappings()
                .first()
            )

    def _promote_planned(self, req: _Request, row: Mapping[Any, Any]) -> Mapping[Any, Any] | None:
        """A dry run planned this op earlier; now it is performed for real (never dispatched before)."""
        with self._autocommit.connect() as conn:
            return (
                conn.execute(
                    update(EFFECTS)
                    .where(_C.op_id == req.op_id, _C.state == EffectState.PLANNED, _C.fence == row["fence"])
                    .values(
                        state=EffectState.CLAIMED,
                        fence=_C.fence + 1,
                        attempts=_C.attempts + 1,
                        lease_owner=self.owner,
                        lease_expires_at=func.now() + timedelta(seconds=req.lease_seconds),
                        updated_at=func.now(),
                        resolved_at=None,
                    )
                    .returning(_C.fence, _C.attempts)
                )
                .mappings()
                .first()
            )

    def _only_call_in_flight(self, op_id: str) -> bool:
        with self._in_flight_lock:
            return self._in_flight[op_id] == 1

    @staticmethod
    def _read(conn: Connection, op_id: str) -> Mapping[Any, Any] | None:
        lease_expired = (func.coalesce(_C.lease_expires_at <= func.now(), True)).label("lease_expired")
        return conn.execute(select(EFFECTS, lease_expired).where(_C.op_id == op_id)).mappings().first()

    def _check_same_request(self, req: _Request, row: Mapping[Any, Any]) -> None:
        if row["fingerprint"] == req.fingerprint:
            return
        self._record_divergence(req)
        original = EffectOutcome.from_row(row, replayed=True)
        log.warning("op %s: reused with different kind/target/params; refused", req.op_id)
        raise DivergentOperation(
            f"operation id {req.op_id!r} was already used for {row['kind']} on {row['target']} with different "
            f"parameters (state {row['state']}); this request was not performed. Use a new operation id for a "
            "new action",
            original,
        )

    def _record_divergence(self, req: _Request) -> None:
        ctx = req.context
        with self._transactional.begin() as conn:
            insert = pg_insert(DIVERGENCES).values(
                op_id=req.op_id,
                fingerprint=req.fingerprint,
                kind=req.kind,
                target=req.target,
                params=req.params,
                workflow_id=ctx.workflow_id,
                run_id=ctx.run_id,
                step=ctx.step,
                request_id=ctx.request_id,
                requested_by=ctx.requested_by,
            )
            conn.execute(
                insert.on_conflict_do_update(
                    index_elements=["op_id", "fingerprint"],
                    set_={"times_seen": DIVERGENCES.c.times_seen + 1, "last_seen_at": func.now()},
                )
            )
            conn.execute(
                update(EFFECTS)
                .where(_C.op_id == req.op_id)
                .values(divergences=_C.divergences + 1, updated_at=func.now())
            )

    @staticmethod
    def _resolved_or_raise(row: Mapping[Any, Any], *, allow_claimed: bool) -> EffectOutcome:
        outcome = EffectOutcome.from_row(row, replayed=True)
        if outcome.state == EffectState.FAILED:
            raise EffectFailed(f"operation {outcome.op_id!r} failed earlier: {outcome.error}", outcome)
        if outcome.state == EffectState.NEEDS_OPERATOR:
            raise NeedsOperator(f"operation {outcome.op_id!r} needs an operator: {outcome.error}", outcome)
        if outcome.state in (EffectState.APPLIED, EffectState.PLANNED) or allow_claimed:
            return outcome
        raise AssertionError(f"unexpected ledger state {outcome.state!r}")


class _Request:
    """One validated perform() call."""

    __slots__ = (
        "context",
        "effect",
        "fingerprint",
        "kind",
        "lease_seconds",
        "op_id",
        "params",
        "params_json",
        "signature",
        "target",
    )

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    op_id: str
    kind: str
    target: str
    params: dict[str, Any]
    params_json: str
    effect: Effect
    context: EffectContext
    lease_seconds: float
    fingerprint: str
    signature: dict[str, Any] | None

    @classmethod
    def build(
        cls,
        op_id: str,
        kind: str,
        target: str,
        params: Mapping[str, Any] | BaseModel,
        effect: Effect,
        context: EffectContext | None,
        lease_seconds: float,
    ) -> _Request:
        if not isinstance(op_id, str) or not op_id.strip():
            raise InvalidEffectRequest(
                "operation id must be a non-empty string (e.g. 'fleetmend:<workflow id>@<run>/<step>/<target>')"
            )
        if len(op_id) > MAX_OPERATION_ID_LENGTH:
            raise InvalidEffectRequest(
                f"operation id is {len(op_id)} characters; at most {MAX_OPERATION_ID_LENGTH} are allowed "
                "(hash long targets into the id)"
            )
        for name, value in (("kind", kind), ("target", target)):
            if not isinstance(value, str) or not value.strip():
                raise InvalidEffectRequest(f"effect {name} must be a non-empty string")
        if not isinstance(effect, Effect):
            raise InvalidEffectRequest(f"effect must be a ledger.Effect, got {type(effect).__name__}")
        if effect.delivery == Delivery.EXACTLY_ONCE and not effect.has_probe():
            raise InvalidEffectRequest(
                f"effect kind {kind!r} has no probe, so an unknown outcome cannot be resolved: implement probe() "
                "or declare delivery = Delivery.AT_MOST_ONCE / AT_LEAST_ONCE"
            )
        if lease_seconds <= 0:
            raise InvalidEffectRequest("lease_seconds must be positive")
        params_obj, params_json = canonical_object(params, "params")
        ctx = context or EffectContext()
        attempt = Attempt(op_id, kind, target, params_obj, fence=1, attempt=1)
        signature = effect.action_signature(attempt)
        return cls(
            op_id=op_id,
            kind=kind,
            target=target,
            params=params_obj,
            effect=effect,
            context=ctx,
            lease_seconds=lease_seconds,
            params_json=params_json,
            fingerprint=fingerprint_of_canonical(kind, target, params_json),
            signature=signature.model_dump() if signature else None,
        )

    def driver_values(
        self, *, state: EffectState, fence: int, attempts: int, owner: str | None, lease: timedelta
    ) -> dict[str, Any]:
        """Parameters of the precompiled claim statement (JSON columns wrapped for psycopg)."""
        ctx = self.context
        return {
            "op_id": self.op_id,
            "kind": self.kind,
            "target": self.target,
            "params": self.params_json,  # JSON text, cast to jsonb by the statement
            "fingerprint": self.fingerprint,
            "delivery": self.effect.delivery.value,
            "state": state.value,
            "attempts": attempts,
            "fence": fence,
            "lease_owner": owner,
            "lease": lease,
            "action_signature": None if self.signature is None else canonical_json(self.signature),
            "workflow_id": ctx.workflow_id,
            "run_id": ctx.run_id,
            "step": ctx.step,
            "request_id": ctx.request_id,
            "alert_fingerprints": canonical_json(ctx.alert_fingerprints),
            "requested_by": ctx.requested_by,
        }

    def insert_values(
        self, *, state: EffectState, fence: int, attempts: int, owner: str | None
    ) -> dict[str, Any]:
        ctx = self.context
        return {
            "op_id": self.op_id,
            "kind": self.kind,
            "target": self.target,
            "params": self.params,
            "fingerprint": self.fingerprint,
            "delivery": self.effect.delivery.value,
            "state": state.value,
            "attempts": attempts,
            "fence": fence,
            "lease_owner": owner,
            "action_signature": self.signature,
            "workflow_id": ctx.workflow_id,
            "run_id": ctx.run_id,
            "step": ctx.step,
            "request_id": ctx.request_id,
            "alert_fingerprints": list(ctx.alert_fingerprints),
            "requested_by": ctx.requested_by,
        }


def _result_object(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    return to_json_object(value, "the effect's result")


@contextmanager
def open_ledger(url: str, **kwargs: Any) -> Iterator[EffectLedger]:
    """An :class:`EffectLedger` on ``url`` for the duration of a block (CLI, scripts)."""
    ledger = EffectLedger(url, **kwargs)
    try:
        yield ledger
    finally:
        ledger.close()
