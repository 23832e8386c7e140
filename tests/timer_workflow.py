"""A workflow that only waits six hours: proves the time-skipping fixture skips real timers."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow


@workflow.defn(name="FoundationSixHourWait")
class SixHourWait:
    @workflow.run
    async def run(self) -> str:
        start = workflow.now()
        await workflow.sleep(timedelta(hours=6), summary="six-hour wait")
        return str(workflow.now() - start)
