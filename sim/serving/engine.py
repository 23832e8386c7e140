"""A simulated vLLM engine: one per serving replica (a pod, or a group's leader).

The engine is advanced by the serving tick loop on the sim clock (never a task
per token). It models what the recovery procedures read and suffer from:

* a decode budget per second (``warm_tokens_per_s``) shared by the running batch,
  each sequence capped at ``max_tokens_per_seq_s``; prefill costs a fraction of
  a decode token per uncached prompt token;
* a prefix cache that starts cold after every (re)start: the effective rate
  climbs linearly from ``cold_fraction`` to 1 over ``warmup_s``;
* a KV cache of ``kv_capacity_tokens``: admission needs room for the prompt, and
  when decode growth overflows it the youngest running request is preempted
  (back to the waiting queue, recomputed later), as vLLM V1 does;
* vLLM's ``--scheduling-policy``: first come first served (the default), or
  ``priority``: each request's ``priority`` (lower first, then arrival), a full
  batch's latest-priority request preempted for an earlier one;
* faults: ``slow`` (a rate factor), ``wedged`` (no progress at all while
  ``/health`` keeps answering 200), ``dead`` (``/health`` 503, streams aborted);
* SIGTERM with vLLM's ``--shutdown-timeout``: 0 aborts in-flight requests at once,
  N > 0 refuses new requests and lets in-flight ones finish for up to N seconds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sim.serving.vllm_metrics import MetricsEra, VllmMetrics, era_for_version


class EngineSpec(BaseModel):
    """Serving parameters of one model's replicas (what a scenario may set per model)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str | None = Field(
        default=None, description="vLLM --served-model-name (default: the model name)"
    )
    version: str = Field(default="0.12.0", description="Emulated vLLM release; picks the metric-name era")
    warm_tokens_per_s: float = Field(
        default=160.0, gt=0, description="Decode budget per second with a warm cache"
    )
    max_tokens_per_seq_s: float = Field(default=40.0, gt=0, description="Fastest a single sequence decodes")
    prefill_cost: float = Field(
        default=0.01, ge=0, description="Decode-token equivalents per uncached prompt token"
    )
    kv_capacity_tokens: int = Field(default=32768, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    cold_fraction: float = Field(
        default=0.35, gt=0, le=1, description="Rate fraction right after a (re)start"
    )
    warmup_s: float = Field(default=120.0, ge=0, description="Time for the prefix cache to warm")
    warm_prefix_hit_rate: float = Field(default=0.6, ge=0, le=1)
    shutdown_timeout_s: float = Field(
        default=0.0, ge=0, description="vLLM --shutdown-timeout (0 = abort at once)"
    )
    watchdog_s: float = Field(
        default=5.0, ge=0, description="Dead engine: seconds until the API server exits"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="vLLM --scheduling-policy: fcfs (the default) or priority (a request's `priority`, "
        "lower first, then arrival; a waiting request preempts a running one of a later priority when "
        "the batch is full; vllm-project/vllm#5958)",
    )

    @field_validator("version")
    @classmethod
    def _known_version_shape(cls, value: str) -> str:
        era_for_version(value)  # raises a clear error for e.g. "latest"
        return value

    def era(self) -> MetricsEra:
        return era_for_version(self.version)

    def request_work(self, output_tokens: float, prompt_tokens: float) -> float:
        """Decode-token equivalents one request costs a warm engine: its output after the first token
        (the prefill step samples that one, ``Engine._prefill``) plus the prefill of the prompt share a
        warm prefix cache misses. The world's grade (``LoadRun.grade``) and the benches' calibration of
        the world's capacity both count work this way."""
        miss = 1.0 - self.warm_prefix_hit_rate
        return output_tokens - 1 + self.prefill_cost * prompt_tokens * miss


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())


class EngineState(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


class EngineRefused(Exception):
    """The replica did not accept the request (nothing was sent to the caller)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class TokenSink(Protocol):
    """Where an engine delivers one request's progress (the pod server's stream)."""

    def on_tokens(self, count: int, now: float) -> None: ...
    def on_finished(self, reason: str, now: float) -> None: ...
    def on_aborted(self, reason: str, now: float) -> None: ...


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    sink: TokenSink
    arrived_at: float = 0.0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float = 0.0
    prefill_left: float = 0.0
    progress: float = 0.0
    emitted: int = 0
    done: bool = False
    priority: int = 0  # vLLM's per-request priority (lower first); only under scheduling_policy priority

    @property
    def kv_tokens(self) -> float:
        return self.prompt_tokens + self.progress


@dataclass(eq=False)
class Engine:
    """One replica's engine process. ``replica`` is ``namespace/pod``."""

    replica: str
    spec: EngineSpec
    model_name: str
    started_at: float
    node: str | None = None
    state: EngineState = EngineState.SERVING
    slow_factor: float = 1.0
    wedged: bool = False
    died_at: float | None = None
    death_reason: str = ""
    drain_deadline: float | None = None
    waiting: list[EngineRequest] = field(default_factory=list)
    running: list[EngineRequest] = field(default_factory=list)
    generated_total: int = 0
    preemptions: int = 0
    metrics: VllmMetrics = field(init=False)
    _last: float = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = VllmMetrics(self.metrics_model_name, self.spec.era())
        self._last = self.started_at

    # ---- what callers observe -------------------------------------------------
    def warmth(self, now: float) -> float:
        """Fraction of the warm rate this engine delivers now (cold prefix cache after a start)."""
        if self.spec.warmup_s <= 0:
            return 1.0
        climb = min(1.0, max(0.0, (now - self.started_at) / self.spec.warmup_s))
        return self.spec.cold_fraction + (1.0 - self.spec.cold_fraction) * climb

    def rate(self, now: float) -> float:
        """Decode budget (tokens/s) the engine can deliver now."""
        return self.spec.warm_tokens_per_s * self.warmth(now) * self.slow_factor

    @property
    def metrics_model_name(self) -> str:
        """The ``model_name`` label and the name clients ask for (vLLM's served model name)."""
        return self.spec.served_model_name or self.model_name

    @property
    def alive(self) -> bool:
        return self.state is not EngineState.DEAD

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        used = sum(r.kv_tokens for r in self.running)
        return min(1.0, used / self.spec.kv_capacity_tokens)

    def health_status(self) -> int:
        """What ``GET /health`` answers: 200 unless the engine is dead (a wedged one says 200).

        A dead engine answers 503 from v0.11 on (vLLM PR #24897); older releases let the
        EngineDeadError reach the generic handler, which answered 500.
        """
        if self.state is not EngineState.DEAD:
            return 200
        return 503 if version_tuple(self.spec.version) >= (0, 11) else 500

    def render_metrics(self) -> bytes:
        return self.metrics.render(self.num_running, self.num_waiting, self.kv_usage())

    # ---- requests ---------------------------------------------------------------
    def submit(self, req: EngineRequest, now: float) -> None:
        if self.state is EngineState.DEAD:
            raise EngineRefused(
                502, f"replica {self.replica} is not answering (engine dead: {self.death_reason})"
            )
        if self.state is EngineState.DRAINING:
            raise EngineRefused(503, f"replica {self.replica} is shutting down and refuses new requests")
        req.arrived_at = now
        req.last_token_at = now
        self.waiting.append(req)

    def cancel(self, req: EngineRequest, now: float) -> None:
        """The caller went away: drop the request (vLLM counts it as an abort)."""
        if req.done:
            return
        req.done = True
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.metrics.request_finished("abort", now - req.arrived_at)

    # ---- lifecycle and faults ---------------------------------------------------
    def kill(self, reason: str, now: float) -> None:
        """The engine dies: every in-flight request is aborted at once."""
        if self.state is EngineState.DEAD:
            return
        self.state = EngineState.DEAD
        self.died_at = now
        self.death_reason = reason
        inflight = self.running + self.waiting
        self.running, self.waiting = [], []
        for req in inflight:
            if not req.done:
                req.done = True
                req.sink.on_aborted(reason, now)

    def sigterm(self, now: float, grace_s: float | None = None) -> None:
        """Pod deletion reached the process. Honour ``--shutdown-timeout`` within the grace period."""
        if self.state is not EngineState.SERVING:
            return
        timeout = self.spec.shutdown_timeout_s
        if grace_s is not None:
            timeout = min(timeout, grace_s)
        if timeout <= 0 or not (self.running or self.waiting):
            self.kill("shutdown (SIGTERM, shutdown timeout 0: in-flight requests aborted)", now)
            return
        self.state = EngineState.DRAINING
        self.drain_deadline = now + timeout

    # ---- the tick -----------------------------------------------------------------
    def advance(self, now: float) -> None:
        dt = now - self._last
        if dt <= 0:
            return
        self._last = now
        if self.state is EngineState.DEAD:
            return
        if self.state is EngineState.SERVING and not (self.running or self.waiting):
            return  # idle: nothing to admit, prefill or decode
        if self.state is EngineState.DRAINING:
            if not (self.running or self.waiting):
                self.kill("shutdown complete (drained)", now)
                return
            if self.drain_deadline is not None and now >= self.drain_deadline:
                self.kill("shutdown timeout expired with requests still in flight", now)
                return
        if self.wedged:
            return
        budget = self.rate(now) * dt
        self._admit(now)
        budget = self._prefill(budget, now)
        self._decode(budget, dt, now)
        self._enforce_kv(now)

    def _admit(self, now: float) -> None:
        used = sum(r.kv_tokens for r in self.running)
        hit_rate = (
            self.spec.warm_prefix_hit_rate
            * (self.warmth(now) - self.spec.cold_fraction)
            / max(1e-9, 1.0 - self.spec.cold_fraction)
        )
        if self.spec.scheduling_policy == "priority" and self.waiting:
            self._preempt_for_priority()
        while self.waiting and len(self.running) < self.spec.max_num_seqs:
            req = self.waiting[0]
            need = req.kv_tokens + 1
            if used + need > self.spec.kv_capacity_tokens and self.running:
                break
            self.waiting.pop(0)
            used += need
            recompute = req.prompt_tokens + int(req.progress)
            cached = int(req.prompt_tokens * hit_rate) if req.admitted_at is None else 0
            req.prefill_left = (recompute - cached) * self.spec.prefill_cost
            if req.admitted_at is None:
                req.admitted_at = now
                self.metrics.prompt_processed(req.prompt_tokens, cached)
            self.running.append(req)

    def _preempt_for_priority(self) -> None:
        """vLLM's priority policy: the waiting queue in (priority, arrival) order, and while the batch is
        full, a waiting request of an earlier priority than the latest running one preempts it (back to
        the waiting queue, recomputed when it is admitted again, as a KV preemption is)."""
        self.waiting.sort(key=_priority_order)
        while self.waiting and len(self.running) >= self.spec.max_num_seqs:
            victim = max(self.running, key=_priority_order)
            if self.waiting[0].priority >= victim.priority:
                return
            self.running.remove(victim)
            victim.prefill_left = 0.0
            bisect.insort(self.waiting, victim, key=_priority_order)
            self.preemptions += 1
            self.metrics.preempted()

    def _prefill(self, budget: float, now: float) -> float:
        for req in self.running:
            if req.prefill_left > 0:
                if budget <= 0:
                    continue
                spend = min(budget, req.prefill_left)
                req.prefill_left -= spend
                budget -= spend
                if req.prefill_left > 1e-9:
                    continue
                req.prefill_left = 0.0
            if req.emitted == 0:
                # The prefill step samples the first token.
                req.progress = 1.0
                self._emit(req, 1, now)
        return budget

    def _decode(self, budget: float, dt: float, now: float) -> None:
        decoding = [r for r in self.running if r.prefill_left <= 0 and r.emitted > 0 and not r.done]
        if decoding and budget > 0:
            per_seq = min(self.spec.max_tokens_per_seq_s * dt, budget / len(decoding))
            for req in decoding:
                req.progress = min(float(req.output_tokens), req.progress + per_seq)
                new = int(req.progress + 1e-9) - req.emitted
                if new > 0:
                    self._emit(req, new, now)
        finished = [r for r in self.running if r.emitted >= r.output_tokens]
        for req in finished:
            self.running.remove(req)
            req.done = True
            reason = "length" if req.output_tokens >= req.max_tokens else "stop"
            self.metrics.request_finished(reason, now - req.arrived_at)
            req.sink.on_finished(reason, now)

    def _emit(self, req: EngineRequest, count: int, now: float) -> None:
        if req.first_token_at is None:
            req.first_token_at = now
            queue_s = (req.admitted_at or now) - req.arrived_at
            self.metrics.first_token(now - req.arrived_at, queue_s)
            self.metrics.tokens_generated(count, None)
        else:
            self.metrics.tokens_generated(count, (now - req.last_token_at) / count)
        req.last_token_at = now
        req.emitted += count
        self.generated_total += count
        req.sink.on_tokens(count, now)

    def _enforce_kv(self, now: float) -> None:
        used = sum(r.kv_tokens for r in self.running)
        while used > self.spec.kv_capacity_tokens and len(self.running) > 1:
            victim = self.running.pop()  # youngest first, as vLLM's scheduler does
            used -= victim.kv_tokens
            victim.prefill_left = 0.0
            self.waiting.insert(0, victim)
            self.preemptions += 1
            self.metrics.preempted()


def _priority_order(req: EngineRequest) -> tuple[int, float]:
    return req.priority, req.arrived_at
