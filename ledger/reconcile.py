"""Reconciliation: compare the ledger with itself and with the world's own record of actions.

Findings:

* **unresolved** — an intent still ``claimed`` longer than the bound (a worker died and
  nobody retried; the next ``perform`` of that op id will probe and resolve it);
* **needs_operator** — outcomes an operator must check by hand;
* **divergent** — op ids re-requested with different params (within the window);
* **orphans** — actions in the world with no ledger row (someone acted outside the ledger,
  or the ledger lost a row);
* **duplicates** — ledger operations whose action appears in the world more than once;
* **repeated** (not a finding) — an effect that declares at-least-once delivery (an incident
  channel's webhook: no idempotency key, nothing to query) repeated after an unknown outcome,
  no more often than its row counts attempts. That is the declared behaviour, stored on the
  row; it is listed so an auditor sees it, and it fails nothing;
* **missing** — ``applied`` rows whose action the world never logged (opt-in with
  ``check_missing``: only valid when the log covers the whole window; a restarted sim's
  log does not).

Matching the world to the ledger: every effect kind declares the
:class:`~ledger.effect.ActionSignature` its request will leave in the target's log
(world = the API's origin, verb, path, sha256 of the raw body), stored on the row at
claim time. When the world echoes operation ids (an ``Idempotency-Key``, a
``ledger/op-id`` annotation), a log entry carrying one is matched by op id. Otherwise
entries are matched by signature and *counted*: n log entries against m ledger rows
with that signature → n - m are findings (orphans when m = 0, else duplicates of those
rows). Only successful (2xx) log entries count: a refused request changed nothing.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, cast
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict
from sqlalchemy import Engine, Table, func, select

from fleet.actionlog import ActionLogEntry
from ledger.models import Delivery, DivergenceRecord, EffectRecord, EffectState
from ledger.outcome import EffectOutcome

EFFECTS = cast(Table, EffectRecord.__table__)
DIVERGENCES = cast(Table, DivergenceRecord.__table__)
DEFAULT_UNRESOLVED_AFTER = timedelta(minutes=5)
DEFAULT_WINDOW = timedelta(hours=24)
# Rows whose action may be in the world: a claimed row may have acted before its worker died.
# An effect whose body is only known at apply time declares this digest: verb + path must match.
WILDCARD_DIGEST = "*"
_MAY_HAVE_ACTED = (EffectState.APPLIED, EffectState.CLAIMED, EffectState.NEEDS_OPERATOR)


class WorldAction(BaseModel):
    """One entry of a target's action log, in the ledger's terms."""

    model_config = ConfigDict(extra="forbid")

    world: str
    verb: str
    path: str
    body_digest: str
    op_id: str | None = None
    seq: int | None = None
    time: float | None = None
    status: int = 200
    client: str | None = None
    # The record may hold a re-encoded body (a real API server's audit log): when the digest
    # matches no row, the action may still match a row by verb + path.
    loose_body: bool = False

    def key(self) -> tuple[str, str, str, str]:
        return (self.world, self.verb.upper(), self.path, self.body_digest)


class InvalidAuditEvent(ValueError):
    """An audit log line that is not an ``audit.k8s.io`` Event."""


_AUDIT_VERBS = {
    "create": "POST",
    "update": "PUT",
    "patch": "PATCH",
    "delete": "DELETE",
    "deletecollection": "DELETE",
}


def _audit_time(stamp: Any) -> float | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def world_actions_from_audit(world: str, events: Iterable[dict[str, Any]]) -> list[WorldAction]:
    """The mutations a Kubernetes audit log records, as actions of ``world`` (the API server's host:port).

    ``seq`` is the event's position in the log (1-based, counting every line).
    """
    out = []
    for seq, event in enumerate(events, start=1):
        if not isinstance(event, dict) or not str(event.get("apiVersion", "")).startswith("audit.k8s.io/"):
            raise InvalidAuditEvent(
                f"audit log line {seq} is not an audit.k8s.io Event (kind {event.get('kind') if isinstance(event, dict) else type(event).__name__!r})"
            )
        if event.get("stage") != "ResponseComplete" or event.get("verb") not in _AUDIT_VERBS:
            continue
        uri = urlsplit(str(event.get("requestURI", "")))
        if "All" in parse_qs(uri.query).get("dryRun", []):
            continue  # a dry run changed nothing
        level = event.get("level", "Metadata")
        if level in ("Request", "RequestResponse"):
            body = event.get("requestObject")
            raw = b"" if body is None else json.dumps(body).encode()
            digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        else:
            digest = WILDCARD_DIGEST
        user = event.get("user") or {}
        status = (event.get("responseStatus") or {}).get("code", 0)
        out.append(
            WorldAction(
                world=world,
                verb=_AUDIT_VERBS[event["verb"]],
                path=uri.path,
                body_digest=digest,
                seq=seq,
                time=_audit_time(event.get("requestReceivedTimestamp")),
                status=int(status or 0),
                client=f"{user.get('username', '')}/{event.get('userAgent', '')}",
                loose_body=event["verb"] != "patch",
            )
        )
    return out


def world_actions_from_sim(
    world: str, entries: Iterable[ActionLogEntry | dict[str, Any]]
) -> list[WorldAction]:
    """Convert the sim's ``GET /sim/v1/actions`` entries (it does not echo op ids)."""
    out = []
    for entry in entries:
        e = entry if isinstance(entry, ActionLogEntry) else ActionLogEntry.model_validate(entry)
        out.append(
            WorldAction(
                world=world,
                verb=e.verb,
                path=e.path,
                body_digest=e.body_digest,
                seq=e.seq,
                time=e.time,
                status=e.status,
                client=e.client,
            )
        )
    return out


class Duplicate(BaseModel):
    op_ids: list[str]
    signature: dict[str, str]
    expected: int
    observed: int
    actions: list[WorldAction]


class ReconcileReport(BaseModel):
    checked_at: datetime
    unresolved_after_s: float
    window_s: float
    world: str | None
    world_actions_compared: int
    unresolved: list[EffectOutcome]
    needs_operator: list[EffectOutcome]
    divergent: list[EffectOutcome]
    orphans: list[WorldAction]
    duplicates: list[Duplicate]
    missing: list[EffectOutcome]
    repeated: list[Duplicate] = []  # declared at-least-once repeats: listed, not findings

    @property
    def findings(self) -> int:
        return (
            len(self.unresolved)
            + len(self.needs_operator)
            + len(self.divergent)
            + len(self.orphans)
            + len(self.duplicates)
            + len(self.missing)
        )

    @property
    def clean(self) -> bool:
        return self.findings == 0


def _duplicate_or_repeat(
    report: ReconcileReport, owners: Sequence[EffectOutcome], observed: int
) -> Callable[[Duplicate], None]:
    """Where a world action seen more often than its rows goes: ``repeated`` when every row declares
    at-least-once delivery and their attempts cover what the world saw, else ``duplicates``."""
    declared = all(o.delivery == Delivery.AT_LEAST_ONCE.value for o in owners)
    if declared and observed <= sum(max(1, o.attempts) for o in owners):
        return report.repeated.append
    return report.duplicates.append


def reconcile(
    engine: Engine,
    *,
    world: str | Sequence[str] | None = None,
    actions: Iterable[WorldAction] | None = None,
    unresolved_after: timedelta = DEFAULT_UNRESOLVED_AFTER,
    window: timedelta = DEFAULT_WINDOW,
    check_missing: bool = False,
) -> ReconcileReport:
    """Reconcile the ledger; with ``world`` and ``actions``, also against that world's record.

    ``world`` may name several worlds (e.g. the API server and the router): ``actions`` then
    holds all their records, and each world's rows are compared with that world's actions only.
    """
    if (world is None) != (actions is None):
        raise ValueError("pass both the world's name and its action log, or neither")
    worlds = [world] if isinstance(world, str) else list(world or [])
    c = EFFECTS.c
    with engine.connect() as conn:
        now: datetime = conn.execute(select(func.now())).scalar_one()
        since = now - window

        def rows(*conditions: Any) -> list[EffectOutcome]:
            query = select(EFFECTS).where(*conditions).order_by(c.created_at)
            return [EffectOutcome.from_row(r) for r in conn.execute(query).mappings()]

        unresolved = rows(c.state == EffectState.CLAIMED, c.updated_at < now - unresolved_after)
        needs_operator = rows(c.state == EffectState.NEEDS_OPERATOR)
        recent_divergent = select(DIVERGENCES.c.op_id).where(DIVERGENCES.c.last_seen_at >= since)
        divergent = rows(c.op_id.in_(recent_divergent))
        candidates: list[EffectOutcome] = []
        if worlds:
            candidates = rows(
                c.state.in_([s.value for s in _MAY_HAVE_ACTED]),
                c.action_signature["world"].astext.in_(worlds),
            )

    report = ReconcileReport(
        checked_at=now,
        unresolved_after_s=unresolved_after.total_seconds(),
        window_s=window.total_seconds(),
        world=", ".join(worlds) if worlds else None,
        world_actions_compared=0,
        unresolved=unresolved,
        needs_operator=needs_operator,
        divergent=divergent,
        orphans=[],
        duplicates=[],
        missing=[],
    )
    if actions is not None:
        recorded = list(actions)
        for name in worlds:
            _compare_with_world(
                report,
                [o for o in candidates if (o.action_signature or {}).get("world") == name],
                [a for a in recorded if a.world == name],
                since if check_missing else None,
            )
    return report


def _signature_key(outcome: EffectOutcome) -> tuple[str, str, str, str]:
    sig = outcome.action_signature or {}
    return (
        sig.get("world", ""),
        str(sig.get("verb", "")).upper(),
        sig.get("path", ""),
        sig.get("body_digest", ""),
    )


def _compare_with_world(
    report: ReconcileReport,
    candidates: list[EffectOutcome],
    actions: list[WorldAction],
    missing_since: datetime | None,
) -> None:
    landed = [a for a in actions if 200 <= a.status < 300]
    report.world_actions_compared += len(landed)
    by_op = {o.op_id: o for o in candidates}
    rows_by_key: dict[tuple[str, str, str, str], list[EffectOutcome]] = defaultdict(list)
    for outcome in candidates:
        rows_by_key[_signature_key(outcome)].append(outcome)

    seen_by_op: dict[str, list[WorldAction]] = defaultdict(list)
    seen_by_key: dict[tuple[str, str, str, str], list[WorldAction]] = defaultdict(list)
    for action in landed:
        if action.op_id is not None:
            if action.op_id in by_op:
                seen_by_op[action.op_id].append(action)
            else:
                report.orphans.append(action)
        else:
            key = action.key()
            if key not in rows_by_key and (wild := (*key[:3], WILDCARD_DIGEST)) in rows_by_key:
                # The effect could not know its body up front (e.g. a versioned PUT): match verb + path.
                key = wild
            elif key not in rows_by_key and (action.body_digest == WILDCARD_DIGEST or action.loose_body):
                # The record cannot show the exact body (no body logged, or a re-encoded one).
                same_call = [k for k in rows_by_key if k[:3] == key[:3]]
                if same_call:
                    key = min(same_call, key=lambda k: len(seen_by_key.get(k, [])))
            seen_by_key[key].append(action)

    for op_id, seen in seen_by_op.items():
        if len(seen) > 1:
            outcome = by_op[op_id]
            _duplicate_or_repeat(report, [outcome], len(seen))(
                Duplicate(
                    op_ids=[op_id],
                    signature=dict(outcome.action_signature or {}),
                    expected=1,
                    observed=len(seen),
                    actions=seen,
                )
            )

    for key, seen in seen_by_key.items():
        owners = rows_by_key.get(key, [])
        if not owners:
            report.orphans.extend(seen)
        elif len(seen) > len(owners):
            _duplicate_or_repeat(report, owners, len(seen))(
                Duplicate(
                    op_ids=[o.op_id for o in owners],
                    signature={"world": key[0], "verb": key[1], "path": key[2], "body_digest": key[3]},
                    expected=len(owners),
                    observed=len(seen),
                    actions=seen,
                )
            )

    if missing_since is None:
        return
    for key, owners in rows_by_key.items():
        applied = [o for o in owners if o.state == EffectState.APPLIED and o.created_at >= missing_since]
        observed = len(seen_by_key.get(key, [])) + sum(len(seen_by_op.get(o.op_id, [])) for o in owners)
        if len(applied) > observed:
            # Fewer actions than applied rows: the newest rows are the ones the log cannot account for.
            report.missing.extend(applied[observed - len(applied) :])
