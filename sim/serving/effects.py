"""Effects the simulated model proposes while it serves a request, posted to fleetmend's effect API.

An inference service whose model acts on the world (opens a ticket, say) proposes each effect to
fleetmend's ``POST /v1/effects`` under an operation id derived from the request id, so a request
the gateway retries on another replica proposes the same operation again and the ledger performs
it once. The engines (``sim.serving.pods``) propose for ``share`` of the requests they accept,
chosen by a hash of the request id; ``GET|PUT /sim/v1/serving/effects`` set where and how often.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field


class EffectsConfig(BaseModel):
    """Where the simulated model proposes external effects, and for which share of requests."""

    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(
        default=None, description="fleetmend's effect endpoint, e.g. http://host:8088/v1/effects"
    )
    share: float = Field(default=0.0, ge=0.0, le=1.0)
    kind: str = Field(default="ticket", min_length=1)
    target: str = Field(default="jira", min_length=1)
    token: str | None = Field(
        default=None,
        min_length=1,
        description="bearer token sent with every proposal (fleetmend's FLEETMEND_EFFECTS_TOKEN); "
        "write-only: reads show only whether one is set",
    )
    token_set: bool = Field(default=False, description="read-only: a token is configured")

    def shown(self) -> EffectsConfig:
        """The configuration as a read answers it: the token left out."""
        return self.model_copy(update={"token": None, "token_set": self.token is not None})


class EffectProposer:
    """Posts a request's proposed effect; ``answers`` keeps what the effect API said, by operation id."""

    def __init__(self, config: EffectsConfig | None = None) -> None:
        self.config = config or EffectsConfig()
        self.answers: dict[str, dict[str, Any]] = {}
        self._http: httpx.AsyncClient | None = None

    def proposes(self, request_id: str) -> bool:
        """Deterministic per request id, so a retried request proposes again."""
        if not self.config.url or self.config.share <= 0:
            return False
        digest = hashlib.sha256(request_id.encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < self.config.share

    async def propose(self, request_id: str) -> list[str]:
        """Post the request's effect (if it proposes one); the operation ids proposed."""
        if not self.proposes(request_id):
            return []
        assert self.config.url is not None
        op_id = f"{request_id}/0"
        payload = {
            "operation_id": op_id,
            "kind": self.config.kind,
            "target": self.config.target,
            "params": {
                "title": f"inference request {request_id}",
                "body": f"proposed by request {request_id}",
            },
        }
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=5.0)
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        t0 = time.monotonic()
        try:
            r = await self._http.post(self.config.url, json=payload, headers=headers)
            body: Any
            try:
                body = r.json()
            except ValueError:
                body = r.text
            self.answers[op_id] = {"status": r.status_code, "body": body, "latency_s": time.monotonic() - t0}
        except httpx.HTTPError as exc:
            self.answers[op_id] = {"status": None, "error": str(exc)}
        return [op_id]

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
