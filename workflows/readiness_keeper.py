"""ReadinessKeeper: one long-running workflow per pool that keeps the serving-ready gates in sync.

Why a workflow and not a loop inside the worker process:

* **one owner per pool** - the workflow id ``readiness/<namespace>/<service>``
  is unique, so two workers (a deploy, a scale-out) never both flip the gates;
* **the hysteresis survives restarts** - each pod's calm streak and write
  counter live in workflow state (carried across continue-as-new), so a worker
  restart neither flaps a gate nor repeats a write (the write counter is part
  of the ledger's operation id);
* **visible and steerable** - the ``status`` query lists every replica's
  verdict and the recent gate writes in the Temporal UI; cancelling the
  workflow stops the keeper.

History grows a few events per sample, so the run continues-as-new every
``samples_per_run`` samples, or earlier when the server suggests it (history
size) or a new worker version became current. Each run is pinned to the worker
version it started on; continue-as-new starts the next run on the current
version (Worker Versioning's upgrade-on-continue-as-new), so a worker roll moves
the keeper onto the new code within one sample, with its gates carried.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.readiness import GateSyncRequest, GateSyncResult, GateWrite, PodGate, ReadinessActivities
    from fleet import search_attributes as sa
    from fleet.incident import PoolRef
    from fleet.readiness import ReadinessThresholds
    from fleet.recovery import RetryBudget
    from workflows.procedure import (
        Watch,
        describe_failure,
        is_cancellation,
        run_bounded,
        should_continue_as_new,
    )

READINESS_KEEPER_WORKFLOW = "ReadinessKeeper"


def sample_budget(interval_s: float) -> RetryBudget:
    """One sample's bounded budget: a few attempts within a handful of intervals (a minute at least)."""
    return RetryBudget(
        attempts=5,
        budget_s=max(60.0, interval_s * 25),
        call_timeout_s=max(10.0, interval_s * 5),
        max_interval_s=10.0,
    )


def readiness_keeper_workflow_id(pool: PoolRef) -> str:
    return f"readiness/{pool.namespace}/{pool.service}"


class KeeperInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    thresholds: ReadinessThresholds = Field(default_factory=ReadinessThresholds)
    interval_s: float = Field(2.0, gt=0, description="Seconds between samples")
    samples_per_run: int = Field(500, ge=1, description="Continue-as-new after this many samples")
    dry_run: bool = False
    gates: dict[str, PodGate] = Field(default_factory=dict, description="Carried across continue-as-new")
    samples_before: int = Field(0, ge=0)
    writes_before: int = Field(0, ge=0)


class KeeperStatus(BaseModel):
    pool: PoolRef
    samples: int = 0
    writes: int = 0
    verdicts: dict[str, str] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)
    recent_writes: list[GateWrite] = Field(default_factory=list)
    last_error: str | None = None


@workflow.defn(name=READINESS_KEEPER_WORKFLOW)
class ReadinessKeeper(Watch):
    def __init__(self) -> None:
        self._status: KeeperStatus | None = None
        self._gates: dict[str, PodGate] = {}
        self._samples_this_run = 0

    @workflow.run
    async def run(self, inp: KeeperInput) -> None:
        status = KeeperStatus(pool=inp.pool, samples=inp.samples_before, writes=inp.writes_before)
        self._status = status
        workflow.upsert_search_attributes(
            [
                sa.FLEETMEND_KIND.value_set("readiness-keeper"),
                sa.FLEETMEND_NAMESPACE.value_set(inp.pool.namespace),
                sa.FLEETMEND_POOL.value_set(inp.pool.key),
                sa.FLEETMEND_DRY_RUN.value_set(inp.dry_run),
            ]
        )
        self._gates = dict(inp.gates)
        await self.poll(
            lambda: self._sample(inp),
            lambda _: self._samples_this_run >= inp.samples_per_run or should_continue_as_new(),
            interval_s=inp.interval_s,
            deadline=None,
            summary="next readiness sample",
        )
        if not should_continue_as_new():
            # The run's quota is spent, not the history: the next run's first sample keeps the interval.
            await workflow.sleep(inp.interval_s, summary="next readiness sample")
        workflow.continue_as_new(
            inp.model_copy(
                update={
                    "gates": self._gates,
                    "samples_before": status.samples,
                    "writes_before": status.writes,
                }
            ),
            initial_versioning_behavior=workflow.ContinueAsNewVersioningBehavior.AUTO_UPGRADE,
        )

    async def _sample(self, inp: KeeperInput) -> GateSyncResult | None:
        """One sample: KV, queue and health of every replica, and the gate writes they call for (None: failed)."""
        status = self._status
        assert status is not None
        try:
            result: GateSyncResult = await run_bounded(
                ReadinessActivities.sync_readiness_gates,
                GateSyncRequest(
                    pool=inp.pool, thresholds=inp.thresholds, gates=self._gates, dry_run=inp.dry_run
                ),
                budget=sample_budget(inp.interval_s),
                summary=f"sample {inp.pool.key}: KV, queue, health -> readiness gates",
            )
        except ActivityError as err:
            if is_cancellation(err):
                raise  # the keeper is being stopped
            # The gates stay as they are (the keeper never guesses); the failure is in the status
            # and the details, and the next sample is another bounded call.
            self._samples_this_run += 1
            status.last_error = describe_failure(err)
            workflow.set_current_details(f"**Sample failed** (gates unchanged): {status.last_error}")
            return None
        status.last_error = None
        self._gates = result.gates
        self._samples_this_run += 1
        status.samples += 1
        status.writes += len(result.writes)
        status.verdicts = result.verdicts
        status.skipped = result.skipped
        status.recent_writes = (status.recent_writes + result.writes)[-50:]
        not_ready = sorted(p for p, v in result.verdicts.items() if not v.startswith("ready"))
        workflow.set_current_details(
            f"**{len(result.verdicts) - len(not_ready)} of {len(result.verdicts)}** replicas can take more "
            f"work" + (f"; not ready: {', '.join(not_ready)}" if not_ready else "")
        )
        return result

    @workflow.query(name="status", description="Every replica's readiness verdict and the recent gate writes")
    def status(self) -> KeeperStatus:
        assert self._status is not None
        return self._status
