"""``NodeFence``: cordon a node the fast path confirmed lost, before any incident looks (``fleet.fence``).

The runbook's fence (DESIGN.md §3 step 6) moved ahead of the incident for the one effect that
cannot wait on a correlation window: keeping the scheduler off a dead machine. One run per
node loss, under ``fence/<node>``; it reads the node, decides with ``fleet.fence``, and cordons
through the ledger. A refused cordon stops here and asks an operator, like every effect; the
pools' recoveries meanwhile run their own fence step and find the node cordoned (or cordon it).
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, NodeCordon
    from activities.observe import ObserveActivities
    from fleet.fence import FenceVerdict, fence_decision
    from fleet.incident import PoolRef
    from fleet.recovery import Phase, ProcedureStatus, RecoveryTimings
    from workflows.procedure import Aborted, Procedure


class NodeFenceInput(BaseModel):
    node: str
    pools: list[PoolRef] = Field(min_length=1, description="The managed pools with routed pods on the node")
    evidence: str = Field(description="What the fast path saw (the node's Ready condition, or its deletion)")
    detected_at: float = Field(description="When the fast path saw it (unix seconds)")
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    dry_run: bool = False


@workflow.defn(name="NodeFence")
class NodeFence(Procedure):
    """Observe the node, decide (``fleet.fence.fence_decision``), cordon it through the ledger."""

    @workflow.init
    def __init__(self, inp: NodeFenceInput) -> None:
        figures = {"node": inp.node, "pools": [p.key for p in inp.pools]}
        status = ProcedureStatus(
            workflow=workflow.info().workflow_id, pool=inp.pools[0], phase=Phase.FENCING, figures=figures
        )
        status.dry_run = inp.dry_run
        super().__init__(
            status,
            budget=inp.timings.retry,
            dry_run=inp.dry_run,
            operator_wait_s=inp.timings.approval_timeout_s,
        )

    @workflow.run
    async def run(self, inp: NodeFenceInput) -> ProcedureStatus:
        self.begin("node-fence", inp.pools[0])
        try:
            await self.enter(Phase.FENCING, f"Fencing **{inp.node}**: {inp.evidence}")
            self.decide(f"the fast path confirmed {inp.node} lost: {inp.evidence}")
            read = await self.observe(ObserveActivities.read_node, inp.node, f"fence: read {inp.node}")
            decision = fence_decision(inp.node, read.node)
            self.decide(decision.reason)
            if decision.verdict is FenceVerdict.CORDON:
                await self.act(
                    ActActivities.cordon_node,
                    NodeCordon(step="fence", node=inp.node),
                    f"fence {inp.node}: cordon, so nothing new is scheduled onto a lost node",
                )
                self.figure("fenced_after_s", round(self.now() - inp.detected_at, 3))
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)
