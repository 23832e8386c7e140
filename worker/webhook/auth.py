"""Bearer tokens of the worker's HTTP API: one per audience, none shared.

* ``FLEETMEND_WEBHOOK_TOKEN`` — Alertmanager, ``POST /alerts/alertmanager``;
* ``FLEETMEND_EFFECTS_TOKEN`` — inference services proposing effects, ``POST /v1/effects``;
* ``FLEETMEND_LEDGER_TOKEN`` — auditors reading the ledger, ``GET /ledger/effects...``.

A credential leaked from one caller (Alertmanager's config, a gateway's env) opens
only that caller's route. A route whose token is not configured refuses every
request (503, naming the setting): it is never open. Health checks
(``/healthz``, ``/readyz``) need no token; neither does ``/metrics`` (see
``worker/webhook/app.py`` for why it is not sensitive).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import HTTPException, Request
from pydantic import SecretStr

from worker.config import Settings

WWW_AUTHENTICATE = {"WWW-Authenticate": "Bearer"}


def secret_value(secret: SecretStr | None) -> str:
    return secret.get_secret_value() if secret else ""


def bearer_matches(header: str | None, expected: bytes) -> bool:
    """Constant-time comparison: the reply time does not reveal how much of a guess was right."""
    if not header or not expected:
        return False
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(credentials.strip().encode("utf-8", "surrogateescape"), expected)


class TokenReuse(ValueError):
    """Two audiences were given the same token; the message says which settings."""


def check_tokens_distinct(settings: Settings) -> None:
    """Refuse one value for two audiences: Alertmanager's credential must not create effects
    or read the audit ledger, and an inference gateway's must not read the ledger."""
    named = {
        "FLEETMEND_WEBHOOK_TOKEN": secret_value(settings.webhook_token),
        "FLEETMEND_EFFECTS_TOKEN": secret_value(settings.effects_token),
        "FLEETMEND_LEDGER_TOKEN": secret_value(settings.ledger_token),
    }
    seen: dict[str, str] = {}
    for name, value in named.items():
        if not value:
            continue
        if value in seen:
            raise TokenReuse(
                f"{seen[value]} and {name} have the same value: each caller gets a token of its own "
                "(generate another, e.g. `openssl rand -hex 32`)"
            )
        seen[value] = name


def require_bearer(token: SecretStr | None, *, setting: str, audience: str) -> Callable[[Request], None]:
    """A FastAPI dependency: the request must carry ``Authorization: Bearer <token>``.

    Unconfigured → 503 naming ``setting`` (the route is off, not open); missing or
    wrong token → 401 with ``WWW-Authenticate: Bearer``.
    """
    expected = secret_value(token).encode()

    def check(request: Request) -> None:
        if not expected:
            raise HTTPException(
                503,
                f"{audience} is disabled: {setting} is not set. Set it on the fleetmend webhook "
                f"process (e.g. `openssl rand -hex 32`) and give the same value to its callers",
            )
        if not bearer_matches(request.headers.get("authorization"), expected):
            raise HTTPException(
                401,
                f"missing or wrong bearer token for {audience}: send `Authorization: Bearer <{setting}>`",
                headers=WWW_AUTHENTICATE,
            )

    return check
