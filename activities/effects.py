"""Effect kinds an inference service may propose (``POST /v1/effects``), registered in code.

A model never names a URL: it names a registered *kind* with validated params, and
the registry builds the effect against the endpoint configured for that kind.

* ``ticket.create`` — a Jira issue (REST API v2): ``POST {tickets_url}/rest/api/2/issue`` carrying
  the label ``fleetmend-op-<sha256 of the op id>``; probed with a JQL search for that label
  (``GET /rest/api/2/search`` on Jira Data Center, ``/rest/api/2/search/jql`` on Jira Cloud). Jira
  takes no idempotency key: the ledger performs the create at most once, and after an unknown
  outcome the label search says whether it landed. Exactly once. (Jira Cloud's search is
  eventually consistent: an issue created within the last second or two may not show yet, so on
  Cloud a probe that finds nothing right after a crash can repeat the create; Data Center's
  search is read-after-write.)
* ``notify.post`` — a Slack-compatible incoming webhook (``{"text": …}``). Such webhooks
  take no idempotency key and cannot be queried, so the kind declares
  **at-least-once**: after an unknown outcome the message is posted again. For an
  incident channel a repeated line is a nuisance, a missing one (say, the lead time
  of replacement capacity) is a gap in the incident record. The choice is stored on
  every row (``delivery``) and shown by ``fleetmend ledger list/show``.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

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


OPERATION_LABEL_PREFIX = "fleetmend-op-"


def operation_label(op_id: str) -> str:
    """The Jira label that marks the issue an operation opened (labels take no spaces or slashes)."""
    return OPERATION_LABEL_PREFIX + hashlib.sha256(op_id.encode()).hexdigest()[:40]


class JiraProject(BaseModel):
    """Where, and as whom, ``ticket.create`` opens a Jira issue (REST API v2).

    ``user`` set: HTTP Basic ``user:token`` (Jira Cloud: an account's email and API token); unset:
    ``Authorization: Bearer <token>`` (a Jira Data Center personal access token).
    """

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(min_length=1)
    project: str = Field(default="OPS", min_length=1)
    issue_type: str = Field(default="Task", min_length=1)
    user: str | None = None
    token: SecretStr
    search: Literal["datacenter", "cloud"] = "datacenter"

    def authorization(self) -> str:
        secret = self.token.get_secret_value()
        if self.user:
            return "Basic " + base64.b64encode(f"{self.user}:{secret}".encode()).decode()
        return f"Bearer {secret}"

    @property
    def search_path(self) -> str:
        return "/rest/api/2/search/jql" if self.search == "cloud" else "/rest/api/2/search"


class TicketCreate(Effect):
    """Open a Jira issue labelled with the operation; the label is what the probe searches for."""

    delivery = Delivery.EXACTLY_ONCE

    def __init__(self, http: httpx.Client, jira: JiraProject, params: TicketParams) -> None:
        self.http = http
        self.jira = jira
        self.base = jira.base_url.rstrip("/")
        self.params = params

    def body(self, op_id: str) -> bytes:
        description = f"{self.params.body}\n\nOpened by fleetmend, operation {op_id}".lstrip()
        fields = {
            "project": {"key": self.jira.project},
            "issuetype": {"name": self.jira.issue_type},
            "summary": self.params.title,
            "description": description,
            "labels": ["fleetmend", operation_label(op_id)],
        }
        return _json_bytes({"fields": fields})

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self.jira.authorization(), "Accept": "application/json"}

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        response = self.http.post(
            f"{self.base}/rest/api/2/issue",
            content=self.body(attempt.op_id),
            headers={**self._headers(), "Content-Type": "application/json"},
        )
        _raise_for_status(response, f"Jira refused the issue for {attempt.op_id!r}")
        created = response.json()
        return {"ticket": {"key": created.get("key"), "id": created.get("id"), "self": created.get("self")}}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        jql = f'project = "{self.jira.project}" AND labels = "{operation_label(attempt.op_id)}"'
        response = self.http.get(
            f"{self.base}{self.jira.search_path}",
            params={"jql": jql, "fields": "summary,labels", "maxResults": 2},
            headers=self._headers(),
        )
        response.raise_for_status()
        issues = response.json().get("issues") or []
        if not issues:
            return None
        found = issues[0]
        return {"ticket": {"key": found.get("key"), "id": found.get("id"), "self": found.get("self")}}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        parts = urlsplit(f"{self.base}/rest/api/2/issue")
        return ActionSignature(
            world=parts.netloc,
            verb="POST",
            path=parts.path,
            body_digest=body_digest(self.body(attempt.op_id)),
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
    http: httpx.Client, *, tickets: JiraProject | None, notifier_url: str | None
) -> EffectRegistry:
    """``ticket.create`` in the Jira project ``tickets`` and ``notify.post`` to ``notifier_url`` (each when configured)."""
    registry = EffectRegistry(aliases={"ticket": "ticket.create", "notify": "notify.post"})
    if tickets is not None:
        jira = tickets
        registry.register(
            EffectKind(
                name="ticket.create",
                params_model=TicketParams,
                build=lambda p: TicketCreate(http, jira, TicketParams.model_validate(p)),
                delivery=TicketCreate.delivery,
                description=f"Open a Jira issue in {jira.project} (labelled with the operation; exactly once)",
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
