"""A read-only look whose retry budget runs out on a slow world is read again with backoff for
``RetryBudget.read_patience_s``; only a read failing that long asks an operator, and one the world
refuses outright asks at once. Real Temporal (time-skipping), fake activities under the real names."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.act import EffectReport, NotifyRequest
from fleet.incident import PoolRef
from fleet.recovery import OperatorAction, Phase, ProcedureStatus, RetryBudget
from tests.slow_read_workflow import SLOW_LIST, SlowRead, SlowReadInput

# Attempts are many and quick; the budget runs out on time (10 s), as a saturated API server makes it.
BUDGET = RetryBudget(attempts=50, budget_s=10, initial_interval_s=1, max_interval_s=2, read_patience_s=120)


class _World:
    """Answers the list after ``slow_calls`` failed calls (503, as an overloaded API server does)."""

    def __init__(self, slow_calls: int, error: ApplicationError | None = None) -> None:
        self.slow_calls = slow_calls
        self.calls = 0
        self.error = error or ApplicationError(
            "apiserver: 503 Service Unavailable (the server is overloaded)"
        )
        self.notes: list[str] = []

    @activity.defn(name=SLOW_LIST)
    async def slow_list(self, pool: PoolRef) -> list[str]:
        self.calls += 1
        if self.calls <= self.slow_calls:
            raise self.error
        return ["pod-a", "pod-b"]

    @activity.defn(name="notify")
    async def notify(self, req: NotifyRequest) -> EffectReport:
        self.notes.append(req.text)
        return EffectReport(op_id=req.step, kind="notify", target=req.topic, state="applied")


@asynccontextmanager
async def _running(
    env: WorkflowEnvironment, world: _World, budget: RetryBudget = BUDGET
) -> AsyncIterator[WorkflowHandle[SlowRead, ProcedureStatus]]:
    queue = f"slow-read-{uuid.uuid4().hex[:8]}"
    pool = PoolRef(namespace="inference", service=f"llama-{uuid.uuid4().hex[:6]}")
    async with Worker(
        env.client, task_queue=queue, workflows=[SlowRead], activities=[world.slow_list, world.notify]
    ):
        yield await env.client.start_workflow(
            SlowRead.run,
            SlowReadInput(pool=pool, budget=budget),
            id=f"slow-read-{pool.service}",
            task_queue=queue,
        )


async def _noted(world: _World, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not world.notes:
        assert time.monotonic() < deadline, "the operator was never told in the incident channel"
        await asyncio.sleep(0.05)


async def _awaiting(
    handle: WorkflowHandle[SlowRead, ProcedureStatus], timeout_s: float = 60
) -> ProcedureStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await handle.query(SlowRead.status)
        if status.phase is Phase.AWAITING_OPERATOR:
            return status
        assert time.monotonic() < deadline and status.phase is not Phase.DONE, status.decisions
        await asyncio.sleep(0.1)


async def test_a_read_slow_for_longer_than_its_budget_is_read_again_and_the_step_goes_on(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    world = _World(slow_calls=14)  # more than one budget's worth (10 s of 1-2 s backoffs)
    async with _running(time_skipping_env, world) as handle:
        status = await handle.result()
    text_ = "\n".join(d.summary for d in status.decisions)
    assert status.phase is Phase.DONE and "listed 2 pod(s)" in text_, text_
    assert "list the pool's pods: could not read (retry budget spent (time)" in text_, text_
    assert "reading again with backoff for up to 120 s before asking an operator" in text_, text_
    assert all(p.name is not Phase.AWAITING_OPERATOR for p in status.phases) and world.notes == [], text_


async def test_a_read_that_never_answers_asks_an_operator_after_the_patience_and_retry_reads_again(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    world = _World(slow_calls=10**6)
    async with _running(
        time_skipping_env, world, BUDGET.model_copy(update={"read_patience_s": 30})
    ) as handle:
        asking = await _awaiting(handle)
        refusal = asking.refusal
        assert refusal is not None and refusal.what == "list the pool's pods" and not refusal.can_skip
        assert "503 Service Unavailable" in refusal.error and "(failing for " in refusal.error, refusal
        failing_s = float(refusal.error.rsplit("(failing for ", 1)[1].split(" s)")[0])
        assert failing_s >= 30 - BUDGET.budget_s, refusal.error  # it waited out its patience first
        await _noted(world)  # the incident channel hears of it just after the phase is entered
        assert len(world.notes) == 1 and "list the pool's pods failed" in world.notes[0], world.notes
        world.slow_calls = 0
        await handle.execute_update(
            SlowRead.retry, OperatorAction(operator="bob", reason="API server scaled up")
        )
        status = await handle.result()
    assert status.phase is Phase.DONE, status.decisions


async def test_a_read_the_world_refuses_asks_at_once(time_skipping_env: WorkflowEnvironment) -> None:
    refused = ApplicationError("pods is forbidden: User cannot list resource pods (403)", non_retryable=True)
    world = _World(slow_calls=10**6, error=refused)
    async with _running(time_skipping_env, world) as handle:
        asking = await _awaiting(handle)
        assert asking.refusal is not None and "forbidden" in asking.refusal.error, asking.refusal
        assert "failing for" not in asking.refusal.error and world.calls == 1, asking.refusal
        await handle.execute_update(SlowRead.abort, OperatorAction(operator="bob", reason="RBAC to fix"))
        assert (await handle.result()).phase is Phase.ABORTED
