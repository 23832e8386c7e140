"""The gateway users hit: routing set, weights, admission, retries, streaming, journal.

One ``Router`` serves every pool (``namespace/service``). For each request it

1. resolves the pool (``pool`` field or the model the pool serves),
2. sheds it at once if its tier is shed (429) - a partially shed tier refuses that share of
   its requests, chosen by a hash of the request id (``admission_draw``), so the same request
   gets the same answer on every retry - or nothing can take it (503),
3. picks a replica by weight from the routing set — EndpointSlice ``ready``
   endpoints of the pool's Service whose pods carry the router-only label —
   skipping replicas whose queue is at the admission bound,
4. streams tokens as the engine produces them. A replica that fails before the
   first token reached the caller may be retried on another replica (policy
   on, attempts left, retry budget not exhausted, backoff with jitter); once a
   token has been streamed, a failure ends the stream with a terminal error —
   never a silent replay.

Every attempt is journaled. The HTTP handler (``sim.serving.http``) and the
in-process load generator call the same ``Router.complete``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from fleet.protocol import (
    AdmissionChange,
    JournalEntry,
    Outcome,
    RetryPolicy,
    RetryPolicyChange,
    RoutedEndpoint,
    RouterState,
    RoutingSet,
    WeightsChange,
)
from fleet.vocabulary import MODEL_LABEL, ROUTER_LABEL, ROUTER_LABEL_VALUE, Tier
from sim.clock import SimClock
from sim.serving.engine import Engine, EngineRefused, EngineRequest
from sim.serving.journal import Journal
from sim.serving.kubeview import KubeView, pod_labels
from sim.serving.streams import StreamEvent, TokenStream


def admission_draw(request_id: str) -> float:
    """A request's admission draw in [0, 1): refused when below its tier's shed share (deterministic)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class RouterConfig(BaseModel):
    """Gateway settings that are not part of the versioned admin state."""

    model_config = ConfigDict(extra="forbid")

    router_label: str = ROUTER_LABEL
    router_label_value: str = ROUTER_LABEL_VALUE
    endpoint_condition: Literal["ready", "ready-and-serving"] = Field(
        default="ready", description="'ready' follows EndpointSlice ready only, as most gateways do"
    )
    default_deadline_s: dict[Tier, float] = Field(
        default_factory=lambda: {Tier.CRITICAL: 5.0, Tier.STANDARD: 10.0, Tier.SHEDDABLE: 20.0}
    )
    stream_idle_timeout_s: float = Field(
        default=30.0, gt=0, description="no token for this long ends a stream"
    )
    retry_budget_window_s: float = Field(default=10.0, gt=0)
    retry_budget_min_retries: int = Field(
        default=3, ge=0, description="retries always allowed per window (Envoy-style)"
    )
    effect_url: str | None = Field(default=None, description="POST target for inference-proposed effects")
    effect_share: float = Field(
        default=0.0, ge=0, le=1, description="share of requests that propose an effect"
    )
    effect_kind: str = "ticket"
    effect_target: str = "jira"
    effect_token: str | None = Field(
        default=None, description="bearer token for effect_url (fleetmend's FLEETMEND_EFFECTS_TOKEN)"
    )
    seed: int = 0


class CompletionRequest(BaseModel):
    """OpenAI ``/v1/completions`` body, plus the gateway's extensions (tier, deadline, pool)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    prompt: str | list[str] = ""
    max_tokens: int = Field(default=16, ge=1, le=4096)
    stream: bool = False
    tier: Tier = Tier.STANDARD
    deadline_s: float | None = Field(default=None, gt=0, description="relative to arrival, sim seconds")
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    pool: str | None = Field(default=None, description="namespace/service; default: the pool serving `model`")
    prompt_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="simulated prompt length")
    output_tokens: int | None = Field(
        default=None, ge=1, le=4096, description="tokens the model will produce"
    )


class GatewayError(Exception):
    """A refusal the caller sees as an HTTP error before any byte of a stream."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


@dataclass
class PoolRouter:
    pool: str
    state: RouterState
    arrivals: deque[float] = field(default_factory=deque)
    retries: deque[float] = field(default_factory=deque)
    admitted: int = 0  # requests past admission (first attempts), ever: RouterState.admitted_requests_total


@dataclass
class Completion:
    """An admitted request whose first token has arrived; iterate ``events()`` for the rest."""

    request_id: str
    pool: str
    replica: str
    model: str
    tier: Tier
    created: float
    ttft_s: float
    first_tokens: int
    events: Callable[[], AsyncIterator[StreamEvent]]
    attempt: int


class Router:
    def __init__(
        self,
        clock: SimClock,
        kube: KubeView,
        engines: Callable[[str], Engine | None],
        journal: Journal,
        config: RouterConfig | None = None,
    ) -> None:
        self.clock = clock
        self.kube = kube
        self.engine_for = engines
        self.journal = journal
        self.config = config or RouterConfig()
        self._rng = random.Random(self.config.seed)
        self._pools: dict[str, PoolRouter] = {}
        self._http: httpx.AsyncClient | None = None
        self.effect_answers: dict[str, dict[str, Any]] = {}
        self._served_cache: tuple[tuple[int, int], dict[str, str]] | None = None

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()

    # ---- admin state ------------------------------------------------------------------
    def pool(self, key: str) -> PoolRouter:
        """The router state of pool ``namespace/service``; KeyError with a message if no such Service."""
        existing = self._pools.get(key)
        if existing is not None:
            return existing
        namespace, _, service = key.partition("/")
        if not service or self.kube.service(namespace, service) is None:
            known = sorted(
                f"{s['metadata']['namespace']}/{s['metadata']['name']}" for s in self.kube.services()
            )
            raise KeyError(
                f"no pool {key!r}: there is no Service {service!r} in namespace {namespace!r} (known: {known})"
            )
        created = PoolRouter(key, RouterState(pool=key, version=1))
        self._pools[key] = created
        return created

    def state(self, key: str) -> RouterState:
        pool = self.pool(key)
        return pool.state.model_copy(deep=True, update={"admitted_requests_total": pool.admitted})

    def _change(self, key: str, replaces: int, **fields: Any) -> RouterState:
        pool = self.pool(key)
        if replaces != pool.state.version:
            raise StaleVersion(pool.state.version, replaces)
        pool.state = pool.state.model_copy(update={**fields, "version": pool.state.version + 1})
        return pool.state.model_copy(deep=True)

    def set_weights(self, key: str, change: WeightsChange) -> RouterState:
        bad = {k: v for k, v in change.weights.items() if v < 0}
        if bad:
            raise ValueError(f"weights must be >= 0 (0 stops routing to a replica); got {bad}")
        return self._change(key, change.replaces_version, weights=dict(change.weights))

    def set_admission(self, key: str, change: AdmissionChange) -> RouterState:
        return self._change(key, change.replaces_version, admission=change.admission.model_copy())

    def set_retry_policy(self, key: str, change: RetryPolicyChange) -> RouterState:
        return self._change(key, change.replaces_version, retry=change.retry.model_copy())

    def routing_set(self, key: str) -> RoutingSet:
        pool = self.pool(key)
        namespace = key.partition("/")[0]
        return RoutingSet(
            pool=key, version=pool.state.version, endpoints=self._endpoints(namespace, key, pool)
        )

    def _endpoints(self, namespace: str, key: str, pool: PoolRouter) -> list[RoutedEndpoint]:
        service = key.partition("/")[2]
        out: list[RoutedEndpoint] = []
        seen: set[str] = set()
        # An endpoint the weights do not name (e.g. a replacement that just turned Ready) gets the
        # mean of the named ones: an equal share, on the same scale as the operator's weights.
        named = list(pool.state.weights.values())
        default_weight = sum(named) / len(named) if named else 1.0
        for eps in self.kube.endpoint_slices(namespace, service):
            for ep in eps.get("endpoints") or []:
                cond = ep.get("conditions") or {}
                if cond.get("ready") is False:
                    continue
                if self.config.endpoint_condition == "ready-and-serving" and cond.get("serving") is False:
                    continue
                ref = ep.get("targetRef") or {}
                name = ref.get("name")
                if not name or name in seen:
                    continue
                pod = self.kube.pod(namespace, name)
                if (
                    pod is None
                    or pod_labels(pod).get(self.config.router_label) != self.config.router_label_value
                ):
                    continue
                seen.add(name)
                weight = pool.state.weights.get(name, default_weight)
                addresses = ep.get("addresses") or [""]
                out.append(
                    RoutedEndpoint(pod=name, address=addresses[0], node=ep.get("nodeName"), weight=weight)
                )
        return sorted(out, key=lambda e: e.pod)

    def resolve_pool(self, req: CompletionRequest) -> str:
        if req.pool:
            self.pool(req.pool)
            return req.pool
        for svc in self.kube.services():
            ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            if f"{ns}/{name}" == req.model or name == req.model:
                return f"{ns}/{name}"
        served = self.served_models()
        if req.model in served:
            return served[req.model]
        raise GatewayError(
            404,
            "model_not_found",
            f"no pool serves model {req.model!r}; known models: {sorted(served)} "
            "(or name the pool with 'pool': 'namespace/service')",
        )

    def served_models(self) -> dict[str, str]:
        """Model names (label value and served name) -> pool key, from the pods behind each Service."""
        # Engines start without a cluster change: let the cache live at most a wall second.
        generation = (self.kube.generation, int(time.monotonic()))
        if self._served_cache is not None and self._served_cache[0] == generation:
            return self._served_cache[1]
        out = self._scan_served_models()
        if out:
            self._served_cache = (generation, out)
        return out

    def _scan_served_models(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for svc in self.kube.services():
            selector = (svc.get("spec") or {}).get("selector") or {}
            if not selector:
                continue
            ns = svc["metadata"]["namespace"]
            for pod in self.kube.pods():
                labels = pod_labels(pod)
                if pod["metadata"]["namespace"] != ns or any(labels.get(k) != v for k, v in selector.items()):
                    continue
                model = labels.get(MODEL_LABEL)
                if model:
                    out.setdefault(model, f"{ns}/{svc['metadata']['name']}")
                    engine = self.engine_for(f"{ns}/{pod['metadata']['name']}")
                    if engine is not None:
                        out.setdefault(engine.metrics_model_name, f"{ns}/{svc['metadata']['name']}")
        return out

    # ---- the data path ----------------------------------------------------------------------
    async def complete(self, req: CompletionRequest) -> Completion:
        """Admit, route and start one request; returns once its first token exists.

        Raises ``GatewayError`` (journaled) when the request is shed, rejected or fails
        before its first token with no retry left.
        """
        started = self.clock.now()
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex[:16]}"
        key = self.resolve_pool(req)
        pool = self.pool(key)
        state = pool.state
        deadline = started + (req.deadline_s or self.config.default_deadline_s[req.tier])
        self._note(pool.arrivals, started)

        def journal(outcome: Outcome, replica: str | None, attempt: int, detail: str, **kw: Any) -> None:
            self.journal.record(
                JournalEntry(
                    request_id=request_id,
                    pool=key,
                    tier=req.tier,
                    outcome=outcome,
                    replica=replica,
                    attempt=attempt,
                    started_at=kw.pop("attempt_started", started),
                    ended_at=self.clock.now(),
                    detail=detail,
                    **kw,
                )
            )

        share = state.admission.shed_share(req.tier)
        if share > 0.0 and (share >= 1.0 or admission_draw(request_id) < share):
            detail = (
                f"tier {req.tier.value} is shed by admission control"
                if share >= 1.0
                else f"{share:.1%} of tier {req.tier.value} is shed by admission control"
            )
            journal(Outcome.SHED, None, 1, detail)
            raise GatewayError(
                429,
                "shed",
                f"request shed: tier {req.tier.value!r} is not admitted right now; retry later or use a higher tier",
                {"Retry-After": "1"},
            )

        pool.admitted += 1
        prompt_tokens = req.prompt_tokens or max(1, len(str(req.prompt).split()))
        output_tokens = min(req.output_tokens or req.max_tokens, req.max_tokens)
        tried: set[str] = set()
        attempt = 0
        while True:
            attempt += 1
            attempt_started = self.clock.now()
            replica = self._choose(key, pool, tried)
            if replica is None:
                reason = (
                    "no replica in the routing set"
                    if not tried
                    else "every replica in the routing set is at its queue bound or already failed this request"
                )
                if state.admission.queue_bound is not None and not tried:
                    reason = f"{reason} (queue bound {state.admission.queue_bound})"
                journal(Outcome.REJECTED, None, attempt, reason, attempt_started=attempt_started)
                raise GatewayError(503, "rejected", f"request rejected: {reason}", {"Retry-After": "1"})
            tried.add(replica)
            namespace = key.partition("/")[0]
            engine = self.engine_for(f"{namespace}/{replica}")
            sink = TokenStream()
            ereq = EngineRequest(request_id, prompt_tokens, output_tokens, req.max_tokens, sink)
            failure: str | None = None
            effects: list[str] = []
            if engine is None:
                failure = f"connection refused by {replica} (no serving process)"
            else:
                try:
                    engine.submit(ereq, self.clock.now())
                except EngineRefused as refused:
                    failure = refused.message
            if failure is None and engine is not None:
                try:
                    effects = await self._propose_effects(request_id)
                    failure = await sink.first_token(self.clock, deadline, engine, ereq)
                except asyncio.CancelledError:
                    # The caller went away before its first token: free the engine's slot.
                    if engine is not None:
                        engine.cancel(ereq, self.clock.now())
                    raise
                if failure == "deadline":
                    journal(
                        Outcome.LATE,
                        replica,
                        attempt,
                        "no first token before the request's deadline; gateway timed out",
                        attempt_started=attempt_started,
                        effect_operation_ids=effects,
                    )
                    raise GatewayError(
                        504, "deadline_exceeded", f"no first token from {replica} before the deadline"
                    )
            if failure is None:
                break
            retry_ok, why = self._may_retry(pool, attempt)
            if retry_ok:
                journal(
                    Outcome.RETRIED,
                    replica,
                    attempt,
                    f"failed before first byte ({failure}); retrying on another replica",
                    attempt_started=attempt_started,
                    effect_operation_ids=effects,
                )
                self._note(pool.retries, self.clock.now())
                await self._backoff(state.retry, attempt)
                continue
            journal(
                Outcome.TERMINAL_ERROR,
                replica,
                attempt,
                f"failed before first byte ({failure}); not retried: {why}",
                attempt_started=attempt_started,
                effect_operation_ids=effects,
            )
            raise GatewayError(
                502, "upstream_failed", f"replica {replica} failed ({failure}); not retried: {why}"
            )

        assert engine is not None and sink.first_token_at is not None
        first = sink.take_pending()
        ttft = sink.first_token_at - started
        served_by = replica
        n_attempt = attempt

        async def events() -> AsyncIterator[StreamEvent]:
            outcome: Outcome | None = None
            detail = ""
            inner = sink.events(self.clock, engine, ereq, self.config.stream_idle_timeout_s)
            try:
                async for event in inner:
                    if event.kind == "done":
                        late = self.clock.now() > deadline
                        outcome = Outcome.LATE if late else Outcome.COMPLETED
                        detail = f"finished ({sink.finished})" + (" after its deadline" if late else "")
                    elif event.kind == "error":
                        outcome = Outcome.TERMINAL_ERROR
                        if event.cause == "stalled":
                            detail = (
                                f"replica {served_by} stalled: no token for {self.config.stream_idle_timeout_s:g}s "
                                f"after {sink.total_tokens} token(s)"
                            )
                        else:
                            detail = f"replica {served_by} failed after {sink.total_tokens} streamed token(s): {event.message}"
                        event = StreamEvent("error", message=detail, cause=event.cause)
                    yield event
            finally:
                await inner.aclose()  # type: ignore[attr-defined]
                if outcome is None:
                    outcome, detail = Outcome.TERMINAL_ERROR, "caller disconnected mid-stream"
                journal(
                    outcome,
                    served_by,
                    n_attempt,
                    detail,
                    attempt_started=attempt_started,
                    ttft_s=ttft,
                    tokens_streamed=sink.total_tokens,
                    truncated=sink.finished is None,
                    effect_operation_ids=effects,
                )

        return Completion(
            request_id=request_id,
            pool=key,
            replica=replica,
            model=req.model,
            tier=req.tier,
            created=started,
            ttft_s=ttft,
            first_tokens=first,
            events=events,
            attempt=attempt,
        )

    def _choose(self, key: str, pool: PoolRouter, tried: set[str]) -> str | None:
        namespace = key.partition("/")[0]
        bound = pool.state.admission.queue_bound
        candidates: list[tuple[str, float]] = []
        for ep in self._endpoints(namespace, key, pool):
            if ep.pod in tried or ep.weight <= 0:
                continue
            if bound is not None:
                engine = self.engine_for(f"{namespace}/{ep.pod}")
                if engine is not None and engine.num_waiting >= bound:
                    continue
            candidates.append((ep.pod, ep.weight))
        if not candidates:
            return None
        total = sum(w for _, w in candidates)
        pick = self._rng.random() * total
        for pod, weight in candidates:
            pick -= weight
            if pick <= 0:
                return pod
        return candidates[-1][0]

    def _note(self, window: deque[float], now: float) -> None:
        window.append(now)
        horizon = now - self.config.retry_budget_window_s
        while window and window[0] < horizon:
            window.popleft()

    def _may_retry(self, pool: PoolRouter, attempt: int) -> tuple[bool, str]:
        policy = pool.state.retry
        if not policy.retry_before_first_byte:
            return False, "retries are disabled by the retry policy"
        if attempt >= policy.max_attempts:
            return False, f"max attempts ({policy.max_attempts}) reached"
        now = self.clock.now()
        horizon = now - self.config.retry_budget_window_s
        while pool.retries and pool.retries[0] < horizon:
            pool.retries.popleft()
        while pool.arrivals and pool.arrivals[0] < horizon:
            pool.arrivals.popleft()
        allowed = max(
            float(self.config.retry_budget_min_retries), policy.budget_fraction * len(pool.arrivals)
        )
        if len(pool.retries) + 1 > allowed:
            return False, (
                f"retry budget exhausted ({len(pool.retries)} retries for {len(pool.arrivals)} requests in the last "
                f"{self.config.retry_budget_window_s:g}s, budget fraction {policy.budget_fraction:g})"
            )
        return True, ""

    async def _backoff(self, policy: RetryPolicy, attempt: int) -> None:
        delay = min(policy.backoff_max_s, policy.backoff_base_s * (2 ** (attempt - 1)))
        if policy.jitter:
            delay = self._rng.uniform(0.0, delay)
        if delay > 0:
            await self.clock.sleep(delay)

    # ---- inference-proposed effects -----------------------------------------------------------
    def proposes_effect(self, request_id: str) -> bool:
        """Deterministic per request id, so a retried request proposes again."""
        share = self.config.effect_share
        if not self.config.effect_url or share <= 0:
            return False
        digest = hashlib.sha256(request_id.encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32 < share

    async def _propose_effects(self, request_id: str) -> list[str]:
        if not self.proposes_effect(request_id):
            return []
        assert self.config.effect_url is not None
        op_id = f"{request_id}/0"
        payload = {
            "operation_id": op_id,
            "kind": self.config.effect_kind,
            "target": self.config.effect_target,
            "params": {
                "title": f"inference request {request_id}",
                "body": f"proposed by request {request_id}",
            },
        }
        if self._http is None:
            self._http = httpx.AsyncClient(timeout=5.0)
        t0 = time.monotonic()
        try:
            headers = (
                {"Authorization": f"Bearer {self.config.effect_token}"} if self.config.effect_token else {}
            )
            r = await self._http.post(self.config.effect_url, json=payload, headers=headers)
            body: Any
            try:
                body = r.json()
            except ValueError:
                body = r.text
            self.effect_answers[op_id] = {
                "status": r.status_code,
                "body": body,
                "latency_s": time.monotonic() - t0,
            }
        except httpx.HTTPError as exc:
            self.effect_answers[op_id] = {"status": None, "error": str(exc)}
        return [op_id]


class StaleVersion(Exception):
    def __init__(self, current: int, given: int) -> None:
        super().__init__(
            f"stale router state: the change replaces version {given} but the current version is {current}; "
            "read the state again and re-apply your (absolute) change"
        )
        self.current = current
