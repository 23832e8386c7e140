"""The admission keeper: shedding at the gateway from step 3 (protect the survivors) until step 10.

The recovery's gap is refused at the gateway, lowest tier first, by the arithmetic of lost
capacity (``fleet.shedding``); the survivors' queues absorb what they can of it within the wait
budget. From the first shed on, the keeper re-reads the routed replicas' queues every
``admission_interval_s`` and re-admits; every capacity change of the runbook (a promotion, a
ramp step) re-admits at once. Every change of the shed level is a decision in the incident
record, a point of the ``shed_levels`` figure and one ledger effect. Lifting follows one rule
(``fleet.shedding.lift_after_verification``), nothing else.

The keeper acts through the recovery's procedure toolkit (``act``, ``decide``, ``figure``), so a
refused admission change asks an operator like any other effect.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, AdmissionChangeRequest, RetryPolicyChangeRequest
    from activities.observe import (
        AdmissionWatch,
        AdmissionWatched,
        JournalRequest,
        ObserveActivities,
        ObserveRequest,
    )
    from fleet.admission_look import (
        ARRIVALS_COUNTED_S,
        KeeperLook,
        KeeperMemory,
        keeper_look,
        keeper_queue_room,
        keeper_readmission,
    )
    from fleet.arrivals import ArrivalTally, admitted_rate, arrival_rate, planned_arrivals
    from fleet.engine_metrics import EngineSnapshot
    from fleet.gateway import Admission
    from fleet.observation import PoolObservation
    from fleet.pool import GroupRole, ReplicaGroup
    from fleet.recovery import Phase, RecoveryInput
    from fleet.recovery_observations import in_flight_record
    from fleet.retry_budget import decide_retry_policy
    from fleet.service_rate import per_group_capacity
    from fleet.shedding import (
        LiftDecision,
        PressureThresholds,
        ShedDecision,
        admission_changed,
        decide_shedding,
        estimate_arrivals,
        lift_after_verification,
        pool_capacity_rps,
        ramp_capacity_rps,
        refused_fraction,
    )
    from fleet.survivor_load import (
        PARKED_FACTOR,
        next_admission_look,
        routed_backlog,
        survivor_loads,
        survivors_look,
    )
    from fleet.vocabulary import SHED_ORDER
    from fleet.warmth import RampPlan, ramp_capacity_shape
    from workflows.procedure import Procedure, describe_failure, run_bounded

Look = Callable[[str], Awaitable[PoolObservation]]


# History events one watch adds (``_watch``): the interval's timer and its workflow task (5), the
# watch activity and the workflow task its result wakes (6). A wait of W seconds without an
# admission change adds at most WATCH_EVENTS_MAX x (W / admission_watch_s + 1).
WATCH_EVENTS_MAX = 11


class AdmissionKeeper:
    """The admission the gateway has (as this recovery set it), what it is computed from, and its keeper task."""

    def __init__(self, proc: Procedure, inp: RecoveryInput, look: Look) -> None:
        self._proc = proc
        self._inp = self.inp = inp
        self._look = self.look = look
        self.shed: ShedDecision | None = None
        self.admission = Admission()
        self.arrival_rps = 0.0
        self.memory = KeeperMemory()  # the gateway's count from the first look on, the last look, served
        self.per_group_rps = 0.0
        self.serving_groups = 0
        self.readmissions = 0
        self.capacity_rps = 0.0
        self.backlog = 0.0
        self._lock = asyncio.Lock()
        self._keeping = False
        self._task: asyncio.Task[None] | None = None
        self._look_s = inp.timings.admission_interval_s
        self._parked = False  # the keeper looks PARKED_FACTOR x its max interval apart
        self._watch_failed = False  # the last watch failed: the next look is the keeper's own
        self._ended = False  # the recovery ended (halt): the keeper adds no command any more

    @property
    def arrivals(self) -> ArrivalTally:
        """The gateway's arrival count, from the incident's first look on."""
        return self.memory.arrivals

    @arrivals.setter
    def arrivals(self, tally: ArrivalTally) -> None:
        self.memory = self.memory.model_copy(update={"arrivals": tally})

    def count(self, obs: PoolObservation) -> None:
        """The incident's first look starts the gateway's arrival count (nothing refused yet)."""
        self.arrivals = self.arrivals.add(obs, 0.0)

    async def first_shed(
        self,
        before: PoolObservation,
        obs: PoolObservation,
        lost: list[ReplicaGroup],
        initial: PoolObservation,
    ) -> None:
        """Step 3: refuse exactly the capacity gap the queues cannot absorb, from two looks at the survivors."""
        inp = self._inp
        seconds = max(1e-3, obs.snapshot.observed_at - before.snapshot.observed_at)
        lost_ids = {g.id for g in lost}
        per_group, capacity_note = per_group_capacity(inp.objectives.group_capacity_rps, before, obs, seconds)
        # A gateway's counter is read from the incident's first look on: arrivals do not change with a loss.
        arrival, counted = arrival_rate(
            before,
            obs,
            seconds,
            lost_ids,
            refused_share=refused_fraction(self.admission),
            counted_since=initial,
        )
        pre = planned_arrivals(inp.reports, initial.router, initial.snapshot.observed_at)
        if pre is not None:
            # The rate the pool keeps, counted before the loss; the window since the loss also holds the
            # cut streams sent again. The keeper's count goes on from that window (the stretch from the
            # first look to ``before``, a second or so after the loss, is left out with the rest).
            counted = (
                f"counted by the gateway over the {pre.seconds:.0f} s before the loss, until "
                f"{pre.ended_before_s:.1f} s before its first sign; since the loss it counted {arrival:.1f} "
                "req/s, the streams the loss cut sent again among them"
            )
            arrival = pre.rps
            self.arrivals = ArrivalTally.counted_before(pre)
        self._proc.decide(f"arrivals {arrival:.1f} req/s ({counted}); {capacity_note}")
        self.arrivals = self.arrivals.add(before, 0.0).add(obs, refused_fraction(self.admission))
        look = survivors_look(before, obs, lost_ids)
        survivors = list(look.loads)
        self.arrival_rps, self.per_group_rps = arrival, per_group
        self.serving_groups = len(survivors) + len(look.unread)
        self.backlog = routed_backlog(obs, lost_ids)
        async with self._lock:
            self.shed = decide_shedding(
                arrival_rps=arrival,
                survivors=survivors,
                lost_capacity_rps=per_group * len([g for g in lost if g.role is GroupRole.SERVING]),
                per_group_capacity_rps=per_group,
                thresholds=PressureThresholds(target_utilization=inp.objectives.target_utilization),
                keep_armed=True,  # the warm floor is short until the replacement is back
                queues=keeper_queue_room(inp.objectives.wait_budget_s, self.backlog, self._look_s),
                unread_survivors=look.unread,
            )
            self.capacity_rps = self.shed.survivor_capacity_rps
            await self._apply(self.shed, step="protect-shed")

    def keep(self, lost_ids: set[str]) -> None:
        """Start re-reading the queues (until ``stop``)."""
        self._keeping = True
        self._task = asyncio.ensure_future(self._keep(lost_ids))

    async def _keep(self, lost_ids: set[str]) -> None:
        """Re-read the queues every ``admission_interval_s`` and re-admit.

        The queues absorb what they can of the gap; as they fill, the refused share rises to the
        gap, and when capacity returns it falls. A look that changes nothing records nothing, and
        while looks change nothing the interval backs off (``next_admission_look``). While the
        recovery waits on an operator, the looks run inside one activity (``_watch``).
        """
        proc, timings = self._proc, self._inp.timings
        while self._keeping:
            try:
                await workflow.wait_condition(lambda: not self._keeping, timeout=self._look_s)
                return
            except TimeoutError:
                pass
            if self._asking() and not self._watch_failed and workflow.patched("keeper-watches-while-asking"):
                await self._watch(lost_ids)
                continue
            obs = await self._look("admission: the routed replicas' queues")
            self._watch_failed = False
            look = keeper_look(
                self.memory,
                obs,
                lost_ids,
                refused_share=refused_fraction(self.admission),
                planned_capacity_rps=self.capacity_rps,
            )
            if not self._keeping:
                return
            moved = await self._take(look)
            bounded = workflow.patched("keeper-bounds-history")
            history_large = bounded and workflow.info().is_continue_as_new_suggested()
            if history_large and not self._parked:
                self._parked = True
                proc.decide(
                    f"the recovery's history is long ({workflow.info().get_current_history_length()} events): "
                    f"the admission keeper re-reads the queues every "
                    f"{PARKED_FACTOR * timings.admission_max_interval_s:.0f} s from now on "
                    "(capacity changes still re-admit at once)"
                )
            self._look_s = next_admission_look(
                self._look_s,
                timings.admission_interval_s,
                timings.admission_max_interval_s,
                admission_moved=moved,
                backlog=look.backlog,
                awaiting_operator=bounded and self._asking(),
                history_large=history_large,
            )

    def _asking(self) -> bool:
        return self._proc.status().phase is Phase.AWAITING_OPERATOR

    async def _take(self, look: KeeperLook) -> bool:
        """A look at the queues becomes the keeper's memory, and re-admits (True when admission moved)."""
        self.memory = look.memory
        return await self.readmit(
            look.change, look.capacity_rps, look.arrival_rps, backlog=look.backlog, capacity_changed=False
        )

    async def _watch(self, lost_ids: set[str]) -> None:
        """While the recovery waits on an operator: the keeper's looks inside one activity.

        An operator may take hours; a look per interval would add a timer and an activity to the
        history each time. The watch (``ObserveActivities.watch_admission``) looks and decides as
        ``_keep`` does, and returns only when admission would move, or after ``admission_watch_s``:
        the wait adds ``WATCH_EVENTS_MAX`` events per watch, whatever the number of looks. When the
        operator answers (or the recovery stops), the watch is cancelled and the keeper looks as before.
        """
        proc, inp, timings = self._proc, self._inp, self._inp.timings
        budget = timings.retry
        request = AdmissionWatch(
            observe=ObserveRequest(pool=inp.pool),
            lost_ids=sorted(lost_ids),
            memory=self.memory,
            admission=self.admission,
            capacity_rps=self.capacity_rps,
            arrival_rps=self.arrival_rps,
            wait_budget_s=inp.objectives.wait_budget_s,
            target_utilization=inp.objectives.target_utilization,
            interval_s=timings.admission_interval_s,
            max_interval_s=timings.admission_max_interval_s,
            look_timeout_s=budget.call_timeout_s,
            watch_s=timings.admission_watch_s,
        )
        # A look and the longest interval between two looks, twice: a watch that stops heartbeating
        # is a dead worker's (the next attempt starts from the request).
        heartbeat_s = 2 * (budget.call_timeout_s + timings.admission_max_interval_s)
        # Through run_bounded, not proc.observe: the operator's answer may end the recovery in the same
        # workflow task that cancels the watch, and nothing may be decided (no patch marker, no
        # operator ask) after the workflow completed. A watch that fails hands back to the keeper's own
        # looks (which read through the toolkit and ask an operator if the world stays unreadable).
        watching = asyncio.ensure_future(
            run_bounded(
                ObserveActivities.watch_admission,
                request,
                budget=budget,
                summary="admission: watch the queues while an operator is asked",
                timeout_s=timings.admission_watch_s + heartbeat_s,
                heartbeat_s=heartbeat_s,
            )
        )
        await workflow.wait_condition(lambda: watching.done() or not self._keeping or not self._asking())
        if not watching.done():
            if self._ended:
                # The recovery ended, perhaps in this very workflow task: no command may follow its
                # completion. The worker drops the watch at its next heartbeat (the workflow is closed).
                return
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, ActivityError):
                await watching
            return
        try:
            watched: AdmissionWatched = watching.result()
        except ActivityError as err:
            self._watch_failed = True
            proc.decide(f"admission watch failed ({describe_failure(err)}): the keeper looks again itself")
            return
        self._look_s = watched.interval_s  # the horizon the watch decided with
        if watched.moved and await self._take(watched.look):
            self._look_s = timings.admission_interval_s
        else:
            self.memory = watched.look.memory

    async def stop(self) -> None:
        """Stop the keeper (verification) and wait for its current look to end."""
        self._keeping = False
        if self._task is not None:
            await self._task
            self._task = None

    def halt(self) -> None:
        """The recovery ended (done or aborted): the keeper's loop ends at its next wake-up."""
        self._keeping = False
        self._ended = True

    async def readmit(
        self,
        change: str,
        capacity_rps: float,
        arrival_rps: float | None = None,
        *,
        backlog: float | None = None,
        capacity_changed: bool = True,
    ) -> bool:
        """A capacity change or a new look at the queues: recompute the gap the queues cannot absorb
        and re-apply admission when the shed level moved (True when it did)."""
        async with self._lock:
            if arrival_rps is not None:
                self.arrival_rps = arrival_rps
            if backlog is not None:
                self.backlog = backlog
            if capacity_changed:
                self.capacity_rps = capacity_rps
            decision = keeper_readmission(
                self.arrival_rps,
                capacity_rps,
                change,
                backlog=self.backlog,
                wait_budget_s=self._inp.objectives.wait_budget_s,
                look_s=self._look_s,
                target_utilization=self._inp.objectives.target_utilization,
            )
            if not admission_changed(self.admission, decision.admission):
                return False
            self.readmissions += 1
            await self._apply(decision, step=f"readmit-{self.readmissions}")
            return True

    async def promoted(self, groups: list[ReplicaGroup]) -> None:
        """Step 5: warm spares serve now; capacity is back by as many groups."""
        self.serving_groups += len(groups)
        await self.readmit(
            f"promoted {', '.join(g.id for g in groups)} (warm): {self.serving_groups} serving group(s) "
            f"x {self.per_group_rps:.1f} req/s",
            pool_capacity_rps(self.per_group_rps, self.serving_groups),
        )

    async def after_ramp_step(
        self,
        step: int,
        previous: dict[str, EngineSnapshot],
        current: dict[str, EngineSnapshot],
        previous_at: float,
        new_pods: set[str],
        plan: RampPlan,
    ) -> None:
        """Each ramp step re-measures capacity (new replicas at their warmth) and arrivals, and re-admits."""
        seconds = max(1e-3, self._proc.now() - previous_at)
        # Arrivals as the gateway counted them since the first look; the engines' admissions only
        # when the gateway keeps no count.
        arrival = self.arrivals.rate(ARRIVALS_COUNTED_S)
        if arrival is not None:
            counted = (
                f"arrivals {arrival:.1f} req/s counted by the gateway over {self.arrivals.seconds:.0f} s"
            )
        else:
            admitted = admitted_rate(previous, current, seconds)
            arrival = estimate_arrivals(admitted, self.admission, self.arrival_rps)
            counted = f"the engines admitted {admitted:.1f} req/s"
        established, warmth = ramp_capacity_shape(plan, new_pods)
        capacity, floor_note = ramp_capacity_rps(self.per_group_rps, established, warmth, self.serving_groups)
        await self.readmit(
            f"ramp step {step}: {established} established group(s) + new "
            + (", ".join(f"{p} {w:.0%} warm" for p, w in sorted(warmth.items())) or "none")
            + f" x {self.per_group_rps:.1f} req/s{floor_note}; {counted}",
            capacity,
            arrival,
        )

    async def in_flight(self, obs: PoolObservation, lost: list[ReplicaGroup], *, since: float) -> None:
        """Step 4: the gateway retries before the first byte only, within a budget drawn from the survivors'
        headroom; the lost replicas' request journal says what became of their requests."""
        proc, pool = self._proc, self._inp.pool
        await proc.enter(Phase.IN_FLIGHT, "Deciding the lost replicas' in-flight requests")
        look = survivors_look(obs, obs, {g.id for g in lost})
        decision = decide_retry_policy(look.loads)
        reason = f"{decision.reason}; {look.note}" if look.note else decision.reason
        proc.decide(reason, {"retry": decision.policy.model_dump(mode="json"), "unread": look.unread})
        await proc.act(
            ActActivities.set_retry_policy,
            RetryPolicyChangeRequest(step="in-flight-retry-policy", pool=pool, retry=decision.policy),
            "retry before first byte only, budget from survivors' headroom",
        )
        leaders = [g.leader_pod for g in lost]
        journal = await proc.observe(
            ObserveActivities.read_journal,
            JournalRequest(pool=pool, replicas=leaders),
            f"collect the request journal of {', '.join(leaders)}",
        )
        record = in_flight_record(journal, since=since)
        proc.figure("in_flight", record)
        proc.decide(
            f"lost replicas' requests: {record['retried']} retried before first byte, {record['terminal_errors']} "
            f"ended with a terminal stream error after streaming (never replayed); "
            f"{record['effect_operation_ids']} proposed effect(s) carry request-derived operation ids",
            {"in_flight": record},
        )

    async def roll_back(
        self,
        verification_passed: bool,
        before: PoolObservation,
        obs: PoolObservation,
        lost_ids: set[str],
        *,
        warm_floor: int,
    ) -> None:
        """Step 10: lift shedding by the one lift rule (``fleet.shedding.lift_after_verification``).

        Verification passed but a survivor still saturated (or the warm floor short): shedding stays
        on while the recovery looks again every ``poll_interval_s``, up to ``verify_timeout_s``; still
        not calm then, the recovery ends with shedding in place and says so (record, figure
        ``shedding_left_in_place``, incident channel). A failed or skipped verification never lifts it.
        """
        proc, timings = self._proc, self._inp.timings
        if self.admission == Admission():
            return

        def rule(before: PoolObservation, obs: PoolObservation) -> LiftDecision:
            return lift_after_verification(
                verification_passed,
                warm_groups=sum(1 for g in obs.snapshot.groups if g.ready),
                warm_floor=warm_floor,
                survivors=survivor_loads(before, obs, lost_ids),
            )

        decision = rule(before, obs)
        proc.decide(f"lift shedding? {decision.reason}")
        # patched: recoveries verified before the one lift rule replay as they ran (a pass lifted shedding
        # even with a survivor still saturated).
        if not workflow.patched("lift-by-one-rule"):
            if decision.lift or verification_passed:
                await self.lift(decision.model_copy(update={"lift": True}))
            return
        if not decision.lift and verification_passed:
            proc.decide(
                f"verification passed but shedding stays on ({decision.reason}): looking again for up to "
                f"{timings.verify_timeout_s:.0f} s before lifting it"
            )

            async def look_again() -> LiftDecision:
                return rule(
                    *await proc.window(self._look, timings.poll_interval_s, summary="lift: survivors calm?")
                )

            decision, _ = await proc.poll(
                look_again,
                lambda d: d.lift,
                interval_s=timings.poll_interval_s,
                deadline=proc.now() + timings.verify_timeout_s,
                summary="lift: wait for calm survivors",
            )
            proc.decide(f"lift shedding? {decision.reason}")
        await self.lift(decision)

    async def lift(self, decision: LiftDecision) -> None:
        """Step 10: lift shedding when the one lift rule says so; otherwise say what stays in place."""
        proc = self._proc
        if decision.lift:
            await proc.act(
                ActActivities.set_admission,
                AdmissionChangeRequest(
                    step="rollback-lift-shedding", pool=self._inp.pool, admission=Admission()
                ),
                "lift shedding: warm floor restored",
            )
            self.admission = Admission()
            self._record_level(0.0, 0.0)
            proc.figure("shedding_lifted", True)
            return
        refused = self._refusing()
        text = (
            f"[fleetmend] {self._inp.pool.key}: the recovery ends with shedding on ({decision.reason}): the "
            f"gateway keeps refusing {refused} (queue bound {self.admission.queue_bound}); an operator lifts "
            "it at the gateway once the survivors are calm"
        )
        proc.figure("shedding_lifted", False)
        proc.figure("shedding_left_in_place", self.admission.model_dump(mode="json"))
        proc.decide(text, {"admission": self.admission.model_dump(mode="json"), "reason": decision.reason})
        await proc.notify("shedding-left-on", text)

    def _refusing(self, decision: ShedDecision | None = None) -> str:
        """What admission refuses, per tier (a decision's touched tiers, or every tier refused now)."""
        if decision is not None:
            admission, tiers = decision.admission, list(decision.tiers_touched)
        else:
            admission, tiers = self.admission, [t for t in SHED_ORDER if self.admission.shed_share(t)]
        return ", ".join(f"{t.value} {admission.shed_share(t):.0%}" for t in tiers) or "nothing"

    def _record_level(self, gap: float, refused: float) -> None:
        """The shed level over time (figure ``shed_levels``: at = epoch seconds, shares of arrivals)."""
        figures = self._proc.status().figures
        levels = list(figures.get("shed_levels") or [])
        levels.append({"at": round(self._proc.now(), 3), "gap": round(gap, 4), "refused": round(refused, 4)})
        self._proc.figure("shed_levels", levels)

    async def _apply(self, decision: ShedDecision, *, step: str) -> None:
        """Every change of the shed level is a decision in the incident record, and one ledger effect."""
        proc = self._proc
        proc.decide(decision.reason, {"shed": decision.model_dump(mode="json")})
        self._record_level(decision.deficit_fraction, decision.shed_fraction)
        # Every tier refused any of during the incident, lowest first.
        touched = set(proc.status().figures.get("shed_tiers") or []) | {
            t.value for t in decision.tiers_touched
        }
        proc.figure("shed_tiers", [t.value for t in SHED_ORDER if t.value in touched])
        if decision.admission == self.admission:
            return
        await proc.act(
            ActActivities.set_admission,
            AdmissionChangeRequest(step=step, pool=self._inp.pool, admission=decision.admission),
            f"admission: refuse {self._refusing(decision)} ({decision.shed_fraction:.1%} of arrivals); "
            f"queue bound {decision.admission.queue_bound}",
        )
        self.admission = decision.admission
