"""HTTP face of the effect ledger, mounted in the worker's FastAPI app (``worker/webhook/app.py``).

* ``POST /v1/effects`` — an inference service proposes an effect ``{operation_id, kind, target,
  params}`` (op id = ``<request id>/<slot>``, so a re-run of the inference reuses it). The ledger
  performs it at most once and every call — first or repeat — gets the recorded outcome (200,
  ``state`` applied / failed / needs_operator / planned). The same op id with other params is
  409 with the original outcome; an unknown kind or invalid params is 422; a transient problem
  is 503 with ``Retry-After`` (repeat the same request). Operation ids starting with
  ``fleetmend:`` belong to fleetmend's own procedures: 403, nothing recorded (a caller
  must not pre-claim, and so block, a future recovery's action).
  Bearer token: ``FLEETMEND_EFFECTS_TOKEN``.
* ``GET /ledger/effects`` — audit, newest first, filters ``workflow_id target kind state
  request_id since until``, paginated with ``limit`` and ``cursor`` (``next_cursor``).
* ``GET /ledger/effects/{op_id}`` — one operation with its divergent requests.
  Bearer token of both: ``FLEETMEND_LEDGER_TOKEN``.

Missing or wrong token → 401 with ``WWW-Authenticate: Bearer``; a token that is not
configured → 503 naming the setting (the route is off, never open).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import httpx
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError

from activities.effects import EffectRegistry, JiraProject, UnknownEffectKind, default_registry
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX
from ledger.audit import EffectDetail, EffectFilter, EffectPage, InvalidQuery, list_effects, show_effect
from ledger.effect import EffectContext
from ledger.errors import (
    DivergentOperation,
    InvalidEffectRequest,
    NonRetryableLedgerError,
    RetryableLedgerError,
)
from ledger.models import MAX_OPERATION_ID_LENGTH, EffectState
from ledger.outcome import EffectOutcome
from ledger.store import EffectLedger, make_engine
from worker.config import Settings
from worker.webhook.auth import require_bearer

RETRY_AFTER_S = 1


class EffectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    operation_id: str = Field(
        min_length=1, max_length=MAX_OPERATION_ID_LENGTH, description="<request id>/<slot>"
    )
    kind: str = Field(min_length=1, max_length=100)
    target: str = Field(min_length=1, max_length=500)
    params: dict[str, Any] = Field(default_factory=dict)
    request_id: str | None = Field(None, max_length=255, description="default: the op id before its last '/'")


class DivergentAnswer(BaseModel):
    detail: str
    original: EffectOutcome


class LedgerUnconfigured(RuntimeError):
    pass


def is_procedure_operation_id(operation_id: str) -> bool:
    """In the namespace of fleetmend's own procedures. Case and leading blanks are ignored so an id
    that merely looks like a procedure's in an audit listing is refused too."""
    return operation_id.lstrip().casefold().startswith(PROCEDURE_OPERATION_PREFIX.casefold())


def effects_router(
    ledger: Callable[[], EffectLedger],
    registry: EffectRegistry,
    *,
    effects_token: SecretStr | None,
    ledger_token: SecretStr | None,
    dependencies: Sequence[Any] | None = None,
) -> APIRouter:
    """The effect and audit routes over ``ledger()`` (called per request; build it lazily).

    ``effects_token`` guards ``POST /v1/effects``, ``ledger_token`` the audit routes; an unset
    token switches its routes off (503), never open."""
    router = APIRouter(dependencies=list(dependencies or []))
    unauthorized: dict[int | str, dict[str, Any]] = {401: {"description": "Missing or wrong bearer token"}}
    effects_auth = Depends(
        require_bearer(effects_token, setting="FLEETMEND_EFFECTS_TOKEN", audience="the effect API")
    )
    ledger_auth = Depends(
        require_bearer(ledger_token, setting="FLEETMEND_LEDGER_TOKEN", audience="the ledger audit API")
    )

    def get_ledger() -> EffectLedger:
        try:
            return ledger()
        except LedgerUnconfigured as exc:
            raise HTTPException(503, str(exc)) from exc

    @router.post(
        "/v1/effects",
        response_model=EffectOutcome,
        responses={
            **unauthorized,
            403: {"description": "Operation id in the namespace of fleetmend's own procedures"},
            409: {"model": DivergentAnswer},
            422: {},
            503: {},
        },
        tags=["effects"],
        summary="Perform an inference-proposed effect exactly once per operation id",
        dependencies=[effects_auth],
    )
    def post_effect(body: EffectRequest, request: Request) -> Any:
        if is_procedure_operation_id(body.operation_id):
            raise HTTPException(
                403,
                f"operation id {body.operation_id[:80]!r} is in the {PROCEDURE_OPERATION_PREFIX!r} namespace, "
                "reserved for fleetmend's own procedures; nothing was recorded. Derive the id from your "
                "request: <request id>/<effect slot>",
            )
        try:
            kind = registry.resolve(body.kind)
            params = kind.params_model.model_validate(body.params)
        except UnknownEffectKind as exc:
            raise HTTPException(422, str(exc)) from exc
        except ValidationError as exc:
            raise HTTPException(
                422,
                {
                    "message": f"invalid params for {kind.name}",
                    "errors": jsonable_encoder(exc.errors(include_url=False, include_context=False)),
                },
            ) from exc
        client = request.client.host if request.client else "unknown"
        context = EffectContext(
            request_id=body.request_id or body.operation_id.rsplit("/", 1)[0],
            requested_by=f"inference-api:{client}",
        )
        try:
            outcome = get_ledger().perform(
                body.operation_id,
                kind.name,
                body.target,
                params,
                kind.build(params),
                context=context,
            )
        except DivergentOperation as exc:
            answer = DivergentAnswer(detail=exc.message, original=exc.outcome)
            return JSONResponse(answer.model_dump(mode="json"), status_code=409)
        except NonRetryableLedgerError as exc:
            outcome = exc.outcome  # failed / needs_operator: the recorded answer, the same on every repeat
        except InvalidEffectRequest as exc:
            raise HTTPException(422, str(exc)) from exc
        except RetryableLedgerError as exc:
            return JSONResponse(
                {"detail": str(exc)}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}
            )
        return outcome

    @router.get(
        "/ledger/effects",
        response_model=EffectPage,
        responses=unauthorized,
        tags=["ledger"],
        summary="List effects",
        dependencies=[ledger_auth],
    )
    def get_effects(
        workflow_id: str | None = None,
        target: str | None = None,
        kind: str | None = None,
        state: EffectState | None = None,
        request_id: str | None = None,
        since: datetime | None = Query(None, description="ISO 8601 with zone; created at/after"),
        until: datetime | None = Query(None, description="ISO 8601 with zone; created before"),
        limit: int = Query(50, ge=1, le=500),
        cursor: str | None = None,
    ) -> EffectPage:
        try:
            filters = EffectFilter(
                workflow_id=workflow_id,
                target=target,
                kind=kind,
                state=state,
                request_id=request_id,
                since=since,
                until=until,
            )
            return list_effects(get_ledger().engine, filters, limit=limit, cursor=cursor)
        except ValidationError as exc:
            raise HTTPException(
                422, jsonable_encoder(exc.errors(include_url=False, include_context=False))
            ) from exc
        except InvalidQuery as exc:
            raise HTTPException(422, str(exc)) from exc

    @router.get(
        "/ledger/effects/{op_id:path}",
        response_model=EffectDetail,
        responses=unauthorized,
        tags=["ledger"],
        summary="One operation",
        dependencies=[ledger_auth],
    )
    def get_effect(op_id: str) -> EffectDetail:
        detail = show_effect(get_ledger().engine, op_id)
        if detail is None:
            raise HTTPException(404, f"no operation {op_id!r} in the ledger (pruned, or never requested)")
        return detail

    return router


def jira_project(settings: Settings) -> JiraProject | None:
    """The Jira project ``ticket.create`` opens issues in; None without ``FLEETMEND_TICKETS_URL``."""
    if not settings.tickets_url:
        return None
    if settings.tickets_token is None:
        raise ValueError(
            "FLEETMEND_TICKETS_URL is set but FLEETMEND_TICKETS_TOKEN is not: Jira refuses anonymous issue "
            "creation. Set the token (a Cloud API token with FLEETMEND_TICKETS_USER, or a Data Center "
            "personal access token), or unset FLEETMEND_TICKETS_URL to serve no ticket.create kind"
        )
    return JiraProject(
        base_url=settings.tickets_url,
        project=settings.tickets_project,
        issue_type=settings.tickets_issue_type,
        user=settings.tickets_user,
        token=settings.tickets_token,
        search=settings.tickets_search,
    )


def create_router(settings: Settings) -> APIRouter:
    """The router the webhook app mounts: the ledger at ``FLEETMEND_DATABASE_URL`` (connected on first use),
    ``ticket.create`` in the Jira at ``FLEETMEND_TICKETS_URL`` and ``notify.post`` to
    ``FLEETMEND_NOTIFIER_URL``, each when set."""
    # The user agent is how a target's action log (the sim's) attributes these requests to fleetmend.
    http = httpx.Client(
        timeout=httpx.Timeout(5.0, connect=2.0), headers={"User-Agent": "fleetmend-effects-api/0.1"}
    )
    registry = default_registry(http, tickets=jira_project(settings), notifier_url=settings.notifier_url)
    url = settings.database_url_value()
    lock = threading.Lock()
    built: list[EffectLedger] = []

    def ledger() -> EffectLedger:
        if url is None:
            raise LedgerUnconfigured("the ledger database is not configured: set FLEETMEND_DATABASE_URL")
        with lock:
            if not built:
                owner = f"webhook:{socket.gethostname()}:{os.getpid()}"
                built.append(EffectLedger(make_engine(url), owner=owner))
            return built[0]

    return effects_router(
        ledger, registry, effects_token=settings.effects_token, ledger_token=settings.ledger_token
    )
