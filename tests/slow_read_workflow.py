"""A procedure whose one step is a read-only look, to show how ``Procedure`` outwaits a slow world."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from pydantic import BaseModel
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.incident import PoolRef
    from fleet.recovery import Phase, ProcedureStatus, RetryBudget
    from workflows.procedure import Aborted, Procedure

# The fake list the tests serve under this name (tests/test_slow_reads.py).
SLOW_LIST = "slow_list"


class SlowReadInput(BaseModel):
    pool: PoolRef
    budget: RetryBudget


@workflow.defn(name="FoundationSlowRead")
class SlowRead(Procedure):
    @workflow.init
    def __init__(self, inp: SlowReadInput) -> None:
        status = ProcedureStatus(workflow=workflow.info().workflow_id, pool=inp.pool, phase=Phase.CONFIRMING)
        super().__init__(status, budget=inp.budget, dry_run=False, operator_wait_s=3600)

    @workflow.run
    async def run(self, inp: SlowReadInput) -> ProcedureStatus:
        try:
            listed = await self.observe(
                cast(Callable[[Any, PoolRef], list[str]], SLOW_LIST), inp.pool, "list the pool's pods"
            )
        except Aborted:
            return self.finish(Phase.ABORTED)
        self.decide(f"listed {len(listed)} pod(s)")
        return self.finish(Phase.DONE)
