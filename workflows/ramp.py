"""Traffic back onto capacity: step 5 (promote warm spares) and step 9 (ramp by measured rate).

Promotion shifts traffic to warm spares of the same model and revision by adding the
router-only label to exactly those replicas (never scaling first).

A replacement is ready before it is fast (cold prefix cache): each ramp step measures every
routed replica's service rate and TTFT (on the new replica, not the fleet average), weights the
router by it (``fleet.warmth.plan_weights``) and re-admits at the new capacity (the
admission keeper). Ramping is not a substitute for admission: shedding stays with the keeper.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, WeightsChangeRequest
    from activities.observe import ObserveActivities, ScrapeRequest
    from fleet.engine_metrics import EngineSnapshot
    from fleet.loss import failed_nodes
    from fleet.observation import PoolObservation
    from fleet.pool import GroupRole, ReplicaGroup
    from fleet.recovery import Phase
    from fleet.recovery_state import RecoveryState
    from fleet.runbook import with_lost
    from fleet.spares import pick_spares
    from fleet.warmth import new_leaders, plan_weights
    from workflows.admission import AdmissionKeeper
    from workflows.procedure import Procedure


async def promote_warm_capacity(
    proc: Procedure,
    keeper: AdmissionKeeper,
    obs: PoolObservation,
    lost: list[ReplicaGroup],
    state: RecoveryState,
    initial: PoolObservation,
) -> list[ReplicaGroup]:
    """Step 5: route to warm spares of the same model and revision by adding the router-only label.

    Nothing else about the spare changes: its role label may be what its own
    controller selects on, and changing it would orphan the pod.
    """
    await proc.enter(Phase.PROMOTING, "Promoting warm spares of the same model and revision")
    obs = with_lost(obs, lost)
    # Spares on a node that failed are not warm capacity; a node that only hosted a crashed pod is fine.
    failed = sorted(failed_nodes(lost, obs.snapshot, state.reports))
    serving = [g.id for g in lost if g.role is GroupRole.SERVING]
    spares = [g.id for g in lost if g.role is not GroupRole.SERVING]
    pick = pick_spares(obs.snapshot, serving, failed, lost_spares=spares)
    proc.decide(pick.reason, {"promotions": pick.promotions, "rejected": pick.rejected})
    promoted: list[ReplicaGroup] = []
    for lost_id, spare_id in pick.promotions.items():
        spare = obs.snapshot.group(spare_id)
        why = f"promote spare {spare_id} in place of {lost_id}"
        await proc.route(
            keeper.inp.pool, spare.pods, obs.router_label, initial.router_label_value, step="promote", why=why
        )
        promoted.append(spare)
    proc.figure("promoted", [g.id for g in promoted])
    if promoted:
        await keeper.promoted(promoted)
    state.unmatched = list(pick.unmatched)
    return promoted


async def ramp_back(
    proc: Procedure,
    keeper: AdmissionKeeper,
    initial: PoolObservation,
    promoted: list[ReplicaGroup],
    *,
    expected_new: int,
) -> None:
    """Step 9: weight the routed replicas by measured rate every ``ramp_interval_s`` until the new ones are
    warm (as many as the rebuild expects, ``expected_new``) or ``ramp_max_s`` is over. The keeper holds
    the recovery's input and its look at the pool; it re-admits after every step."""
    inp, look = keeper.inp, keeper.look
    await proc.enter(Phase.RAMPING, "Ramping traffic back by measured service rate")
    if inp.dry_run:
        proc.decide("dry-run: ramp not performed")
        return
    timings = inp.timings
    new_pods = {g.leader_pod for g in promoted}
    deadline = proc.now() + timings.ramp_max_s
    previous: dict[str, EngineSnapshot] | None = None
    previous_at = 0.0
    step = 0
    backoff: dict[str, float] = {}

    async def routed_leaders() -> list[str]:
        obs = await look("ramp: routed replicas and their engines")
        new_pods.update(new_leaders(initial, obs))
        return sorted(
            g.leader_pod
            for g in obs.snapshot.groups
            if g.routed and g.ready and g.leader_pod in obs.routed_pods
        )

    while True:
        leaders, routed = await proc.poll(
            routed_leaders,
            lambda leaders: bool(new_pods & set(leaders)),
            interval_s=timings.poll_interval_s,
            deadline=deadline,
            summary="wait for a replacement to be ready",
        )
        if not routed:
            proc.decide("no new replica to ramp (none routed yet, none pending)")
            return
        current = await proc.observe(
            ObserveActivities.scrape_engines,
            ScrapeRequest(pool=inp.pool, pods=leaders),
            f"ramp: measure {len(leaders)} replicas",
        )
        if previous is not None:
            ramped = new_pods & set(leaders)
            plan = plan_weights(
                previous,
                current,
                max(1e-3, proc.now() - previous_at),
                sorted(ramped),
                ttft_slo_s=inp.objectives.ttft_p99_slo_s,
                warm_fraction=timings.warm_fraction,
                backoff=backoff,
                by_deadline=inp.objectives.engine_queue_order == "deadline",
            )
            backoff = dict(plan.backoff)
            step += 1
            await keeper.after_ramp_step(step, previous, current, previous_at, new_pods, plan)
            await proc.act(
                ActActivities.set_weights,
                WeightsChangeRequest(step=f"ramp-{step}", pool=inp.pool, weights=plan.weights),
                f"ramp step {step}: weights by measured rate",
            )
            proc.figure("ramp_weights", plan.weights)
            proc.decide(f"ramp step {step}: {plan.reason}", {"weights": plan.weights, "rates": plan.rates})
            if (plan.all_warm and len(ramped) >= expected_new) or proc.now() > deadline:
                proc.decide("new replicas warm: ramp complete" if plan.all_warm else "ramp window over")
                return
        previous, previous_at = current, proc.now()
        await workflow.sleep(timings.ramp_interval_s, summary=f"ramp interval (step {step})")
