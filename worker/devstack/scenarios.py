"""The incidents ``fleetmend demo`` can stage, and what "passed" means for each.

A scenario names the simulated fleet it loads (a shipped sim scenario with its
slow parts shortened, see ``worker.devstack.rig.compressed_scenario``), the user load,
how the fault is caused, which alert a monitoring stack would raise for it, and
the verdict rule applied to the procedure's final status. The demo itself
(``worker.devstack.demo``) is the same for every scenario.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.incident import PoolRef
from fleet.recovery import Phase, ProcedureStatus
from fleet.vocabulary import FaultKind

# What fleetmend is told one replica group serves in the compressed scenarios (~400 tokens/s per
# replica; tests/recovery/helpers.py measures about this figure). By the world's own accounting
# (the grade's: 400 tokens/s over ~21.3 tokens of work per request of the default load) a group
# serves 18.8 requests/s, so a load share of this figure is ~80 % of that share of the world's
# capacity (bench.incident_stages.world_group_capacity_rps, --load-of-world).
GROUP_CAPACITY_RPS = 15.0
LOAD_SHARE = 0.7  # the "load at ~70 % of capacity"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


# What each fault the demo stages takes out of service, by the sim's own semantics: a lost node takes
# every pod on it, a lost rank / an OOM kill / a wedged engine take their pod; a slow replica takes
# nothing (it still serves). A replica group that loses any pod is lost whole (DESIGN.md §3: the unit is
# the group), see ``lost_group_pods``.
_TAKES: dict[FaultKind | None, Literal["node", "pod", "nothing"]] = {
    FaultKind.NODE_LOST: "node",
    FaultKind.RANK_LOST: "pod",
    FaultKind.POD_OOMKILLED: "pod",
    FaultKind.WEDGED_ENGINE: "pod",
    FaultKind.SLOW_REPLICA: "nothing",
    FaultKind.SLOW_METRICS: "nothing",
    None: "nothing",  # the sim's own rollout (bad-rollout): its new pods crash before serving a token
}


@dataclass(frozen=True)
class PodPlace:
    """Where a pod ran before the fault: its node, its replica group, its identity (uid)."""

    name: str
    uid: str
    node: str | None
    group: str


@dataclass(frozen=True)
class Fault:
    """What goes wrong. ``target`` may name a pod chooser: ``pod:serving``, ``pod:rank``, ``pod:r2``."""

    kind: FaultKind | None
    target: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in _TAKES:
            raise ValueError(f"the demo does not know what a {self.kind} fault takes out of service")

    def takes(self, before: dict[str, PodPlace], pod: str | None) -> set[str]:
        """The pods this fault itself kills, given the pods before it (``pod``: the chosen target pod)."""
        what = _TAKES[self.kind]
        if what == "node":
            return {p.name for p in before.values() if p.node == self.target}
        if what == "pod":
            return {pod} if pod else set()
        return set()


def lost_group_pods(fault: Fault, before: dict[str, PodPlace], pod: str | None) -> set[str]:
    """Every pod of every replica group the fault took: one dead rank loses its whole group's streams."""
    groups = {before[p].group for p in fault.takes(before, pod) if p in before}
    return {p.name for p in before.values() if p.group in groups}


@dataclass(frozen=True)
class AlertToSend:
    """The Alertmanager alert for the fault: an example from ``worker.webhook.examples`` + labels.

    ``rule_fires`` says whether a shipped Prometheus rule raises it from the sim's
    series; when it does not (or Prometheus is not installed) the demo posts it.
    """

    example: str
    labels: dict[str, str]
    rule_fires: bool = True


def _incident_done(status: ProcedureStatus) -> Verdict:
    checks = status.verification.checks if status.verification else []
    failed = [c.name for c in checks if not c.passed]
    if status.phase == Phase.DONE and status.verification is not None and status.verification.passed:
        return Verdict(True, f"recovered and verified ({len(checks)} checks passed)")
    return Verdict(False, f"phase {status.phase.value}; failed checks: {failed or 'no verification'}")


def _fragmentation_reported(status: ProcedureStatus) -> Verdict:
    if status.figures.get("fragmentation") and status.awaiting:
        return Verdict(True, f"fragmentation reported: {status.figures['fragmentation']}")
    return Verdict(False, f"phase {status.phase.value}; no fragmentation report (awaiting={status.awaiting})")


def _not_a_loss(status: ProcedureStatus) -> Verdict:
    if status.phase == Phase.NOT_A_LOSS:
        return Verdict(True, "classified slow-but-present: nothing derouted, deleted or replaced")
    return Verdict(False, f"phase {status.phase.value}; expected not-a-loss")


def _bad_rollout(status: ProcedureStatus) -> Verdict:
    if status.phase == Phase.BAD_ROLLOUT or (
        status.phase == Phase.DONE and any("rollout" in d.summary for d in status.decisions)
    ):
        return Verdict(True, "sent to the revert path: the failing revision was not re-placed")
    return Verdict(False, f"phase {status.phase.value}; expected the bad-rollout path")


def _scaled_down(status: ProcedureStatus) -> Verdict:
    cut = status.figures.get("cut_streams")
    if status.phase == Phase.DONE and (status.verification is None or status.verification.passed) and not cut:
        return Verdict(True, f"scaled down to {status.figures.get('serving_after')} replicas, 0 streams cut")
    return Verdict(False, f"phase {status.phase.value}; cut streams {cut}")


@dataclass(frozen=True)
class DemoScenario:
    name: str
    summary: str
    passed_when: str
    sim_scenario: str
    pool: PoolRef
    serving_groups: int  # routed replica groups when the fleet is up
    fault: Fault
    alert: AlertToSend | None
    verdict: Callable[[ProcedureStatus], Verdict]
    kind: Literal["incident", "scale-down"] = "incident"
    load: dict[str, Any] = field(default_factory=dict)
    compressed: bool = True
    # The procedure stops here waiting for an operator; the demo reads its verdict then.
    stops_awaiting_operator: bool = False
    # Mutations fleetmend may make: False = the verdict also requires none in the world's log.
    mutates: bool = True
    load_share: float = LOAD_SHARE  # arrivals as a share of the serving groups' capacity
    # Agentic users (sim.serving.agents.AgentSpec without its endpoints): their tool calls go through the
    # demo stack's effect API, and the report grades them by the simulated Jira's own log.
    agents: dict[str, Any] | None = None
    # Seconds a (re)started engine's prefix cache takes to warm in the compressed world (None: the
    # demo's default): long enough and a replacement is still cold when the ramp starts.
    warm_up_s: float | None = None
    # The verdict fails when the world's grade finds more than this share of arrivals refused that its
    # capacity could have served (None: reported, not judged; README "Graded by the world").
    over_shed_limit: float | None = None

    @property
    def load_rate(self) -> float:
        return round(self.serving_groups * GROUP_CAPACITY_RPS * self.load_share, 1)


LLAMA = PoolRef(namespace="inference", service="llama")
NODE_DOWN = AlertToSend("node-not-ready", {"node": "gpu-node-0"})

SCENARIOS: dict[str, DemoScenario] = {
    s.name: s
    for s in (
        DemoScenario(
            name="gpu-node-loss",
            summary="A GPU node of a loaded 4-node pool dies: two TP=4 replicas go with it; one warm spare.",
            passed_when="recovery done and its verification passed",
            sim_scenario="gpu-node-loss",
            pool=LLAMA,
            serving_groups=5,
            fault=Fault(FaultKind.NODE_LOST, "gpu-node-0"),
            alert=NODE_DOWN,
            verdict=_incident_done,
        ),
        DemoScenario(
            name="gpu-node-loss-peak",
            summary="The GPU node loss at ~90 % load; most users are agents whose completions open Jira "
            "tickets mid-stream, and retry cut streams with the same key.",
            passed_when="recovery done and verified, and Jira's own log shows no ticket opened twice",
            sim_scenario="gpu-node-loss",
            pool=LLAMA,
            serving_groups=5,
            fault=Fault(FaultKind.NODE_LOST, "gpu-node-0"),
            alert=NODE_DOWN,
            verdict=_incident_done,
            load_share=0.9,
            # Short completions (the demo's 8-32 tokens) call their first tool at token 2, so a stream the
            # node loss cut has almost always run one, and its retry re-proposes it.
            agents={"share": 0.8, "tool_calls": [1, 3], "client_retries": 1, "first_tool_token": 2},
            # The replacement is still warming when the ramp starts: the ramp weights it by its measured
            # rate (below 1.0) instead of an equal share. (On a busy CI machine the ramp once started 60 s
            # after the fault, past this warm-up, and every weight read 1.0; 60 s of warm-up pushed the
            # demo past its test's 240 s there. Open: see the closing note of 2026-12-07.)
            warm_up_s=30.0,
            over_shed_limit=0.01,
        ),
        DemoScenario(
            name="rank-lost",
            summary="One rank of a 2-pod TP=8xPP=2 replica group (LeaderWorkerSet) dies and takes its group.",
            passed_when="recovery done and its verification passed",
            sim_scenario="rank-lost",
            pool=PoolRef(namespace="inference", service="llama-405b"),
            serving_groups=2,
            fault=Fault(FaultKind.RANK_LOST, "pod:rank"),
            alert=AlertToSend("rank-lost", {"namespace": "inference", "pod": "{pod}"}),
            verdict=_incident_done,
        ),
        DemoScenario(
            name="no-warm-spare",
            summary="The GPU node loss in a pool with no warm spare: replacements start cold, lead time announced.",
            passed_when="recovery done and its verification passed (lead time announced)",
            sim_scenario="no-warm-spare",
            pool=LLAMA,
            serving_groups=6,
            fault=Fault(FaultKind.NODE_LOST, "gpu-node-0"),
            alert=NODE_DOWN,
            verdict=_incident_done,
        ),
        DemoScenario(
            name="fragmented",
            summary="A node is lost; 12 GPUs are free in total but no node has the 4 a replacement needs.",
            passed_when="fragmentation reported: the procedure waits for an operator instead of placing",
            sim_scenario="fragmented",
            pool=LLAMA,
            serving_groups=4,
            fault=Fault(FaultKind.NODE_LOST, "gpu-node-0"),
            alert=NODE_DOWN,
            verdict=_fragmentation_reported,
            stops_awaiting_operator=True,
        ),
        DemoScenario(
            name="slow-replica",
            summary="A page arrives for a replica that is merely slow (0.3x): not a loss, nothing is touched.",
            passed_when="classified not-a-loss and no mutating request in the world's action log",
            sim_scenario="gpu-node-loss",
            pool=LLAMA,
            serving_groups=5,
            fault=Fault(FaultKind.SLOW_REPLICA, "pod:serving", {"factor": 0.3}),
            alert=AlertToSend("unroutable", {"namespace": "inference", "pod": "{pod}"}, rule_fires=False),
            verdict=_not_a_loss,
            load={"rate": 30},  # a slow replica under moderate load (tests/recovery use the same)
            mutates=False,
        ),
        DemoScenario(
            name="bad-rollout",
            summary="A new revision crashes on start during a rolling update: revert, do not replace.",
            passed_when="the procedure takes the bad-rollout (revert) path",
            sim_scenario="bad-rollout",
            pool=LLAMA,
            serving_groups=5,
            fault=Fault(None, "pod:r2"),  # the sim's own rollout is the fault
            alert=AlertToSend("crashloop", {"namespace": "inference", "pod": "{pod}", "container": "vllm"}),
            verdict=_bad_rollout,
        ),
        DemoScenario(
            name="scale-down",
            summary="Planned scale-down 8 -> 6 under streaming load: drain first, then delete; no stream cut.",
            passed_when="scale-down done, verified, 0 streams cut",
            sim_scenario="scale-down",
            pool=LLAMA,
            serving_groups=8,
            fault=Fault(None),
            alert=None,
            verdict=_scaled_down,
            kind="scale-down",
            load={"rate": 16, "tiers": {"standard": 1.0}, "output_tokens": [100, 300]},
            compressed=False,
        ),
    )
}
DEFAULT_SCENARIO = "gpu-node-loss"
