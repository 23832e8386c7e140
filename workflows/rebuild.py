"""Step 6's waits: for a rebuild slot, and between retiring a workload's lost pods and scaling it back up.

At most ``recovery_concurrency`` recoveries rebuild capacity at once, fleet-wide
(``fleet.slots.rebuild_slot``); beyond it a recovery waits, queued, in phase
``queued-for-rebuild``. A Deployment scaled down by the lost pods' count must have let
those pods go before it is scaled up again: otherwise the ReplicaSet may keep a lost pod
and remove a healthy one. The recovery polls its light look until
``fleet.rebuild.still_counted`` finds none, and after ``deroute_timeout_s`` scales up
anyway, saying so.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.observe import ObserveActivities
    from fleet import rebuild
    from fleet.incident import PoolRef
    from fleet.observation import PoolObservation
    from fleet.recovery import Phase, RecoveryTimings
    from fleet.slots import Slots, rebuild_slot
    from workflows.procedure import Procedure


async def await_rebuild_slot(proc: Procedure, pool: PoolRef, timings: RecoveryTimings) -> None:
    """Step 6 starts once fewer than the cap of recoveries rebuild fleet-wide (bounded remediation).

    Queued, the recovery says so (phase ``queued-for-rebuild``, the record, the UI) and looks again
    with back-off. It waits at most ``ramp_max_s + replacement_timeout_s`` (about one recovery's
    rebuild); then it rebuilds anyway and says so: the cap paces a burst, it never keeps lost
    capacity from coming back.
    """
    if not workflow.patched("rebuild-slots"):  # recoveries past step 6 before the cap replay as they ran
        return
    me = workflow.info().workflow_id
    queued: list[bool] = []

    async def look() -> Slots:
        slots: Slots = await proc.observe(
            ObserveActivities.recovery_slots, me, "recoveries rebuilding capacity fleet-wide"
        )
        return slots

    async def queue() -> None:
        queued.append(True)
        await proc.enter(Phase.QUEUED_FOR_REBUILD, f"Queued for rebuilding: **{pool.key}** waits for a slot")

    wait_s = timings.ramp_max_s + timings.replacement_timeout_s
    await proc.await_slot(
        look,
        lambda slots: rebuild_slot(pool.key, slots),
        queued=queue,
        interval_s=max(timings.poll_interval_s, 1.0),
        wait_s=wait_s,
        summary=f"wait for a rebuild slot for {pool.key}",
        still_queued=f"still queued after {wait_s:.0f} s: it rebuilds now anyway (the cap paces a burst; "
        "it never keeps lost capacity from coming back)",
    )
    if queued:
        await proc.enter(Phase.REBUILDING, "Rebuilding the warm floor")


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
