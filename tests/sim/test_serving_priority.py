"""vLLM's ``--scheduling-policy`` in the simulated engine: first come first served by default, and
``priority`` (a request's ``priority``, lower first, then arrival; a full batch's latest-priority request
preempted for an earlier one; vllm-project/vllm#5958)."""

from __future__ import annotations

from typing import Literal

from sim.serving.engine import Engine, EngineRequest, EngineSpec


class Sink:
    def __init__(self) -> None:
        self.tokens = 0
        self.finished_at: float | None = None

    def on_tokens(self, count: int, now: float) -> None:
        self.tokens += count

    def on_finished(self, reason: str, now: float) -> None:
        self.finished_at = now

    def on_aborted(self, reason: str, now: float) -> None:
        raise AssertionError(f"aborted: {reason}")


def engine(policy: Literal["fcfs", "priority"], max_num_seqs: int) -> Engine:
    spec = EngineSpec(scheduling_policy=policy, max_num_seqs=max_num_seqs, warmup_s=0.0, prefill_cost=0.0)
    return Engine("ns/pod", spec, "m", started_at=0.0)


def submit(e: Engine, name: str, priority: int, at: float, output_tokens: int = 40) -> EngineRequest:
    req = EngineRequest(name, 16, output_tokens, output_tokens, Sink(), priority=priority)
    e.submit(req, at)
    return req


def run(e: Engine, until: float, dt: float = 0.05) -> None:
    now = e._last
    while now < until - 1e-9:
        now = min(until, now + dt)
        e.advance(now)


def running(e: Engine) -> set[str]:
    return {r.request_id for r in e.running}


def finished_at(req: EngineRequest) -> float:
    assert isinstance(req.sink, Sink) and req.sink.finished_at is not None, req.request_id
    return req.sink.finished_at


def test_first_come_first_served_ignores_priority_order() -> None:
    e = engine("fcfs", max_num_seqs=1)
    submit(e, "first", 5, 0.0)
    submit(e, "late", 0, 0.01)
    run(e, 0.1)
    assert running(e) == {"first"} and [r.request_id for r in e.waiting] == ["late"]


def test_priority_admits_the_earliest_priority_then_the_earliest_arrival() -> None:
    e = engine("priority", max_num_seqs=1)
    submit(e, "busy", 0, 0.0, output_tokens=4)
    run(e, 0.01)
    submit(e, "sheddable", 2, 0.02)
    submit(e, "standard-a", 1, 0.03)
    submit(e, "standard-b", 1, 0.04)
    admitted: list[str] = []
    now = 0.05
    while e.running or e.waiting:
        run(e, now)
        admitted.extend(sorted(running(e) - set(admitted) - {"busy"}))
        now += 0.05
    assert admitted == ["standard-a", "standard-b", "sheddable"]


def test_priority_preempts_the_latest_priority_running_request_when_the_batch_is_full() -> None:
    e = engine("priority", max_num_seqs=2)
    low = submit(e, "sheddable", 2, 0.0)
    mid = submit(e, "standard", 1, 0.0)
    run(e, 0.2)
    assert running(e) == {"sheddable", "standard"}
    urgent = submit(e, "critical", 0, 0.2)
    run(e, 0.3)
    assert running(e) == {"standard", "critical"} and e.preemptions == 1
    assert [r.request_id for r in e.waiting] == ["sheddable"]
    run(e, 10.0)
    assert finished_at(urgent) < finished_at(low) and finished_at(mid) < finished_at(low)


def test_first_come_first_served_never_preempts_for_priority() -> None:
    e = engine("fcfs", max_num_seqs=1)
    submit(e, "first", 5, 0.0)
    run(e, 0.1)
    submit(e, "second", 0, 0.1)
    run(e, 0.2)
    assert running(e) == {"first"} and e.preemptions == 0
