"""Open-loop load: Poisson arrivals at a set rate with a tier mix, and what users saw.

Arrivals are a pure function of the seed (same seed, same arrivals: inter-arrival
times, tiers, prompt and output lengths, request ids), independent of how the
fleet responds — open loop, as real users behave. The target is any OpenAI-compatible
HTTP endpoint (``GatewayTarget``): a gateway such as Envoy, or one engine at its pod IP,
over real HTTP/SSE (aiohttp, streaming). Each request names its tier in the
``x-fleetmend-tier`` header (``TIER_HEADER``), its id in ``x-request-id`` and the model in
the body; per request it records the status, time to first token, tokens streamed, whether
the stream ended without ``[DONE]``, a refusal's ``retry-after``, and the upstream that
served it when the gateway names it in a response header (``upstream_header``, e.g. one
Envoy adds with ``%UPSTREAM_HOST%``). ``start_load`` also takes a ``ServingLayer`` or a
``SimWorld`` whose gateway is set (``PUT /sim/v1/gateway``): the load then goes through that
gateway, timed by the world's clock in-process.

The report counts goodput (completed within deadline), late, shed, rejected,
terminal errors, truncated streams and retries, and per-replica TTFT
percentiles, over any window of arrival times. Its clients can retry a refusal as the OpenAI SDKs
do (``LoadSpec.client_retries``: after the answer's Retry-After, same request id).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.vocabulary import TIER_HEADER, Tier
from sim.serving.agents import Agents, AgentSpec
from sim.serving.engine import EngineSpec
from sim.serving.grade import CapacityRecord, Job, LoadGrade, grade
from sim.serving.streams import TOKEN_TEXT

DEFAULT_DEADLINES: dict[Tier, float] = {Tier.CRITICAL: 5.0, Tier.STANDARD: 10.0, Tier.SHEDDABLE: 20.0}


class LoadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate: float = Field(gt=0, le=10_000, description="mean arrivals per sim second")
    duration_s: float = Field(default=60.0, gt=0, description="sim seconds of arrivals")
    seed: int = 0
    tiers: dict[Tier, float] = Field(
        default_factory=lambda: {Tier.CRITICAL: 0.2, Tier.STANDARD: 0.5, Tier.SHEDDABLE: 0.3}
    )
    model: str | None = Field(default=None, description="default: the first model the gateway serves")
    pool: str | None = None
    prompt_tokens: tuple[int, int] = (128, 1024)
    output_tokens: tuple[int, int] = (8, 32)
    deadlines_s: dict[Tier, float] = Field(default_factory=lambda: dict(DEFAULT_DEADLINES))
    stream: bool = True
    tier_priority: dict[Tier, int] | None = Field(
        default=None,
        description="send each tier's vLLM request `priority` (lower first): for engines run with "
        "--scheduling-policy priority, which refuse a priority otherwise",
    )
    give_up_at_deadline: bool = Field(
        default=False,
        description="each client times out at its request's deadline and closes the connection (the "
        "engine aborts the request, as vLLM does for a client gone): a late answer is no answer",
    )
    deadline_priority: bool = Field(
        default=False,
        description="send each request's deadline, in milliseconds from the run's start, as its vLLM "
        "`priority`: engines run with --scheduling-policy priority then serve earliest deadline first "
        "(instead of tier_priority)",
    )
    agents: AgentSpec | None = Field(
        default=None,
        description="a share of users are agents whose completions call tools (sim.serving.agents)",
    )
    client_retries: int = Field(
        default=0,
        ge=0,
        le=10,
        description="retries of an answer refused before its stream (408, 409, 429, 5xx), as the OpenAI "
        "SDKs make them (their default: 2): after the answer's Retry-After when 0 < it <= 60 s, else "
        "0.5 s doubling to 8 s less up to 25 % jitter; same x-request-id; the deadline's clock keeps "
        "running from the arrival",
    )

    @property
    def longest_deadline_s(self) -> float:
        return max(self.deadlines_s.get(t, DEFAULT_DEADLINES[t]) for t in Tier)

    @model_validator(mode="after")
    def _check(self) -> LoadSpec:
        if not self.tiers or sum(self.tiers.values()) <= 0 or any(v < 0 for v in self.tiers.values()):
            raise ValueError(
                "tiers: give non-negative shares with a positive sum, e.g. {critical: 0.2, standard: 0.8}"
            )
        for name, (lo, hi) in (("prompt_tokens", self.prompt_tokens), ("output_tokens", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= min <= max (got [{lo}, {hi}])")
        if self.deadline_priority and self.tier_priority is not None:
            raise ValueError("deadline_priority and tier_priority both set a request's priority: give one")
        return self


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    request_id: str
    tier: Tier
    prompt_tokens: int
    output_tokens: int


def arrivals(spec: LoadSpec) -> list[Arrival]:
    """The seeded open-loop arrival sequence."""
    rng = random.Random(spec.seed)
    tiers = list(spec.tiers)
    weights = [spec.tiers[t] for t in tiers]
    out: list[Arrival] = []
    t = 0.0
    n = 0
    while True:
        t += rng.expovariate(spec.rate)
        if t >= spec.duration_s:
            return out
        n += 1
        tier = rng.choices(tiers, weights)[0]
        out.append(
            Arrival(
                offset_s=t,
                request_id=f"load-{spec.seed}-{n:06d}",
                tier=tier,
                prompt_tokens=rng.randint(*spec.prompt_tokens),
                output_tokens=rng.randint(*spec.output_tokens),
            )
        )


@dataclass(frozen=True)
class GatewayTarget:
    """An OpenAI-compatible HTTP endpoint to send the load to (a gateway, or one engine's pod IP).

    ``speed``: sim seconds per wall second of the world behind it (arrival times and
    latencies are in sim seconds); None asks the simulator at ``url`` (``/sim/v1/clock``).
    ``upstream_header``: the response header naming the upstream that served a request;
    without one the target itself (``host:port``) is taken as the server.
    ``attempt_header``: the response header with the attempt that served it, if any.
    """

    url: str
    speed: float | None = 1.0
    upstream_header: str | None = None
    attempt_header: str | None = None
    # The Host a request for a model carries (a gateway routes pools by it: Envoy's virtual hosts
    # answer the pool Service's names); None sends the URL's own host.
    host_for: Callable[[str], str | None] | None = None
    # The replica's name for what ``upstream_header`` says (e.g. Envoy's "ip:port" → the pod).
    replica_of: Callable[[str], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"GatewayTarget url must be an http(s) URL (got {self.url!r})")
        if self.speed is not None and self.speed <= 0:
            raise ValueError(f"GatewayTarget speed must be > 0 (got {self.speed})")

    @property
    def authority(self) -> str:
        return urlsplit(self.url).netloc


@dataclass
class RequestResult:
    request_id: str
    tier: Tier
    arrived_at: float  # sim seconds since the run started
    outcome: str  # goodput | late | shed | rejected | terminal_error | truncated | not_found
    replica: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    expected_tokens: int = 0
    attempts: int = 1  # the gateway's attempts on the answer the client kept (Envoy's own retries)
    client_calls: int = 1  # the client's calls: 1 + its retries of refusals (LoadSpec.client_retries)
    status: int | None = None
    truncated: bool = False  # the stream started and ended without [DONE]
    retry_after_s: float | None = None  # a refusal's Retry-After


class ReplicaLatency(BaseModel):
    requests: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None


class LoadReport(BaseModel):
    sent: int
    finished: int
    in_flight: int
    goodput: int = Field(description="completed within deadline")
    late: int
    shed: int
    shed_with_retry_after: int = Field(0, description="shed answers that told the client when to retry")
    rejected: int
    terminal_errors: int
    truncated_streams: int = Field(description="streams that ended before their last token")
    retried: int = Field(description="requests served on a later attempt")
    served_after_refusal: int = Field(
        0, description="requests served on a client's retry of a refusal (LoadSpec.client_retries)"
    )
    by_tier: dict[str, dict[str, int]]
    per_replica: dict[str, ReplicaLatency]
    window_s: tuple[float, float]
    inference_effects: dict[str, int] | None = Field(
        default=None,
        description="agents' tool calls as the caller saw them (sim.serving.agents.Agents.report)",
    )

    def goodput_fraction(self) -> float:
        return self.goodput / self.finished if self.finished else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return round(ordered[index], 4)


def summarize(results: list[RequestResult], sent: int, window: tuple[float, float]) -> LoadReport:
    lo, hi = window
    chosen = [r for r in results if lo <= r.arrived_at < hi]
    count = {k: 0 for k in ("goodput", "late", "shed", "rejected", "terminal_error", "not_found")}
    by_tier: dict[str, dict[str, int]] = {}
    ttfts: dict[str, list[float]] = {}
    truncated = retried = told_when = after_refusal = 0
    for r in chosen:
        if r.outcome == "shed" and r.retry_after_s is not None:
            told_when += 1
        count[r.outcome] = count.get(r.outcome, 0) + 1
        by_tier.setdefault(r.tier.value, {}).setdefault(r.outcome, 0)
        by_tier[r.tier.value][r.outcome] += 1
        if r.tokens and r.outcome == "terminal_error" and (r.truncated or r.tokens < r.expected_tokens):
            truncated += 1
        if r.attempts > 1 and r.outcome in ("goodput", "late"):
            retried += 1
        if r.client_calls > 1 and r.outcome in ("goodput", "late"):
            after_refusal += 1
        if r.replica is not None and r.ttft_s is not None:
            ttfts.setdefault(r.replica, []).append(r.ttft_s)
    per_replica = {
        replica: ReplicaLatency(
            requests=len(values),
            ttft_p50_s=percentile(values, 0.5),
            ttft_p90_s=percentile(values, 0.9),
            ttft_p99_s=percentile(values, 0.99),
        )
        for replica, values in sorted(ttfts.items())
    }
    return LoadReport(
        sent=sent,
        finished=len(chosen),
        in_flight=max(0, sent - len(results)),
        goodput=count["goodput"],
        late=count["late"],
        shed=count["shed"],
        shed_with_retry_after=told_when,
        rejected=count["rejected"] + count["not_found"],
        terminal_errors=count["terminal_error"],
        truncated_streams=truncated,
        retried=retried,
        served_after_refusal=after_refusal,
        by_tier=by_tier,
        per_replica=per_replica,
        window_s=window,
    )


class LoadRun:
    """A running (or finished) load; ``await run.wait()`` for the final report."""

    def __init__(self, target: GatewayTarget, spec: LoadSpec, *, world: Any = None) -> None:
        """``world``: the serving layer behind a ``GatewayTarget``, when the load runs inside the
        simulator (its clock and the models it serves are then read in-process)."""
        self.id = uuid.uuid4().hex[:12]
        self.spec = spec
        self.results: list[RequestResult] = []
        self.sent = 0
        self._gateway: GatewayTarget = target
        self._layer: Any = world
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._http: aiohttp.ClientSession | None = None
        self._speed = 1.0
        self._start_sim = 0.0
        self._start_mono = 0.0
        self.model: str | None = None  # the served model name the requests ask for, once resolved
        self.agents = Agents(spec.agents) if spec.agents is not None else None

    # ---- time -----------------------------------------------------------------------------
    def sim_now(self) -> float:
        """Sim seconds since the run started."""
        if self._layer is not None:
            return float(self._layer.clock.now() - self._start_sim)
        return (time.monotonic() - self._start_mono) * self._speed

    async def _sleep_until(self, offset: float) -> None:
        delay = offset - self.sim_now()
        if delay > 0:
            await asyncio.sleep(delay / self._speed)

    # ---- running --------------------------------------------------------------------------
    def start(self) -> LoadRun:
        self._runner = asyncio.get_running_loop().create_task(self._run(), name=f"load-{self.id}")
        return self

    async def _run(self) -> None:
        # Open loop: never let the client's connection pool queue requests (that would be closed-loop).
        # aiohttp, not httpx: users' requests are much of a loaded simulator's CPU. py-spy on the 60 req/s
        # alert-storm recovery test: the load generator took 381 samples of 2134 with httpx, 56 of 1836
        # with aiohttp (the whole test: 14 % less CPU).
        self._http = aiohttp.ClientSession(
            base_url=self._gateway.url,
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=300.0),
            connector=aiohttp.TCPConnector(limit=2000, limit_per_host=0),
        )
        if self._layer is not None:
            self._speed = float(self._layer.clock.speed)
        elif self._gateway.speed is not None:
            self._speed = self._gateway.speed
        else:
            async with self._http.get("/sim/v1/clock") as reply:
                if reply.status != 200:
                    raise RuntimeError(
                        f"{self._gateway.url} is not a fleetmend simulator (GET /sim/v1/clock -> {reply.status})"
                    )
                self._speed = float((await reply.json())["speed"])
        model = self.model = self.spec.model or await self._default_model()
        self._start_mono = time.monotonic()
        if self._layer is not None:
            self._start_sim = float(self._layer.clock.now())
        for arrival in arrivals(self.spec):
            await self._sleep_until(arrival.offset_s)
            self.sent += 1
            task = asyncio.get_running_loop().create_task(self._one(arrival, model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _default_model(self, wait_s: float = 900.0) -> str:
        """The first model the gateway serves, waiting (sim seconds) for a pool to come up."""
        waited = 0.0
        while True:
            if self._layer is not None:
                served = self._layer.served_models()
            else:
                assert self._http is not None
                async with self._http.get("/v1/models") as reply:
                    served = {m["id"]: m["owned_by"] for m in (await reply.json())["data"]}
            if served:
                return sorted(served)[0]
            if waited >= wait_s:
                raise RuntimeError("the gateway serves no model; wait until a pool has pods, or pass model=")
            await asyncio.sleep(1.0 / self._speed)
            waited += 1.0

    async def _one(self, arrival: Arrival, model: str) -> None:
        result = RequestResult(
            arrival.request_id,
            arrival.tier,
            arrival.offset_s,
            "terminal_error",
            expected_tokens=arrival.output_tokens,
        )
        deadline = self.spec.deadlines_s.get(arrival.tier, DEFAULT_DEADLINES[arrival.tier])
        tools = self.agents.tool_positions(arrival.request_id, arrival.output_tokens) if self.agents else []
        # An agent's client retries a stream that died, with the same idempotency key (x-request-id).
        retries = self.agents.spec.client_retries if self.agents and tools else 0
        # A client that gives up at the deadline (its timeout) closes the connection, which aborts the
        # request in the engine; the arrival was due at its offset, so the time left is counted from it.
        left_s = arrival.offset_s + deadline - self.sim_now() if self.spec.give_up_at_deadline else math.inf
        try:
            async with asyncio.timeout(None if math.isinf(left_s) else max(0.0, left_s) / self._speed):
                for attempt in range(1, retries + 2):
                    try:
                        await self._client_call(arrival, model, result, tools=tools, client_attempt=attempt)
                    except Exception as exc:  # a client-side failure is a failed request, not a crashed run
                        result.outcome = "terminal_error"
                        result.status = result.status or 0
                        del exc
                    if result.outcome != "terminal_error" or attempt > retries:
                        break
                    if self.agents is not None:
                        self.agents.note_retry(arrival.request_id, result.tokens, tools)
                    result.attempts += 1
                    result.tokens, result.ttft_s, result.truncated = 0, None, False
        except TimeoutError:
            result.outcome, result.e2e_s = "late", deadline  # given up: the stream was not finished in time
        if result.outcome == "goodput" and result.e2e_s is not None and result.e2e_s > deadline:
            result.outcome = "late"
        self.results.append(result)

    async def _client_call(
        self, arrival: Arrival, model: str, result: RequestResult, *, tools: list[int], client_attempt: int
    ) -> None:
        """One call as an OpenAI SDK client makes it: an answer refused before the stream is retried
        ``client_retries`` times (``LoadSpec.client_retries``); a stream that began is never retried here."""
        jitter = random.Random(f"{arrival.request_id}/{client_attempt}")
        for retry in range(self.spec.client_retries + 1):
            await self._over_http(arrival, model, result, tools=tools, client_attempt=client_attempt)
            status = result.status or 0
            if retry == self.spec.client_retries or not (status in (408, 409, 429) or status >= 500):
                return
            told = result.retry_after_s
            wait = (
                told
                if told is not None and 0 < told <= 60
                else min(0.5 * 2**retry, 8.0) * (1 - 0.25 * jitter.random())
            )
            await asyncio.sleep(wait / self._speed)
            result.client_calls += 1

    def _http_request(self, arrival: Arrival, model: str) -> tuple[dict[str, str], dict[str, Any]]:
        """Headers and body of one request over HTTP: tier and id in headers, the model in the body.

        ``prompt_tokens`` / ``output_tokens`` / ``deadline_s`` are the simulator's body extensions
        (simulated lengths, the first-token deadline); a real vLLM ignores them, and
        ``max_tokens`` + ``ignore_eos`` ask it for the same output length."""
        headers = {TIER_HEADER: arrival.tier.value, "x-request-id": arrival.request_id}
        host = self._gateway.host_for(model) if self._gateway.host_for else None
        if host:
            headers["host"] = host
        body: dict[str, Any] = {
            "model": model,
            "prompt": "",
            "max_tokens": arrival.output_tokens,
            "ignore_eos": True,
            "stream": self.spec.stream,
            "prompt_tokens": arrival.prompt_tokens,
            "output_tokens": arrival.output_tokens,
            "deadline_s": self.spec.deadlines_s.get(arrival.tier, DEFAULT_DEADLINES[arrival.tier]),
        }
        if self.spec.pool:
            body["pool"] = self.spec.pool
        if self.spec.tier_priority is not None:
            body["priority"] = self.spec.tier_priority.get(arrival.tier, 0)
        if self.spec.deadline_priority:
            body["priority"] = round((arrival.offset_s + body["deadline_s"]) * 1000)
        return headers, body

    async def _over_http(
        self,
        arrival: Arrival,
        model: str,
        result: RequestResult,
        *,
        tools: list[int],
        client_attempt: int = 1,
    ) -> None:
        """One attempt; ``tools``: token counts at which an agent's tool calls are emitted and executed."""
        assert self._http is not None
        gateway = self._gateway
        sent_at = self.sim_now()
        headers, body = self._http_request(arrival, model)
        async with self._http.post("/v1/completions", json=body, headers=headers) as response:
            result.status = response.status
            # The replica that answered, refusals too (a gateway's own answer names none).
            upstream = response.headers.get(gateway.upstream_header) if gateway.upstream_header else None
            if upstream and gateway.replica_of is not None:
                upstream = gateway.replica_of(upstream) or upstream
            result.replica = upstream or (None if gateway.upstream_header else gateway.authority)
            if response.status != 200:
                await response.read()
                result.outcome = _refusal_outcome(response.status)
                result.retry_after_s = _retry_after(response.headers.get("retry-after"))
                return
            if gateway.attempt_header and response.headers.get(gateway.attempt_header, "").isdigit():
                result.attempts = int(response.headers[gateway.attempt_header])
            if not self.spec.stream:
                answer = json.loads(await response.read())
                if "error" in answer:
                    return  # terminal_error
                result.tokens = answer.get("usage", {}).get("completion_tokens", 0)
                result.ttft_s = self.sim_now() - sent_at
                result.outcome = "goodput"
                result.e2e_s = self.sim_now() - arrival.offset_s
                return
            done = errored = False
            calls: list[asyncio.Task[None]] = []
            try:
                async for raw in response.content:
                    line = raw.decode().rstrip("\r\n")
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        errored = True  # vLLM ends a failed stream with an error chunk, then [DONE]
                        continue
                    text = event["choices"][0]["text"]
                    if text and result.ttft_s is None:
                        result.ttft_s = self.sim_now() - sent_at
                    result.tokens += text.count(TOKEN_TEXT)
                    while self.agents and len(calls) < len(tools) and result.tokens >= tools[len(calls)]:
                        # The model emitted a tool call: the caller executes it now, mid-stream.
                        call = self.agents.call(self._http, arrival.request_id, len(calls), client_attempt)
                        calls.append(asyncio.get_running_loop().create_task(call))
            except aiohttp.ClientError:
                done = False  # the connection was cut mid-stream (upstream died, reset)
            # The inference ends with its stream: the deadline is the completion's. The agent's tool
            # calls it started run on, and the request is recorded once they have answered.
            # From the user's arrival, not this attempt's send: a client's retry does not restart the
            # deadline's clock (the world's grade counts deadlines from the arrival too).
            result.e2e_s = self.sim_now() - arrival.offset_s
            if calls:
                await asyncio.gather(*calls)
            result.truncated = not done
            result.outcome = "goodput" if done and not errored else "terminal_error"

    async def wait(self) -> LoadReport:
        if self._runner is not None:
            await self._runner
        if self._http is not None:
            await self._http.close()
            self._http = None
        return self.report()

    async def stop(self) -> LoadReport:
        for task in [self._runner, *self._tasks]:
            if task is not None:
                task.cancel()
        for task in [self._runner, *self._tasks]:
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._http is not None:
            await self._http.close()
            self._http = None
        return self.report()

    def report(self, since_s: float = 0.0, until_s: float = math.inf) -> LoadReport:
        """Outcomes of requests that arrived in [since_s, until_s) (sim seconds since the start); an
        agentic run adds its tool calls over the whole run (``inference_effects``)."""
        report = summarize(self.results, self.sent, (since_s, until_s))
        if self.agents is not None:
            report.inference_effects = self.agents.report()
        return report

    @property
    def done(self) -> bool:
        return self._runner is not None and self._runner.done()

    def grade(
        self,
        capacity: CapacityRecord,
        engine: EngineSpec,
        until_s: float | None = None,
        results: list[RequestResult] | None = None,
    ) -> LoadGrade:
        """This run graded by the world (``sim.serving.grade``): its arrivals replayed against the
        capacity the world recorded for its model from the run's start. A request's work is its output
        plus the prefill of the part of its prompt a warm prefix cache misses (``engine``'s figures).

        ``until_s``: grade only the arrivals before it (sim seconds since the start), for a run still
        going; every one of their deadlines must have passed, so each outcome is settled (a request
        still streaming past its deadline is not goodput). Replaying fewer arrivals can only raise the
        optimum of those it keeps, so it stays a bound."""
        if self.model is None or self._layer is None:
            raise LookupError("the run has not started inside the simulator; there is nothing to grade yet")
        deadline_of = {t: self.spec.deadlines_s.get(t, DEFAULT_DEADLINES[t]) for t in Tier}
        chosen = [a for a in arrivals(self.spec) if until_s is None or a.offset_s < until_s]
        if until_s is not None:
            settled = until_s + self.spec.longest_deadline_s
            if settled > self.sim_now():
                raise LookupError(
                    f"arrivals until {until_s:g} s are not all past their deadlines until {settled:g} s "
                    f"of the run (now {self.sim_now():.1f} s); ask later or for an earlier until_s"
                )
        elif not self.done:
            raise LookupError(
                f"the run is still going ({self.sent - len(self.results)} request(s) in flight); grade it "
                "once GET /sim/v1/load/{id} shows every arrival sent and in_flight 0, or pass until_s"
            )
        jobs = [
            Job(
                arrival=a.offset_s,
                deadline=a.offset_s + deadline_of[a.tier],
                work=engine.request_work(a.output_tokens, a.prompt_tokens),
                key=a.request_id,
            )
            for a in chosen
        ]
        keys = {j.key for j in jobs}
        results = [r for r in (self.results if results is None else results) if r.request_id in keys]
        refused = {r.request_id for r in results if r.outcome == "shed"}
        goodput = sum(1 for r in results if r.outcome == "goodput")
        return grade(jobs, refused, goodput, capacity.trace(self.model, self._start_sim))


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (the delay form; an HTTP date is not used by gateways here)."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def _refusal_outcome(status: int) -> str:
    return {429: "shed", 503: "rejected", 504: "late", 404: "not_found"}.get(status, "terminal_error")


def start_load(
    target: Any, rate: float | LoadSpec, duration_s: float = 60.0, seed: int = 0, **options: Any
) -> LoadRun:
    """Start open-loop load on the running event loop; ``await run.wait()`` for the report.

    ``target``: a ``GatewayTarget`` (any OpenAI-compatible URL: a gateway, one engine's pod IP),
    or a ``ServingLayer`` / ``SimWorld`` with the serving layer attached whose gateway is set
    (``use_gateway``): the load goes through that gateway, on the world's clock.
    """
    spec = (
        rate
        if isinstance(rate, LoadSpec)
        else LoadSpec(rate=rate, duration_s=duration_s, seed=seed, **options)
    )
    if isinstance(target, GatewayTarget):
        return LoadRun(target, spec).start()
    layer = getattr(target, "serving", target)  # a SimWorld the serving layer is attached to
    if not hasattr(layer, "load_target"):
        raise TypeError(
            "start_load needs a GatewayTarget, a ServingLayer or a SimWorld with the serving layer attached"
        )
    return LoadRun(layer.load_target(), spec, world=layer).start()


class GatewaySetting(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(
        description="the gateway users send to (http://host:port), or null for none (load is refused)"
    )
    upstream_header: str | None = Field(
        default=None, description="response header naming the engine that served a request (ip:port)"
    )


def install_load_routes(api: APIRouter, layer: Any) -> None:
    runs: dict[str, LoadRun] = {}

    @api.post("/sim/v1/load", status_code=202, tags=["sim"])
    async def post_load(spec: LoadSpec) -> dict[str, Any]:
        try:
            target = layer.load_target()
        except LookupError as err:
            raise HTTPException(409, str(err)) from None
        run = LoadRun(target, spec, world=layer).start()
        runs[run.id] = run
        return {"id": run.id, "arrivals": len(arrivals(spec))}

    @api.put("/sim/v1/gateway", tags=["sim"])
    async def put_gateway(body: GatewaySetting) -> GatewaySetting:
        """Where users' requests go: a gateway URL (e.g. Envoy), or null for none."""
        try:
            layer.use_gateway(body.url, body.upstream_header)
        except ValueError as err:
            raise HTTPException(422, f"{err}: give the gateway's http(s)://host:port, or null") from None
        return body

    @api.get("/sim/v1/load/{run_id}", response_model=LoadReport, tags=["sim"])
    async def get_load(run_id: str, since_s: float = 0.0, until_s: float | None = None) -> LoadReport:
        run = runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"no load run {run_id!r}; known: {sorted(runs)}")
        return run.report(since_s, until_s if until_s is not None else math.inf)

    @api.get("/sim/v1/load/{run_id}/grade", response_model=LoadGrade, tags=["sim"])
    async def get_grade(run_id: str, until_s: float | None = None, settled: bool = False) -> LoadGrade:
        """The run graded by the world's own record (``sim.serving.grade``): once it is done, or its
        arrivals before ``until_s`` once all their deadlines have passed; ``settled=true``: every
        arrival whose deadline has passed (a run still going)."""
        run = runs.get(run_id)
        if run is None:
            raise HTTPException(404, f"no load run {run_id!r}; known: {sorted(runs)}")
        if settled and until_s is None and not run.done:
            until_s = run.sim_now() - run.spec.longest_deadline_s  # < 0: none settled yet
        try:
            # Two replays of every arrival: off the event loop that serves the world (and its users).
            return await asyncio.to_thread(
                run.grade,
                layer.capacity.copy(),
                layer.engine_spec_for_model(run.model),
                until_s,
                list(run.results),
            )
        except LookupError as err:
            raise HTTPException(409, str(err)) from None

    @api.delete("/sim/v1/load/{run_id}", response_model=LoadReport, tags=["sim"])
    async def delete_load(run_id: str) -> LoadReport:
        run = runs.pop(run_id, None)
        if run is None:
            raise HTTPException(404, f"no load run {run_id!r}")
        return await run.stop()
