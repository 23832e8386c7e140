"""Effect kinds an inference service may propose (``POST /v1/effects``), registered in code.

A model never names a URL: it names a registered *kind* with validated params, and
the registry builds the effect against the endpoint configured for that kind.

* ``ticket.create`` — ``POST {tickets_url}/sim/v1/tickets`` with ``Idempotency-Key: <op id>``;
  probed with ``GET …/sim/v1/tickets?idempotency_key=<op id>``. Exactly once.
* ``notify.post`` — a Slack-compatible incoming webhook (``{"text": …}``). Such webhooks
  take no idempotency key and cannot be queried, so the kind declares
  **at-least-once**: after an unknown outcome the message is posted again. For an
  incident channel a repeated line is a nuisance, a missing one (say, the lead time
  of replacement capacity) is a gap in the incident record. The choice is stored on
  every row (``delivery``) and shown by ``fleetmend ledger list/show``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field

from ledger.canonical import body_digest
from ledger.effect import ActionSignature, Attempt, Effect
from ledger.errors import PermanentEffectError
from ledger.models import Delivery

# Status codes that a retry may still turn into success.
_TRANSIENT = {408, 409, 425, 429}


def _raise_for_status(response: httpx.Response, what: str) -> None:
    if response.is_success:
        return
    if 400 <= response.status_code < 500 and response.status_code not in _TRANSIENT:
        raise PermanentEffectError(f"{what}: {response.status_code} {response.text[:500]}")
    response.raise_for_status()  # 5xx and transient 4xx: an exception Temporal retries


def _json_bytes(payload: dict[str, Any]) -> bytes:
    # The exact bytes we send are the bytes the world's action log digests.
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class TicketParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=500)
    body: str = Field(default="", max_length=20_000)


class NotifyParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=4000)


class TicketCreate(Effect):
    """Open a ticket; the op id is the ticket API's idempotency key and the probe's lookup key."""

    delivery = Delivery.EXACTLY_ONCE

    def __init__(self, http: httpx.Client, base_url: str, params: TicketParams) -> None:
        self.http = http
        self.url = base_url.rstrip("/") + "/sim/v1/tickets"
        self.body = _json_bytes(params.model_dump())

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        response = self.http.post(
            self.url,
            content=self.body,
            headers={"Idempotency-Key": attempt.op_id, "Content-Type": "application/json"},
        )
        _raise_for_status(response, f"ticket API refused {attempt.op_id!r}")
        return {"ticket": response.json()}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        response = self.http.get(self.url, params={"idempotency_key": attempt.op_id})
        response.raise_for_status()
        tickets = response.json()
        return {"ticket": tickets[0]} if tickets else None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        parts = urlsplit(self.url)
        return ActionSignature(
            world=parts.netloc, verb="POST", path=parts.path, body_digest=body_digest(self.body)
        )


class NotifyPost(Effect):
    """Post one message to a Slack-compatible incoming webhook. At-least-once (see module docstring)."""

    delivery = Delivery.AT_LEAST_ONCE

    def __init__(self, http: httpx.Client, url: str, text: str) -> None:
        self.http = http
        self.url = url
        self.body = _json_bytes({"text": text})

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        response = self.http.post(self.url, content=self.body, headers={"Content-Type": "application/json"})
        _raise_for_status(response, "incident channel refused the message")
        return {"status": response.status_code}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        parts = urlsplit(self.url)
        return ActionSignature(
            world=parts.netloc, verb="POST", path=parts.path, body_digest=body_digest(self.body)
        )


def notify_effect(http: httpx.Client, url: str, text: str) -> NotifyPost:
    """The incident-channel effect the workflows' ``notify`` activity performs through the ledger."""
    return NotifyPost(http, url, text)


class UnknownEffectKind(LookupError):
    pass


@dataclass(frozen=True)
class EffectKind:
    """One registered kind: its params schema and how to build its effect."""

    name: str
    params_model: type[BaseModel]
    build: Callable[[BaseModel], Effect]
    delivery: Delivery
    description: str


class EffectRegistry:
    """The kinds an inference service may request. Anything else is refused (422)."""

    def __init__(self, kinds: list[EffectKind] | None = None, aliases: dict[str, str] | None = None) -> None:
        self._kinds = {k.name: k for k in kinds or []}
        self._aliases = dict(aliases or {})

    def register(self, kind: EffectKind) -> None:
        self._kinds[kind.name] = kind

    def names(self) -> list[str]:
        return sorted(self._kinds)

    def resolve(self, name: str) -> EffectKind:
        canonical = self._aliases.get(name, name)
        try:
            return self._kinds[canonical]
        except KeyError:
            raise UnknownEffectKind(
                f"unknown effect kind {name!r}; registered kinds: {', '.join(self.names()) or '(none)'}"
            ) from None


def default_registry(
    http: httpx.Client, *, tickets_url: str | None, notifier_url: str | None
) -> EffectRegistry:
    """``ticket.create`` against ``tickets_url`` and ``notify.post`` to ``notifier_url`` (each when configured)."""
    registry = EffectRegistry(aliases={"ticket": "ticket.create", "notify": "notify.post"})
    if tickets_url:
        url = tickets_url
        registry.register(
            EffectKind(
                name="ticket.create",
                params_model=TicketParams,
                build=lambda p: TicketCreate(http, url, TicketParams.model_validate(p)),
                delivery=TicketCreate.delivery,
                description="Open a ticket (idempotency key = operation id; exactly once)",
            )
        )
    if notifier_url:
        hook = notifier_url
        registry.register(
            EffectKind(
                name="notify.post",
                params_model=NotifyParams,
                build=lambda p: NotifyPost(http, hook, NotifyParams.model_validate(p).text),
                delivery=NotifyPost.delivery,
                description="Post to the incident channel (no probe: at least once)",
            )
        )
    return registry
