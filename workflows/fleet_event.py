"""``FleetEvent``: one topology domain's losses across pools, named once (``fleet.fleet_event``).

Started (and joined) by the fast path's fence at detection: every node confirmed lost sends
``node_lost`` to the event of each of its topology domains, under ``fleet-event/<label>/<value>``
(Signal-With-Start). The event correlates for the incidents' correlation window from its first loss,
then decides with ``fleet.fleet_event.common_cause``: a common cause is stated once (its status, the
Temporal UI's details, one incident-channel post through the ledger listing every pool hit); anything
less closes quietly. Losses that arrive after it decided start the domain's next event.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from fleet.fleet_event import NodeLoss, common_cause
    from fleet.incident import PoolRef, incident_workflow_id
    from fleet.recovery import Phase, ProcedureStatus, RecoveryTimings
    from workflows.procedure import Aborted, Procedure, opening


class FleetEventInput(BaseModel):
    label: str = Field(
        description="The topology label the domain is named by (e.g. topology.kubernetes.io/rack)"
    )
    value: str
    narrower: list[str] = Field(
        default_factory=list, description="Domain labels inside this one (fleet.fleet_event)"
    )
    first_pool: PoolRef = Field(description="A pool of the first loss (the record's pool field)")
    timings: RecoveryTimings = Field(default_factory=RecoveryTimings)
    dry_run: bool = False


@workflow.defn(name="FleetEvent")
class FleetEvent(Procedure):
    """Collect a domain's node losses for one correlation window, then name their common cause once."""

    @workflow.init
    def __init__(self, inp: FleetEventInput) -> None:
        figures: dict[str, Any] = {"domain": f"{inp.label}={inp.value}"}
        super().__init__(
            **opening(inp.first_pool, Phase.CORRELATING, inp.timings, dry_run=inp.dry_run, figures=figures)
        )
        self._losses: list[NodeLoss] = []

    @workflow.signal(name="node_lost", description="A node of this domain was confirmed lost")
    def node_lost(self, loss: NodeLoss) -> None:
        if all(known.node != loss.node for known in self._losses):
            self._losses.append(loss)

    @workflow.run
    async def run(self, inp: FleetEventInput) -> ProcedureStatus:
        self.begin("fleet-event", inp.first_pool)
        try:
            where = f"{inp.label}={inp.value}"
            await self.enter(Phase.CORRELATING, f"Correlating node losses in **{where}**")
            await workflow.wait_condition(lambda: bool(self._losses))
            window = inp.timings.correlation_window_s
            wait = max(0.0, self._losses[0].at + window - self.now())
            if wait > 0:
                await workflow.sleep(wait, summary=f"correlate losses in {where} for {window:g} s")
            cause = common_cause(inp.label, inp.value, list(self._losses), window, inp.narrower)
            self.decide(cause.summary, {"nodes": cause.nodes, "pools": cause.pools})
            self.figure("nodes", cause.nodes)
            self.figure("pools", cause.pools)
            self.figure("common_cause", cause.common)
            if cause.common:
                pools = {p.key: p for loss in self._losses for p in loss.pools}
                incidents = [incident_workflow_id(pools[key]) for key in cause.pools]
                self.figure("incidents", incidents)
                self.set_details(f"**{cause.summary}**\n\nIncidents: " + ", ".join(incidents))
                what = "FLEET EVENT (suspected node-level cause)" if cause.suspected else "FLEET EVENT"
                await self.notify(
                    "fleet-event",
                    f"[fleetmend] {what} {where}: {len(cause.nodes)} nodes lost "
                    f"({', '.join(cause.nodes)}); pools hit: {', '.join(cause.pools)}. Each pool's incident "
                    "recovers its replicas; every node is fenced once.",
                )
            return self.finish(Phase.DONE)
        except Aborted:
            return self.finish(Phase.ABORTED)
