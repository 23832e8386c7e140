"""Agentic users: a share of the load whose generations call tools with side effects.

An agent's completion streams 1-3 tool calls (opening a ticket in the external system: the Jira the
simulator serves, ``sim.serving.jira``, which keeps its own record of every issue it was asked to
open). The caller executes each tool call as the model emits it, mid-stream, as agent frameworks
do. A stream cut after a tool call was executed (its replica died) is retried by the client with
the same idempotency key (``x-request-id``), the model emits the same tool calls again, and the
caller executes them again. Two ways to execute, one per run:

* ``through: ledger`` - every tool call goes to fleetmend's effect API (``POST /v1/effects``) under
  the operation id ``<request id>/<tool call index>``: the ledger performs each once and answers a
  repeat with the first outcome (``replayed``);
* ``through: direct`` - the baseline, as agent frameworks do without a ledger: straight to Jira.

Either way the issue's summary names the operation (``tool call <request id>/<index>``), so the
external system's own log says how many times each was performed (``jira_duplicates``).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.gateway import REQUEST_EFFECT_SLOTS


class AgentSpec(BaseModel):
    """Which requests are agents', how many tool calls they make, and how the caller executes them."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(ge=0.0, le=1.0, description="share of requests that are an agent's (by request id)")
    tool_calls: tuple[int, int] = Field((1, 3), description="tool calls per agent completion, min and max")
    through: Literal["ledger", "direct"] = "ledger"
    effects_url: str | None = Field(
        None, description="fleetmend's effect API, e.g. http://host:8088/v1/effects"
    )
    effects_token: str | None = Field(None, description="FLEETMEND_EFFECTS_TOKEN")
    jira_url: str | None = Field(None, description="the external system, for the direct baseline")
    jira_project: str = "OPS"
    client_retries: int = Field(
        1, ge=0, le=5, description="the client's retries after a terminal stream error"
    )
    first_tool_token: int = Field(
        8, ge=1, description="the token at which the first tool call is emitted (the rest follow every 16)"
    )

    @model_validator(mode="after")
    def _check(self) -> AgentSpec:
        lo, hi = self.tool_calls
        if not 1 <= lo <= hi <= REQUEST_EFFECT_SLOTS:
            raise ValueError(f"tool_calls: need 1 <= min <= max <= {REQUEST_EFFECT_SLOTS} (got [{lo}, {hi}])")
        if self.through == "ledger" and not self.effects_url:
            raise ValueError("through=ledger needs effects_url (fleetmend's POST /v1/effects)")
        if self.through == "direct" and not self.jira_url:
            raise ValueError("through=direct needs jira_url (the external system's base URL)")
        return self


def _fraction(request_id: str, salt: str) -> float:
    digest = hashlib.sha256(f"{salt}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32


def summary_of(op_id: str) -> str:
    return f"tool call {op_id}"


@dataclass
class ToolCallRecord:
    op_id: str
    attempt: int
    status: int | None
    state: str | None = None
    replayed: bool = False
    error: str | None = None


@dataclass
class Agents:
    """The agentic side of one load run: which requests call tools, where in the stream, and what the
    executions answered."""

    spec: AgentSpec
    calls: list[ToolCallRecord] = field(default_factory=list)
    # (request id, tokens the cut attempt streamed, tool calls it had run), per client retry
    retries: list[tuple[str, int, int]] = field(default_factory=list)

    def note_retry(self, request_id: str, tokens: int, positions: list[int]) -> None:
        """The client retries a cut stream; how far the cut attempt got."""
        self.retries.append((request_id, tokens, sum(1 for p in positions if tokens >= p)))

    def tool_positions(self, request_id: str, output_tokens: int) -> list[int]:
        """Token counts at which the agent's tool calls are emitted ([] for a plain request)."""
        if _fraction(request_id, "agent") >= self.spec.share:
            return []
        lo, hi = self.spec.tool_calls
        n = lo + int(_fraction(request_id, "tools") * (hi - lo + 1))
        # An agent's model calls its tools early (a short preamble, a call every 16 tokens), then writes
        # its answer with the results: most of a cut stream's life comes after its tool calls ran.
        return [min(output_tokens, self.spec.first_tool_token + 16 * i) for i in range(n)]

    async def call(self, http: aiohttp.ClientSession, request_id: str, index: int, attempt: int) -> None:
        op_id = f"{request_id}/{index}"
        record = ToolCallRecord(op_id=op_id, attempt=attempt, status=None)
        try:
            if self.spec.through == "ledger":
                assert self.spec.effects_url is not None
                headers = (
                    {"Authorization": f"Bearer {self.spec.effects_token}"} if self.spec.effects_token else {}
                )
                payload = {"operation_id": op_id, "kind": "ticket", "target": "jira",
                           "params": {"title": summary_of(op_id), "body": f"opened by agent request {request_id}"}}  # fmt: skip
                async with http.post(self.spec.effects_url, json=payload, headers=headers) as r:
                    record.status = r.status
                    body: Any = await r.json(content_type=None)
                    if isinstance(body, dict):
                        record.state, record.replayed = body.get("state"), bool(body.get("replayed"))
            else:
                assert self.spec.jira_url is not None
                fields = {"project": {"key": self.spec.jira_project}, "issuetype": {"name": "Task"},
                          "summary": summary_of(op_id), "labels": ["agent"]}  # fmt: skip
                url = self.spec.jira_url.rstrip("/") + "/rest/api/2/issue"
                async with http.post(
                    url, json={"fields": fields}, headers={"Authorization": "Bearer agent"}
                ) as r:
                    record.status = r.status
                    await r.read()
                    record.state = "applied" if r.status == 201 else None
        except (aiohttp.ClientError, ValueError) as exc:
            record.error = str(exc)
        self.calls.append(record)

    def report(self) -> dict[str, int]:
        """What the caller saw: tool calls proposed (every execution, repeats too); performed (executions
        that acted on the external system - through the ledger each operation once, directly every
        repeat too); deduplicated (repeats the ledger answered from its record); failed."""
        ok = [c for c in self.calls if c.status in (200, 201) and c.state == "applied"]
        return {
            "proposed": len(self.calls),
            "performed": sum(1 for c in ok if not c.replayed),
            "deduplicated": sum(1 for c in ok if c.replayed),
            "failed": len(self.calls) - len(ok),
            "retried_requests": len(self.retries),
            "retried_after_a_tool_call": sum(1 for _, _, ran in self.retries if ran > 0),
        }


def jira_duplicates(summaries: Iterable[str]) -> dict[str, int]:
    """From the external system's own record: issues per tool call, and how many were extra."""
    counts = Counter(s for s in summaries if s.startswith("tool call "))
    return {
        "issues": sum(counts.values()),
        "operations": len(counts),
        "duplicates": sum(n - 1 for n in counts.values()),
    }


def issue_summaries(issues: Iterable[Mapping[str, Any]]) -> list[str]:
    return [str((i.get("fields") or {}).get("summary", "")) for i in issues]


async def jira_record(http: httpx.AsyncClient, base_url: str) -> dict[str, int]:
    """``jira_duplicates`` of every issue the simulated Jira at ``base_url`` holds, read through its own
    search API (one page: the simulator does not cap ``maxResults``)."""
    r = await http.get(
        base_url.rstrip("/") + "/rest/api/2/search",
        params={"jql": "", "maxResults": "1000000"},
        headers={"Authorization": "Bearer fleetmend"},
    )
    r.raise_for_status()
    return jira_duplicates(issue_summaries(r.json()["issues"]))
