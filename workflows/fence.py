"""``NodeFence``: cordon a node the fast path found lost or GPU-faulted, before any incident looks (``fleet.fence``).

The runbook's fence (DESIGN.md §3 step 6) moved ahead of the incident for the one effect that
cannot wait on a correlation window: keeping the scheduler off a dead machine. One run per
node loss, under ``fence/<node>``; it reads the node, decides with ``fleet.fence``, and cordons
through the ledger. A refused cordon stops here and asks an operator, like every effect; the
pools' recoveries meanwhile run their own fence step and find the node cordoned (or cordon it).

The fast path starts it for a node that turned not Ready, and for a Ready node on which a node
problem detector set a GPU problem condition (``GpuXid``...): no replacement belongs on a failing
GPU. A node whose engines still answer (a kubelet cut off from the API server, or a wrong signal:
a health check flagging GPUs that work) is capacity that still serves: before cordoning it the fence asks the fleet's removal
breaker (``fleet.breaker``). Dead capacity (no engine answers) never asks. A held fence waits,
visibly, for an operator's reset of the breaker, then reads the node again and decides anew: the
held loss is re-evaluated against the world as it is then, never replayed.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.act import ActActivities, NodeCordon
    from activities.coordination import ask_breaker
    from activities.observe import ObserveActivities
    from fleet.breaker import BreakerLimits, RemovalRequest, Verdict
    from fleet.fence import FenceVerdict, fence_decision
    from fleet.incident import PoolRef
    from fleet.recovery import Phase, ProcedureStatus, RecoveryTimings
    from workflows.device_quarantine import device_scope
    from workflows.procedure import Aborted, Procedure, opening


class NodeFenceInput(BaseModel):
    node: str
    pools: list[PoolRef] = Field(min_length=1, description="The managed pools with routed pods on the node")
    evidence: str = Field(description="What the fast path saw (the node's Ready condition, or its deletion)")
    detected_at: float = Field(description="When the fast path saw it (unix seconds)")
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    breaker: BreakerLimits = Field(default_factory=BreakerLimits, description="FLEETMEND_REMOVAL_BREAKER")
    dry_run: bool = False


@workflow.defn(name="NodeFence")
class NodeFence(Procedure):
    """Observe the node, decide (``fleet.fence.fence_decision``), cordon it through the ledger."""

    @workflow.init
    def __init__(self, inp: NodeFenceInput) -> None:
        figures = {"node": inp.node, "pools": [p.key for p in inp.pools]}
        super().__init__(
            **opening(inp.pools[0], Phase.FENCING, inp.timings, dry_run=inp.dry_run, figures=figures)
        )
        self._released = False

    @workflow.signal(name="breaker_reset", description="The removal breaker was reset: decide again")
    def breaker_reset(self) -> None:
        self._released = True

    @workflow.run
    async def run(self, inp: NodeFenceInput) -> ProcedureStatus:
        self.begin("node-fence", inp.pools[0])
        try:
            await self.enter(Phase.FENCING, f"Fencing **{inp.node}**: {inp.evidence}")
            self.decide(f"the fast path reported {inp.node}: {inp.evidence}")
            while True:
                read = await self.observe(ObserveActivities.read_node, inp.node, f"fence: read {inp.node}")
                decision = fence_decision(inp.node, read.node)
                self.decide(decision.reason)
                if decision.verdict is not FenceVerdict.CORDON:
                    break
                if read.node is not None and read.node.ready is True and await self.spares_node(inp):
                    break
                if await self.breaker_allows(inp):
                    await self.act(
                        ActActivities.cordon_node,
                        NodeCordon(step="fence", node=inp.node),
                        f"fence {inp.node}: cordon, so nothing new is scheduled onto a lost node",
                    )
                    self.figure("fenced_after_s", round(self.now() - inp.detected_at, 3))
                    break
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)

    async def spares_node(self, inp: NodeFenceInput) -> bool:
        """A Ready node's GPU problem may be one GPU's (``fleet.device_fault``): then the node is not
        cordoned - the device plugin already withholds that GPU, and the pool's recovery fences the
        device. Fences that started before device scope existed cordon as they did (patch)."""
        if not workflow.patched("fence-device-scope"):
            return False
        scope = await device_scope(self, inp.node, inp.timings, "fence")
        return scope is not None and scope.spares_node

    async def breaker_allows(self, inp: NodeFenceInput) -> bool:
        """Probe the node's engines; dead capacity is fenced at once, serving capacity asks the removal
        breaker. False: it was held, and the breaker has since been reset (read the node again).
        Fences that started before the breaker existed cordon as they did (patch)."""
        if not workflow.patched("fence-asks-the-breaker"):
            return True
        engines = await self.observe(
            ObserveActivities.probe_node_engines, inp.node, f"fence: probe the engines on {inp.node}"
        )
        self.figure(
            "engines", {"on_node": engines.engines, "answering": engines.answering, "unread": engines.unread}
        )
        if engines.answering == 0 and engines.unread == 0:
            return True  # dead capacity: never held (fleet.breaker); an engine not read in time is not dead
        request = RemovalRequest(
            node=inp.node,
            action="cordon",
            signal=inp.evidence,
            requester=workflow.info().workflow_id,
            engines=engines.engines,
            answering=engines.answering,
            unread=engines.unread,
            fleet_gpu_nodes=engines.fleet_gpu_nodes,
            limits=inp.breaker,
        )
        verdict = await self.call(ask_breaker, request, "ask the removal breaker")
        self.decide(verdict.reason, {"breaker": verdict.model_dump(mode="json")})
        if verdict.verdict is not Verdict.HELD:
            return True
        self._released = False
        # The breaker's trip post speaks for every fence it holds (one message in a storm); fences held
        # before that was so posted their own hold and reminders (patch).
        quiet = workflow.patched("held-fence-leaves-the-post-to-the-breaker")
        await self.await_release(
            f"{verdict.reason} (`fleetmend breaker reset`)", lambda: self._released, quiet=quiet
        )
        return False
