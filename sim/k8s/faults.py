"""Fault knobs for the simulated API itself (for retry and unknown-outcome tests).

A rule makes a share of matching requests fail with 500, 429 or 409, be refused
as RBAC refuses (403 Forbidden) or as admission/validation refuses (422 Invalid), or time
out (the server holds the request for ``delay_s`` wall seconds, then answers
504 — optionally *after* applying the change, the nasty "did it happen?" case).
Randomness is seeded so a scenario replays the same failures.
"""

from __future__ import annotations

import random
import threading
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from sim.k8s.errors import ApiError, conflict, forbidden, internal_error, invalid, too_many_requests

_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}

Verb = Literal["GET", "POST", "PUT", "PATCH", "DELETE"]


class ApiFaultRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verbs: list[Verb] = Field(default_factory=lambda: list[Verb](["PATCH"]))
    path_contains: str = Field("", description="only requests whose path contains this text")
    body_contains: str = Field(
        "",
        description="only requests whose body contains this text (one change among several to the same "
        "object, e.g. a label removal but not an annotation patch of the same pod)",
    )
    error: Literal["500", "429", "409", "403", "422", "timeout"]
    rate: float = Field(1.0, ge=0.0, le=1.0, description="share of matching requests that fail")
    count: int | None = Field(None, ge=1, description="stop after this many injected failures")
    delay_s: float = Field(5.0, ge=0.0, le=120.0, description="wall seconds a timeout holds the request")
    apply_before_timeout: bool = Field(False, description="timeouts: perform the change, then time out")
    retry_after_s: int = Field(1, ge=0, description="429: Retry-After seconds")


class ApiFaultRuleSet(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[ApiFaultRule] = Field(default_factory=list)


class ApiFaults:
    """The active rules; ``pick`` decides whether a request is hit."""

    def __init__(self, seed: int = 0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[ApiFaultRule] = []
        self._used: list[int] = []

    def set_rules(self, rules: list[ApiFaultRule]) -> None:
        with self._lock:
            self._rules = list(rules)
            self._used = [0] * len(rules)

    def rules(self) -> list[ApiFaultRule]:
        with self._lock:
            return list(self._rules)

    def pick(self, verb: str, path: str, body: bytes = b"") -> ApiFaultRule | None:
        with self._lock:
            for index, rule in enumerate(self._rules):
                if verb not in rule.verbs or rule.path_contains not in path:
                    continue
                if rule.body_contains and rule.body_contains.encode() not in body:
                    continue
                if rule.count is not None and self._used[index] >= rule.count:
                    continue
                if self._rng.random() < rule.rate:
                    self._used[index] += 1
                    return rule
            return None


def error_for(
    rule: ApiFaultRule, resource: str, name: str, group: str, *, verb: str = "PATCH", namespace: str = ""
) -> ApiError:
    """The Status error an injected (non-timeout) fault answers with."""
    if rule.error == "403":
        return forbidden(
            "system:serviceaccount:fleetmend:fleetmend",
            _VERBS.get(verb, verb.lower()),
            resource,
            name,
            namespace,
            group,
        )
    if rule.error == "422":
        kind = resource[:-1].capitalize() if resource.endswith("s") else resource
        return invalid(
            kind, name or "unknown", "metadata", "refused by an admission policy (injected fault)", group
        )
    if rule.error == "429":
        return too_many_requests(
            "the server has received too many requests and has asked us to try again later",
            retry_after=rule.retry_after_s,
        )
    if rule.error == "409":
        return conflict(resource, name or "unknown", group)
    return internal_error("injected fault (fleetmend simulator)")


class ApiServerRestart(BaseModel):
    """Restart the simulated API server as a real kube-apiserver restart looks to its clients.

    Every open connection is reset at once (open watches break mid-stream), connections are
    refused for ``down_s`` wall seconds, then the server serves again from a fresh watch cache:
    a watch resuming from a resourceVersion older than the restart gets 410 Expired. The world
    (controllers, kubelets, faults) keeps running meanwhile, as a cluster does behind an
    API server that one client cannot reach.
    """

    model_config = ConfigDict(extra="forbid")

    down_s: float = Field(3.0, ge=0.0, le=120.0, description="wall seconds connections are refused")


class ApiServerState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    serving: bool = Field(description="the API server accepts connections")
    restarts: int = Field(description="restarts so far")
    open_watches: int = Field(description="watch streams open now")
    watch_cache_starts_at: int = Field(
        description="the oldest resourceVersion a watch may resume from (0: before any restart)"
    )
