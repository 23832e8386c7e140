"""Step 6's wait between retiring a workload's lost pods and scaling it back up.

A Deployment scaled down by the lost pods' count must have let those pods go before
it is scaled up again: otherwise the ReplicaSet may keep a lost pod and remove a
healthy one. The recovery polls its light look until ``fleet.rebuild.still_counted``
finds none, and after ``deroute_timeout_s`` scales up anyway, saying so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet import rebuild
    from fleet.observation import PoolObservation
    from fleet.recovery import RecoveryTimings
    from workflows.procedure import Procedure


async def await_retired(
    proc: Procedure,
    look: Callable[[str], Awaitable[PoolObservation]],
    timings: RecoveryTimings,
    pods: tuple[str, ...],
    workload: str,
) -> None:
    """Before scaling up: has the workload's controller let the lost pods go?"""

    async def counted() -> list[str]:
        obs = await look(f"rebuild: has {workload} let the lost pods go?")
        return rebuild.still_counted(pods, obs.pods)

    left, gone = await proc.poll(
        counted,
        lambda left: not left,
        interval_s=timings.poll_interval_s,
        deadline=proc.now() + timings.deroute_timeout_s,
        summary=f"rebuild: {workload} to let the lost pods go",
    )
    if not gone:
        proc.decide(
            f"{workload} still counts {', '.join(left)} {timings.deroute_timeout_s:g} s after the "
            "scale-down that retires them: scaling up anyway (verification shows whether a "
            "replacement came for each)",
            {"still_counted": left},
        )
