"""The effect protocol: how one kind of external action is applied, probed and recognised.

An effect object is built by the caller for one operation; the ledger decides
*whether* to call :meth:`Effect.apply` (at most once per operation) and, after an
unknown outcome, calls :meth:`Effect.probe` to look at the target instead of
repeating. Kinds whose target cannot be probed must say so with ``delivery``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ledger.models import Delivery


class EffectContext(BaseModel):
    """Who asked for an effect; stored with the operation for audit."""

    model_config = ConfigDict(extra="forbid")

    workflow_id: str | None = Field(None, max_length=255)
    run_id: str | None = Field(None, max_length=255)
    step: str | None = Field(None, max_length=255)
    alert_fingerprints: list[str] = Field(default_factory=list)
    request_id: str | None = Field(None, max_length=255)
    requested_by: str | None = Field(None, max_length=255, description="worker identity, API client, ...")


class ActionSignature(BaseModel):
    """What the target's own action log will show when this effect lands.

    Reconciliation matches the world's log against the ledger with it: by ``op_id``
    where the world echoes the idempotency key, else by (verb, path, body digest).
    ``world`` names the log (the origin of the API the request goes to, e.g.
    ``127.0.0.1:8480``) so one log is never compared with another API's effects.
    """

    model_config = ConfigDict(extra="forbid")

    world: str
    verb: str
    path: str
    body_digest: str


@dataclass(frozen=True)
class Attempt:
    """Handed to ``apply`` / ``probe``: pass ``op_id`` downstream as the idempotency key where the target
    supports one, and ``fence`` where it accepts a precondition token."""

    op_id: str
    kind: str
    target: str
    params: dict[str, Any]
    fence: int
    attempt: int


class Effect:
    """Base class for one operation's external action.

    Override :meth:`apply` (return a JSON object: the result callers get back on every
    repeat), and :meth:`probe` unless ``delivery`` is ``AT_MOST_ONCE`` or ``AT_LEAST_ONCE``.
    Raise :class:`ledger.errors.PermanentEffectError` for a refusal that retrying cannot
    fix; any other exception is treated as transient and an unknown outcome.
    """

    delivery: Delivery = Delivery.EXACTLY_ONCE

    def apply(self, attempt: Attempt) -> dict[str, Any] | None:
        raise NotImplementedError

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        """Return the result if the effect is already visible at the target, else None."""
        raise NotImplementedError(f"{type(self).__name__} has no probe")

    def action_signature(self, attempt: Attempt) -> ActionSignature | None:
        return None

    def has_probe(self) -> bool:
        return type(self).probe is not Effect.probe


class CallableEffect(Effect):
    """An effect from plain functions, for activities that do not need a class."""

    def __init__(
        self,
        apply: Callable[[Attempt], dict[str, Any] | None],
        probe: Callable[[Attempt], dict[str, Any] | None] | None = None,
        *,
        delivery: Delivery = Delivery.EXACTLY_ONCE,
        signature: Callable[[Attempt], ActionSignature | None] | None = None,
    ) -> None:
        self._apply = apply
        self._probe = probe
        self._signature = signature
        self.delivery = delivery

    def apply(self, attempt: Attempt) -> dict[str, Any] | None:
        return self._apply(attempt)

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        if self._probe is None:
            raise NotImplementedError("this effect has no probe")
        return self._probe(attempt)

    def has_probe(self) -> bool:
        return self._probe is not None

    def action_signature(self, attempt: Attempt) -> ActionSignature | None:
        return self._signature(attempt) if self._signature else None
