"""The world's own grade of a load run: its true serving capacity over time, and what the best
possible router and shedder could have done with it.

Every figure that grades fleetmend's shedding comes from here, never from fleetmend's estimate of the
capacity gap (``fleet.shedding``):

* ``CapacityRecord`` is the world's ground truth: per model, the decode budget (tokens/s) its live
  engines could deliver, sampled by the serving tick from the engines themselves (warm-up, slow
  factor and thermal throttling included; a dead or wedged engine, or one on a lost node, gives 0).
  Every live engine counts, routed or not: a warm spare no one promotes is capacity the world had.
* ``optimum`` replays the run's arrivals against that record: one pooled server whose rate is the
  world's capacity at each instant, serving earliest deadline first, that admits an arrival when
  everything it holds can still finish within its deadline and otherwise drops the request with the
  most work left (Moore-Hodgson's rule). It is a relaxation of the world: no routing, no per-sequence
  decode cap, no KV-cache limit, the warm prefix-cache hit rate for every prompt, perfect knowledge
  of the capacity to come. So no mode serving the real world should complete more requests within
  their deadlines; a run that does (``bound_beaten``) is a bug in this bound or in the world, and the
  benchmarks stop on it.
* Over-shed = the optimum over all arrivals minus the optimum over the arrivals the gateway did not
  refuse: the requests the world could have served that were refused. Refusals that only took away
  what the capacity could not carry cost the optimum nothing and count 0.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

# A sample is kept when the capacity moved by more than this share of the last one kept: a steady
# fleet adds nothing, a warming engine a sample per half-percent step of its climb.
SAMPLE_CHANGE = 0.005
# World seconds of record kept: a load run longer than this is graded on the last RETAIN_S of it
# (the simulator runs for days under ``fleetmend dev``; the record must not grow with them).
RETAIN_S = 3 * 3600.0


@dataclass
class CapacityRecord:
    """Per model: (world time, tokens/s its live engines could deliver), in time order: the changes,
    over the last ``RETAIN_S`` and the value in force before them."""

    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def sample(self, now: float, capacity: dict[str, float]) -> None:
        for model in set(self.samples) | set(capacity):
            value = capacity.get(model, 0.0)
            series = self.samples.setdefault(model, [])
            if series and abs(value - series[-1][1]) <= SAMPLE_CHANGE * max(series[-1][1], 1e-9):
                continue
            series.append((now, value))
            if series[0][0] < now - 2 * RETAIN_S:  # prune in batches: amortised, never per sample
                keep = bisect.bisect_right([t for t, _ in series], now - RETAIN_S) - 1
                del series[: max(0, keep)]

    def copy(self) -> CapacityRecord:
        """A snapshot to grade from off the world's event loop."""
        return CapacityRecord({model: list(series) for model, series in self.samples.items()})

    def trace(self, model: str, since: float) -> list[tuple[float, float]]:
        """The model's capacity from world time ``since`` on, as (seconds since ``since``, tokens/s);
        the value in force at ``since`` opens it."""
        series = self.samples.get(model, [])
        times = [t for t, _ in series]
        first = bisect.bisect_right(times, since) - 1
        out = [(0.0, series[first][1])] if first >= 0 else [(0.0, 0.0)]
        out.extend((t - since, v) for t, v in series[first + 1 :])
        return out


class Capacity:
    """Cumulative work a piecewise-constant capacity trace delivers: ``work(a, b)``, and its inverse."""

    def __init__(self, trace: Sequence[tuple[float, float]]) -> None:
        if not trace:
            trace = [(0.0, 0.0)]
        self.times = [t for t, _ in trace]
        self.rates = [max(0.0, r) for _, r in trace]
        self.cumulative = [0.0]
        for i in range(1, len(self.times)):
            self.cumulative.append(
                self.cumulative[-1] + self.rates[i - 1] * (self.times[i] - self.times[i - 1])
            )

    def total(self, t: float) -> float:
        """Work delivered from the trace's start to ``t`` (the last rate holds for ever)."""
        if t <= self.times[0]:
            return 0.0
        i = bisect.bisect_right(self.times, t) - 1
        return self.cumulative[i] + self.rates[i] * (t - self.times[i])

    def work(self, a: float, b: float) -> float:
        return max(0.0, self.total(b) - self.total(a))


@dataclass(frozen=True)
class Job:
    arrival: float
    deadline: float
    work: float  # decode-token equivalents
    key: str


def optimum(jobs: Iterable[Job], capacity: Capacity) -> int:
    """Requests the pooled earliest-deadline-first server completes within their deadlines (see the
    module docstring)."""
    order = sorted(jobs, key=lambda j: (j.arrival, j.key))
    held: dict[str, list[float]] = {}  # key -> [deadline, remaining work]
    done = 0
    now = order[0].arrival if order else 0.0
    for job in order:
        done += _serve(held, capacity, now, job.arrival)
        now = job.arrival
        held[job.key] = [job.deadline, job.work]
        _keep_feasible(held, capacity, now)
    return done + _serve(held, capacity, now, math.inf)


def _serve(held: dict[str, list[float]], capacity: Capacity, start: float, end: float) -> int:
    """Advance the server from ``start`` to ``end``, earliest deadline first; the requests it finished
    (all within their deadlines: what it holds is always feasible). ``end`` infinite: it finishes all."""
    if math.isinf(end):
        finished = len(held)
        held.clear()
        return finished
    finished = 0
    now = start
    for key, (_, need) in sorted(held.items(), key=lambda kv: (kv[1][0], kv[0])):
        available = capacity.work(now, end)
        if available + 1e-9 < need:
            held[key][1] = need - available  # all of the interval went to the earliest deadlines
            break
        now = finish_time(capacity, now, need)  # finishes inside the interval; the next goes on from there
        del held[key]
        finished += 1
    return finished


def finish_time(capacity: Capacity, start: float, need: float) -> float:
    """The earliest time from ``start`` by which the trace has delivered ``need`` more work."""
    if need <= 0:
        return start
    target = capacity.total(start) + need
    j = bisect.bisect_left(capacity.cumulative, target)  # the first breakpoint that reaches it
    i = j - 1 if j < len(capacity.times) else len(capacity.times) - 1
    rate = capacity.rates[i]  # > 0 inside the trace: the work rose on this segment
    if rate <= 0:
        return math.inf  # past the last breakpoint at a rate of 0: never
    return max(start, capacity.times[i] + (target - capacity.cumulative[i]) / rate)


def _keep_feasible(held: dict[str, list[float]], capacity: Capacity, now: float) -> None:
    """Drop the request with the most work left among those up to the first deadline that cannot be
    met, until every held request can finish in time (Moore-Hodgson, from ``now``)."""
    while True:
        ordered = sorted(held.items(), key=lambda kv: (kv[1][0], kv[0]))
        load = 0.0
        prefix: list[tuple[float, str]] = []
        violated = False
        for key, (deadline, need) in ordered:
            load += need
            heapq.heappush(prefix, (-need, key))
            if load > capacity.work(now, deadline) + 1e-9:
                violated = True
                break
        if not violated:
            return
        _, biggest = heapq.heappop(prefix)
        del held[biggest]


class LoadGrade(BaseModel):
    """One load run graded by the world's capacity record (this module's docstring)."""

    arrivals: int
    goodput: int = Field(description="completed within deadline, the load generator's own record")
    refused: int = Field(description="answered 429 by the gateway (shed)")
    optimum: int = Field(description="the replay of every arrival against the world's capacity")
    optimum_without_refused: int = Field(description="the same replay without the refused arrivals")
    over_shed: int = Field(description="refused requests the world's capacity could have served")
    over_shed_share: float = Field(description="over_shed over arrivals")
    of_optimum: float = Field(description="goodput over the optimum")
    bound_beaten: bool = Field(description="goodput above the optimum: a bug in the bound or the world")
    capacity_samples: int
    min_capacity_tokens_s: float
    max_capacity_tokens_s: float


def grade(
    jobs: Sequence[Job], refused: set[str], goodput: int, trace: Sequence[tuple[float, float]]
) -> LoadGrade:
    capacity = Capacity(trace)
    best = optimum(jobs, capacity)
    kept = optimum([j for j in jobs if j.key not in refused], capacity)
    over = max(0, best - kept)
    rates = [r for _, r in trace] or [0.0]
    return LoadGrade(
        arrivals=len(jobs),
        goodput=goodput,
        refused=len(refused),
        optimum=best,
        optimum_without_refused=kept,
        over_shed=over,
        over_shed_share=over / len(jobs) if jobs else 0.0,
        of_optimum=goodput / best if best else 0.0,
        bound_beaten=goodput > best,
        capacity_samples=len(trace),
        min_capacity_tokens_s=min(rates),
        max_capacity_tokens_s=max(rates),
    )
