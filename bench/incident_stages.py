"""The incident SLA table: per fault class, how long each stage of the runbook takes from the fault,
and what the users got (goodput) with fleetmend, with only Kubernetes acting, and with no fault.

    .venv/bin/python -m bench.incident_stages [--rounds 3] [--classes gpu-node-lost,rank-lost,gpu-xid,engine-crash]
                                              [--load-share 0.7] [--plot docs/incident-stages.png] [--json out.json]

Every run serves a fresh compressed world (``worker.devstack.rig.compressed_scenario``: the sim at
real speed, start-up 4 s, cache warm-up 8 s, node-monitor grace 5 s, taint-eviction tolerations
20 s, so Kubernetes' own recovery also fits in a run) under open-loop load at 70 % of the pool's
capacity (``--load-share``: at 90 % the lost replica's share is more than the survivors' headroom),
started once every routed replica is warm (Ready for the world's warm-up), then kills the fault
class's target. Three modes, same world, same seeded arrivals:

* **fleetmend** — a real worker and fleetmend's fast path (Lease, informers, engine ``/health``)
  opening the incident; Temporal dev server and Postgres for real. Stages, from the fault:
  out of the gateway's rotation (the routing set stops naming a lost pod), incident opened
  (``FleetIncident`` start), survivors protected (the recovery's ``protecting-survivors`` phase
  starts), failed node cordoned (``spec.unschedulable``, node faults only), capacity restored
  (the warm spare promoted: end of ``promoting``; with no spare promoted, the routing set back to
  its size, whatever brought it back), warm floor restored (end of
  ``rebuilding-warm-floor``), verified (end of ``verifying``).
* **kubernetes-only** — no fleetmend at all: readiness probes, the node controller's grace and
  taint eviction, the ReplicaSet / LeaderWorkerSet controllers and the scheduler. Stages: out of
  rotation, and capacity restored (the routing set back to its size before the fault).
* **no-fault** — the same load on the same world with nothing killed: the goodput reference.

The world itself can be varied: ``--engine-max-seqs`` (vLLM's ``--max-num-seqs``), ``--engine-priority
tier|deadline`` (vLLM's ``--scheduling-policy priority``, each request's priority its tier or its
deadline), ``--give-up-at-deadline`` (clients time out at their deadline; the engine aborts the request).

Goodput = requests completed within their deadline, over the whole run's arrivals, as a ratio of
the no-fault run's. The times are wall seconds on this machine, which runs the simulator, the
worker, Temporal and Postgres on 2 cores: they are upper bounds of fleetmend's own work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import Client, WorkflowHandle

from fleet.gateway import Outcome
from fleet.incident import PoolRef, incident_workflow_id
from fleet.recovery import TERMINAL_PHASES, Phase, ProcedureStatus, ServingObjectives
from fleet.shedding import ShedLevel, account_shedding
from fleet.vocabulary import LWS_GROUP_INDEX_LABEL, LWS_WORKER_INDEX_LABEL, FaultKind, Tier
from ledger.migrate import upgrade_head
from ledger.scratch import acquire_server
from sim.serving.layer import warm_group_capacity_rps
from sim.serving.loadgen import LoadSpec
from worker.devstack.demo import DEMO_TIMINGS
from worker.devstack.rig import FleetRig, compressed_scenario, fleet_rig
from worker.devstack.scenarios import GROUP_CAPACITY_RPS, LOAD_SHARE
from worker.devstack.temporal_dev import throwaway_dev_server

LOAD_S = 60.0  # arrivals per run; the fault lands FAULT_AT_S into them
FAULT_AT_S = 8.0
PROCEDURE_TIMEOUT_S = 150.0
MODES = ("fleetmend", "kubernetes-only", "no-fault")
FLEETMEND_STAGES = (
    "out of rotation",
    "incident opened",
    "survivors protected",
    "node cordoned",
    "capacity restored",
    "warm floor restored",
    "verified",
)
FAST_PATH = {
    "fastpath_lease_namespace": "fleetmend",
    "fastpath_health_timeout_s": 3.0,  # the 2-core machine's /health can be slow under load
    "fastpath_lease_duration_s": 3.0,
    "fastpath_renew_deadline_s": 2.0,
    "fastpath_retry_period_s": 0.5,
    "fastpath_watch_timeout_s": 10,
}


@dataclass(frozen=True)
class FaultClass:
    scenario: str
    pool: PoolRef
    groups: int  # routed replica groups when the pool is up
    kind: FaultKind
    target: str  # a node, "node:serving-gpu" (the GPU a serving pod holds), or "pod:serving" / "pod:rank"
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def node_fault(self) -> bool:
        return not self.target.startswith("pod:")


LLAMA = PoolRef(namespace="inference", service="llama")
CLASSES: dict[str, FaultClass] = {
    "gpu-node-lost": FaultClass("gpu-node-loss", LLAMA, 5, FaultKind.NODE_LOST, "gpu-node-0"),
    "rank-lost": FaultClass(
        "rank-lost", PoolRef(namespace="inference", service="llama-405b"), 2, FaultKind.RANK_LOST, "pod:rank"
    ),
    "engine-crash": FaultClass("gpu-node-loss", LLAMA, 5, FaultKind.POD_OOMKILLED, "pod:serving"),
    # An Xid 79 on the GPU a serving pod holds, with the engine kept alive (vLLM's
    # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): the pod stays Running and its node Ready; /health answers 503.
    "gpu-xid": FaultClass(
        "gpu-node-loss", LLAMA, 5, FaultKind.GPU_XID, "node:serving-gpu", {"code": 79, "keep_alive": True}
    ),
}


@dataclass
class RunResult:
    mode: str
    stages: dict[str, float | None]
    goodput: int
    sent: int
    final_phase: str | None = None
    shed: int = 0
    # fleetmend runs: its own estimate of the capacity gap as a share of all arrivals, from the shed
    # levels the incident recorded (fleet.shedding.account_shedding). Context only: nothing is graded on it.
    gap_share: float | None = None
    over_shed_share: float | None = None  # fleetmend's estimate of its own over-shed (not graded on)
    # The world's grade of the run (GET /sim/v1/load/{id}/grade, sim.serving.grade.LoadGrade): the
    # optimum replayed on the world's true capacity, and the over-shed against it.
    world: dict[str, Any] | None = None
    seed: int | None = None  # the arrivals' seed: runs of one seed are the same load, fault and world
    # The users' clients retry an answer refused before its stream this many times (LoadSpec.client_retries,
    # as the OpenAI SDKs do: 2 by default); None: runs recorded before the bench had the option (0).
    client_retries: int | None = None
    # What the requests that missed goodput got instead (the load generator's counts).
    missed: dict[str, int] = field(default_factory=dict)
    # Per WINDOW_S of arrivals, from the fault on (the first window opens FAULT_AT_S before it): what
    # the users got, by the load generator's record. When refusals fall against when capacity returned.
    timeline: list[dict[str, float]] = field(default_factory=list)


# With --engine-priority: the engines run vLLM's --scheduling-policy priority and each user sends its
# tier as the request's priority (lower first), as a user who runs tiers on vLLM would.
TIER_PRIORITY = {Tier.CRITICAL: 0, Tier.STANDARD: 1, Tier.SHEDDABLE: 2}


WINDOW_S = 5.0  # RunResult.timeline


async def outcome_timeline(rig: FleetRig, load: str, load_s: float) -> list[dict[str, float]]:
    """What the users got per WINDOW_S of arrivals: the window's start (seconds from the fault),
    arrivals, goodput, late, shed (refused in the end, after the client's retries), and those served on a
    client's retry of a refusal."""
    rows: list[dict[str, float]] = []
    start = 0.0
    while start < load_s:
        report = await rig.load_report(load, since_s=start, until_s=start + WINDOW_S)
        rows.append(
            {
                "from_fault_s": start - FAULT_AT_S,
                "arrivals": report["finished"],  # the run is over: every arrival of the window finished
                **{k: report.get(k, 0) for k in ("goodput", "late", "shed", "served_after_refusal")},
            }
        )
        start += WINDOW_S
    return rows


# The bench's worlds start a replica in 4 s and warm its prefix cache over 8 s (compressed_scenario).
WARM_UP_S = 8.0


def world(fault: FaultClass, engine_priority: str | None = None, engine_max_seqs: int | None = None) -> Any:
    scenario = compressed_scenario(fault.scenario, startup_s=4.0, warm_up_s=WARM_UP_S)
    load = dict(scenario.load or {})
    engine = dict(load.get("engine") or {})
    if engine_priority:
        engine["scheduling_policy"] = "priority"
    if engine_max_seqs is not None:
        engine["max_num_seqs"] = engine_max_seqs
    load["engine"] = engine
    return scenario.model_copy(
        update={
            "load": load,
            "timings": scenario.timings.model_copy(
                update={
                    "node_monitor_grace_s": 5.0,
                    "unreachable_toleration_s": 20,
                    "not_ready_toleration_s": 20,
                }
            ),
        }
    )


def world_group_capacity_rps(fault: FaultClass) -> float:
    """Requests/s one warm replica group of the fault's world really serves: its engine's decode budget
    over the mean work of one request of the bench's load (``LoadSpec``'s lengths: the output after the
    first token, plus the prefill of the prompt share a warm prefix cache misses), counted by the same
    ``EngineSpec.request_work`` the world's grade uses. ``GROUP_CAPACITY_RPS`` (15), what fleetmend is told, is
    about 20 % below it: a load share of that figure is a smaller share of the world's."""
    return warm_group_capacity_rps(world(fault), LoadSpec(rate=1.0))


@functools.cache
def _core(kubeconfig: str) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(k8s_config.new_client_from_config(config_file=kubeconfig, context="sim"))


def _as_dict(obj: Any) -> dict[str, Any]:
    return dict(k8s.ApiClient().sanitize_for_serialization(obj))


def priority_options(engine_priority: str | None) -> dict[str, Any]:
    """The users' load options for ``--engine-priority``: each request's tier, or its deadline, as its
    vLLM priority; none when the engines serve first come, first served."""
    if engine_priority == "deadline":
        return {"deadline_priority": True}
    return {"tier_priority": TIER_PRIORITY} if engine_priority else {}


def _pods(rig: FleetRig, namespace: str) -> list[dict[str, Any]]:
    return list(_as_dict(_core(str(rig.settings.kubeconfig)).list_namespaced_pod(namespace))["items"])


async def pool_warm(rig: FleetRig, fault: FaultClass) -> bool:
    """Every replica group routed, and each routed pod Ready for the world's warm-up time (its Ready
    condition's ``lastTransitionTime``, to the second, on the world's clock: an engine warms its prefix
    cache from when it starts serving): the load a share of the world's warm capacity is set against
    then meets that capacity, not a fleet still warming."""
    routed = set(await rig.routing_set(fault.pool))
    if len(routed) < fault.groups:
        return False
    now = await rig.sim_now()
    for pod in await asyncio.to_thread(_pods, rig, fault.pool.namespace):
        if pod["metadata"]["name"] not in routed:
            continue
        ready = [
            datetime.fromisoformat(str(c["lastTransitionTime"])).timestamp()
            for c in pod["status"].get("conditions") or []
            if c.get("type") == "Ready" and c.get("status") == "True" and c.get("lastTransitionTime")
        ]
        if not ready or now - max(ready) < WARM_UP_S + 1.0:  # + the second the stamp rounds off
            return False
    return True


def _unschedulable(rig: FleetRig, node: str) -> bool:
    return bool(
        (_as_dict(_core(str(rig.settings.kubeconfig)).read_node(node)).get("spec") or {}).get("unschedulable")
    )


def gpu_of(rig: FleetRig, node: str, pod: str) -> int:
    """The GPU ``pod`` holds on ``node``, from the node's dcgm-exporter series (their ``pod`` label)."""
    text = httpx.get(rig.settings.node_telemetry_url_template.format(node=node), timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("pod") == pod and "gpu" in sample.labels:
                return int(sample.labels["gpu"])
    raise RuntimeError(f"no dcgm-exporter series on {node} names pod {pod}")


async def target_and_lost(rig: FleetRig, fault: FaultClass) -> tuple[str, set[str], dict[str, Any]]:
    """The fault's target, every routed pod it takes out (a dead rank takes its whole group), and the
    fault's parameters."""
    routed = set(await rig.routing_set(fault.pool))
    pods = await asyncio.to_thread(_pods, rig, fault.pool.namespace)
    names = {str(p["metadata"]["name"]): p for p in pods}

    def labels(name: str) -> dict[str, str]:
        return dict(names[name]["metadata"].get("labels") or {})

    if fault.target == "node:serving-gpu":
        pod = sorted(routed)[0]
        node = str(names[pod]["spec"]["nodeName"])
        gpu = await asyncio.to_thread(gpu_of, rig, node, pod)
        return node, {pod}, {**fault.params, "gpu": gpu}
    if fault.node_fault:
        on_node = {n for n, p in names.items() if p["spec"].get("nodeName") == fault.target}
        return fault.target, on_node & routed, fault.params
    if fault.target == "pod:serving":
        pod = sorted(routed)[0]
        return f"{fault.pool.namespace}/{pod}", {pod}, fault.params
    rank = sorted(n for n in names if labels(n).get(LWS_WORKER_INDEX_LABEL) == "1")[0]
    group = labels(rank).get(LWS_GROUP_INDEX_LABEL)
    lost = {n for n in names if labels(n).get(LWS_GROUP_INDEX_LABEL) == group}
    return f"{fault.pool.namespace}/{rank}", (lost & routed) or lost, fault.params


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:g} s")
        await asyncio.sleep(0.3)


class Watcher:
    """Polls the world every 0.2 s from the fault on: rotation, routing-set size, cordon."""

    def __init__(
        self, rig: FleetRig, fault: FaultClass, lost: set[str], fault_at: float, node: str | None
    ) -> None:
        self.rig, self.fault, self.lost, self.fault_at, self.node = rig, fault, lost, fault_at, node
        self.out_of_rotation: float | None = None
        self.capacity_back: float | None = None
        self.cordoned: float | None = None
        self._dipped = False

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            now = time.time() - self.fault_at
            routed = set(await self.rig.routing_set(self.fault.pool))
            if self.out_of_rotation is None and not routed & self.lost:
                self.out_of_rotation = now
            if self.out_of_rotation is not None and self.capacity_back is None:
                # Back to the size before the fault: replacements (node faults), or the same pods
                # restarted in place (an engine crash, a LeaderWorkerSet group re-created).
                if len(routed - self.lost) >= self.fault.groups or (
                    self._dipped and len(routed) >= self.fault.groups
                ):
                    self.capacity_back = now
            if len(routed) < self.fault.groups:
                self._dipped = True
            if self.node is not None and self.cordoned is None:
                if await asyncio.to_thread(_unschedulable, self.rig, self.node):
                    self.cordoned = now
            await asyncio.sleep(0.2)


async def recovery_of(client: Client, pool: PoolRef, fault_at: float) -> WorkflowHandle[Any, Any]:
    incident = client.get_workflow_handle(incident_workflow_id(pool))
    deadline = time.monotonic() + 60
    seen = "nothing yet"
    while time.monotonic() < deadline:
        seen = "no incident workflow for the pool"
        try:
            desc = await incident.describe()
            started = desc.start_time.timestamp() - fault_at if desc.start_time is not None else None
            when = "at no recorded time" if started is None else f"{started:+.2f} s from the fault"
            seen = f"the pool's incident started {when}, status {desc.status}"
            if started is not None and started >= -1:
                status = await incident.query("status", result_type=ProcedureStatus)
                seen += f", phase {status.phase.value}, children {status.children}"
                if status.children:
                    return client.get_workflow_handle(status.children[-1])
        except Exception as err:  # not started yet, or no worker answered the query this instant
            seen += f" ({type(err).__name__}: {err})"
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no recovery started within 60 s of the fault; last seen: {seen}")


async def final_status(handle: WorkflowHandle[Any, Any]) -> ProcedureStatus:
    deadline = time.monotonic() + PROCEDURE_TIMEOUT_S
    while True:
        status = await handle.query("status", result_type=ProcedureStatus)
        if status.phase in TERMINAL_PHASES or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.5)


def span_time(status: ProcedureStatus, phase: Phase, edge: str, fault_at: float) -> float | None:
    spans = [p for p in status.phases if p.name == phase]
    if not spans:
        return None
    value = spans[0].start if edge == "start" else spans[-1].end
    return None if value is None else value - fault_at


async def end_every_workflow(client: Client) -> None:
    """Terminate what a run left running on the shared Temporal server (an incident whose node's
    device stays fenced, a fence, a repair watch): each run is its own world, and the next run's
    alert for the same pool or node must not be absorbed by a workflow whose worker is gone. (Three
    of five Xid runs on 2026-12-06 found no recovery within 60 s that way.)"""
    async for execution in client.list_workflows('ExecutionStatus="Running"'):
        with contextlib.suppress(Exception):
            await client.get_workflow_handle(execution.id, run_id=execution.run_id).terminate(
                "bench run over"
            )


async def one_run(
    client: Client,
    database_url: str,
    fault: FaultClass,
    mode: str,
    index: int,
    seed: int,
    load_share: float = LOAD_SHARE,
    load_s: float = LOAD_S,
    client_retries: int = 0,
    load_of_world: bool = False,
    target_utilization: float | None = None,
    queue_wait_budget_s: float | None = None,
    engine_priority: str | None = None,
    engine_max_seqs: int | None = None,
    give_up_at_deadline: bool = False,
) -> RunResult:
    fleetmend = mode == "fleetmend"
    # With the load set against the world's capacity, fleetmend is told that capacity too, as an
    # operator who load-tested a replica would configure it; else the 15 req/s the load is set against.
    per_group = world_group_capacity_rps(fault) if load_of_world else GROUP_CAPACITY_RPS
    extra: dict[str, Any] = (
        {
            "recovery_timings": DEMO_TIMINGS,
            "serving_objectives": ServingObjectives(
                group_capacity_rps=round(per_group, 2),
                **({} if target_utilization is None else {"target_utilization": target_utilization}),
                **({} if queue_wait_budget_s is None else {"queue_wait_budget_s": queue_wait_budget_s}),
                # Engines that serve by deadline are configured so, with the users' deadlines (an
                # operator who set vLLM's --scheduling-policy priority would say so): the queues may
                # then hold the lowest tier up to its deadline (ServingObjectives.wait_budget_s).
                **(
                    {"engine_queue_order": "deadline", "tier_deadlines_s": LoadSpec(rate=1.0).deadlines_s}
                    if engine_priority == "deadline"
                    else {}
                ),
            ),
            **FAST_PATH,
        }
        if fleetmend
        else {}
    )
    async with fleet_rig(
        client,
        scenario=world(fault, engine_priority, engine_max_seqs),
        database_url=database_url,
        task_queue=f"bench-stages-{index}",
        run_worker=fleetmend,
        **extra,
    ) as rig:
        await until("the pool serving, warm", lambda: pool_warm(rig, fault), 90)
        async with contextlib.AsyncExitStack() as stack:
            fast_path = (
                await stack.enter_async_context(rig.fast_path(identity=f"bench-{index}"))
                if fleetmend
                else None
            )
            rate = round(fault.groups * per_group * load_share, 1)
            load = await rig.start_load(
                rate=rate,
                duration_s=load_s,
                seed=seed,
                pool=fault.pool.key,
                client_retries=client_retries,
                give_up_at_deadline=give_up_at_deadline,
                **priority_options(engine_priority),
            )
            await asyncio.sleep(FAULT_AT_S)
            stages: dict[str, float | None] = {}
            phase: str | None = None
            levels: list[ShedLevel] = []
            lost: set[str] = set()
            if mode != "no-fault":
                target, lost, params = await target_and_lost(rig, fault)
                fault_at = time.time()
                reply = await rig.inject(fault.kind, target, **params)
                if not reply.get("accepted", True):
                    raise RuntimeError(f"the sim refused the fault: {reply}")
                watcher = Watcher(rig, fault, lost, fault_at, target if fault.node_fault else None)
                stop = asyncio.Event()
                watching = asyncio.create_task(watcher.run(stop))
                try:
                    if fleetmend:
                        try:
                            recovery = await recovery_of(client, fault.pool, fault_at)
                        except TimeoutError as err:  # what the fast path saw, to tell why
                            assert fast_path is not None
                            seen = [
                                (d.entity, d.verdict.value, d.reason[:120]) for d in fast_path.detections[-5:]
                            ]
                            raise TimeoutError(
                                f"{err}; fast path counts {dict(fast_path.counts)}, last verdicts {seen}"
                            ) from None
                        desc = await client.get_workflow_handle(incident_workflow_id(fault.pool)).describe()
                        status = await final_status(recovery)
                        phase = status.phase.value
                        levels = [
                            ShedLevel.model_validate(v) for v in status.figures.get("shed_levels") or []
                        ]
                        assert desc.start_time is not None
                        stages = {
                            "incident opened": desc.start_time.timestamp() - fault_at,
                            "survivors protected": span_time(status, Phase.PROTECTING, "start", fault_at),
                            # A promoted spare, else whatever brought the routing set back (a
                            # LeaderWorkerSet re-creating the group, a container restarted in place).
                            "capacity restored": span_time(status, Phase.PROMOTING, "end", fault_at)
                            if status.figures.get("promoted")
                            else None,
                            "warm floor restored": span_time(status, Phase.REBUILDING, "end", fault_at),
                            "verified": span_time(status, Phase.VERIFYING, "end", fault_at),
                        }
                    else:
                        await asyncio.sleep(load_s - FAULT_AT_S)
                finally:
                    stop.set()
                    await watching
                stages["out of rotation"] = watcher.out_of_rotation
                stages["node cordoned"] = watcher.cordoned
                if stages.get("capacity restored") is None:
                    stages["capacity restored"] = watcher.capacity_back
            report = await rig.load_report(load)
            while report["in_flight"] or report["sent"] < int(rate * load_s * 0.9):
                await asyncio.sleep(1.0)
                report = await rig.load_report(load)
            try:
                world_grade: dict[str, Any] | None = await rig.load_grade(load)
            except httpx.HTTPError as err:  # the run is kept, ungraded, and says why
                print(f"the world did not grade the run: {err}")
                world_grade = None
            result = RunResult(
                mode,
                stages,
                int(report["goodput"]),
                int(report["sent"]),
                phase,
                shed=int(report["shed"]),
                seed=seed,
                client_retries=client_retries,
                world=world_grade,
                missed={
                    k: int(report[k])
                    for k in ("late", "terminal_errors", "truncated_streams", "rejected", "shed")
                    if report.get(k)
                },
            )
            result.timeline = await outcome_timeline(rig, load, load_s)
            # Envoy's word on the requests it did not complete: response code and flags (UO overflow,
            # UH no healthy host, UF connect failure, UC/UR cut, URX retries spent...), and whether the
            # replica was one the fault took (a cut on a survivor would be something fleetmend did).
            for entry in await rig.request_outcomes(fault.pool):
                if entry.outcome not in (Outcome.COMPLETED, Outcome.SHED):
                    where = "lost" if entry.replica in lost else "survivor" if entry.replica else "no replica"
                    key = f"envoy {entry.detail.split(' via ')[0]} ({where})"
                    result.missed[key] = result.missed.get(key, 0) + 1
            if fleetmend and levels:
                account = account_shedding(
                    levels, arrivals=result.sent, shed=result.shed, arrival_rps=rate, until=time.time()
                )
                result.gap_share, result.over_shed_share = account.gap_share, account.over_shed_share
            await end_every_workflow(client)
            return result


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def cell(values: list[float | None]) -> str:
    seen = [v for v in values if v is not None]
    if not seen:
        return f"{'-':>17}"
    return f"{statistics.median(seen):8.2f} {quantile(seen, 0.99):8.2f}"


def print_table(name: str, runs: list[RunResult]) -> None:
    by_mode = {m: [r for r in runs if r.mode == m] for m in MODES}
    fm, k8s_only, none = by_mode["fleetmend"], by_mode["kubernetes-only"], by_mode["no-fault"]
    print(
        f"\n{name}: seconds from the fault (p50 p99), {len(fm)} fleetmend / {len(k8s_only)} Kubernetes-only runs"
    )
    print(f"{'stage':24}{'fleetmend':>17}   {'Kubernetes only':>17}")
    for stage in FLEETMEND_STAGES:
        print(
            f"{stage:24}{cell([r.stages.get(stage) for r in fm])}   {cell([r.stages.get(stage) for r in k8s_only])}"
        )
    for mode, chosen in (("fleetmend", fm), ("kubernetes-only", k8s_only), ("no-fault", none)):
        if not chosen:
            continue
        good = statistics.mean(r.goodput for r in chosen)
        sent = statistics.mean(r.sent for r in chosen)
        shed = statistics.mean(r.shed for r in chosen)
        mean, half = interval([share(r) for r in chosen])
        graded = [r.world for r in chosen if r.world]
        world = ""
        if graded:
            of_opt = statistics.mean(g["of_optimum"] for g in graded)
            over = max(g["over_shed_share"] for g in graded)
            world = f"; world: {of_opt:.3f} of the optimum, over-shed at most {over:.2%} of arrivals"
        print(
            f"goodput {mode:17} {good:7.0f} of {sent:.0f} sent, {shed:.0f} shed, share {mean:.4f} ± {half:.4f}{world}"
        )
        kinds = sorted({k for r in chosen for k in r.missed})
        if kinds:
            means = ", ".join(
                f"{k.replace('_', ' ')} {statistics.mean(r.missed.get(k, 0) for r in chosen):.1f}"
                for k in kinds
            )
            print(f"{'':25} missed, mean per run: {means}")
    pairs = paired(runs)
    if pairs:
        diffs = ", ".join(f"{d:+d}" for _, d in pairs)
        ahead = sum(1 for _, d in pairs if d >= 0)
        mean, half = interval([float(d) for _, d in pairs])
        print(
            f"same seed, fleetmend minus Kubernetes-only (requests within deadline): {diffs}; "
            f"mean {mean:+.1f} ± {half:.1f}; fleetmend >= Kubernetes-only on {ahead} of {len(pairs)} seeds"
        )
    for verdict in verdicts(name, runs):
        print(f"  {verdict}")
    phases = sorted({r.final_phase or "?" for r in fm})
    print(f"fleetmend final phases: {', '.join(phases)}")


def share(r: RunResult) -> float:
    """Goodput as a share of what the run sent (seeds differ: other arrivals, other totals)."""
    return r.goodput / r.sent if r.sent else 0.0


# Student's t, two-sided 95 % (0.975 quantile) for 1-30 degrees of freedom: the intervals need 30
# numbers, not scipy.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)  # fmt: skip


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % interval (Student's t; 0 for fewer than two values)."""
    mean = statistics.mean(values) if values else 0.0
    if len(values) < 2:
        return mean, 0.0
    t = T975[min(len(values) - 2, len(T975) - 1)]
    return mean, t * statistics.stdev(values) / len(values) ** 0.5


def verdicts(name: str, runs: list[RunResult]) -> list[str]:
    """The claims, checked on this table's runs: fleetmend against Kubernetes alone (at 90 % load the
    intervals must not overlap; at lower load fleetmend must not be worse beyond the paired interval),
    over-shed graded by the world at most 1 % of arrivals in every run, and no run above the optimum."""
    fm = [r for r in runs if r.mode == "fleetmend"]
    k8 = [r for r in runs if r.mode == "kubernetes-only"]
    out = []
    if len(fm) >= 2 and len(k8) >= 2:
        (fm_mean, fm_half), (k8_mean, k8_half) = (
            interval([share(r) for r in fm]),
            interval([share(r) for r in k8]),
        )
        if "90%" in name:
            ok = fm_mean - fm_half > k8_mean + k8_half
            out.append(
                f"{'PASS' if ok else 'FAIL'} at 90 % load: fleetmend's interval above Kubernetes-only's"
            )
        else:
            diff, half = interval([float(d) for _, d in paired(runs)])
            ok = diff + half >= 0
            out.append(
                f"{'PASS' if ok else 'FAIL'} not worse than Kubernetes-only beyond the paired interval"
            )
    graded = [r for r in fm if r.world]
    if graded:
        worst = max(r.world["over_shed_share"] for r in graded if r.world)
        out.append(
            f"{'PASS' if worst <= 0.01 else 'FAIL'} over-shed graded by the world <= 1 % (worst {worst:.2%})"
        )
    if not any(r.world for r in runs):
        return out  # runs from before the world graded them
    beaten = [f"{r.mode} seed {r.seed}" for r in runs if r.world and r.world["bound_beaten"]]
    out.append(
        f"{'FAIL' if beaten else 'PASS'} no run above the world's optimum{': ' + ', '.join(beaten) if beaten else ''}"
    )
    return out


def markdown(results: dict[str, list[RunResult]]) -> str:
    """The README's goodput table, one row per fault class and load, from the runs the world graded
    (tables of runs from before the grade are left out)."""
    lines = [
        "| fault, load | runs (seeds) | fleetmend goodput | Kubernetes only | fleetmend minus Kubernetes only, same seed | fleetmend of the world's optimum | over-shed, worst run (world) | claims |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        fm = [r for r in runs if r.mode == "fleetmend"]
        k8 = [r for r in runs if r.mode == "kubernetes-only"]
        if not fm or not k8 or not any(r.world for r in runs):
            continue
        (a, ah), (b, bh) = interval([share(r) for r in fm]), interval([share(r) for r in k8])
        d, dh = interval([float(x) for _, x in paired(runs)])
        graded = [r.world for r in fm if r.world]
        of_opt = f"{statistics.mean(g['of_optimum'] for g in graded):.3f}" if graded else "-"
        over = f"{max(g['over_shed_share'] for g in graded):.2%}" if graded else "-"
        seeds = sorted({r.seed for r in fm if r.seed is not None})
        claims = "; ".join(v for v in verdicts(name, runs))
        lines.append(
            f"| {name} | {len(fm)} ({', '.join(map(str, seeds))}) | {a:.4f} ± {ah:.4f} | {b:.4f} ± {bh:.4f} "
            f"| {d:+.1f} ± {dh:.1f} | {of_opt} | {over} | {claims} |"
        )
    return "\n".join(lines)


def paired(runs: list[RunResult]) -> list[tuple[int, int]]:
    """Per seed that has both: (seed, fleetmend's goodput minus Kubernetes-only's), the comparison on
    the very same arrivals (runs without a recorded seed are left out)."""
    first: dict[tuple[str, int], RunResult] = {}
    for r in runs:
        if r.seed is not None:
            first.setdefault((r.mode, r.seed), r)
    seeds = sorted({seed for mode, seed in first if mode == "fleetmend"})
    return [
        (seed, first["fleetmend", seed].goodput - first["kubernetes-only", seed].goodput)
        for seed in seeds
        if ("kubernetes-only", seed) in first
    ]


def plot(results: dict[str, list[RunResult]], path: Path) -> None:
    """Stage timeline per fault class: one row per stage, the median second from the fault it was
    reached, fleetmend's runs beside Kubernetes-only (a stage Kubernetes has no such step for is
    left out of its row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(FLEETMEND_STAGES)
    fig, axes = plt.subplots(len(results), 1, figsize=(8, 2.6 * len(results)), squeeze=False)
    for ax, (name, runs) in zip(axes[:, 0], results.items(), strict=True):
        for mode, marker, offset in (("fleetmend", "o", -0.15), ("kubernetes-only", "x", 0.15)):
            chosen = [r for r in runs if r.mode == mode]
            for row, stage in enumerate(stages):
                seen = [v for r in chosen if (v := r.stages.get(stage)) is not None]
                if not seen:
                    continue
                t = statistics.median(seen)
                color = "tab:blue" if mode == "fleetmend" else "tab:red"
                ax.plot([0, t], [row + offset] * 2, color=color, alpha=0.35, linewidth=3)
                ax.plot([t], [row + offset], marker, color=color, label=mode if row == 0 else None)
                ax.annotate(
                    f"{t:.1f}", (t, row + offset), textcoords="offset points", xytext=(5, -3), fontsize=7
                )
        ax.set_yticks(range(len(stages)), stages, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name} (median over the runs)", fontsize=9, loc="left")
        ax.set_xlabel("seconds from the fault", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(unique.values(), unique.keys(), fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


async def main(
    rounds: int,
    classes: list[str],
    plot_path: Path | None,
    json_path: Path | None,
    load_share: float = LOAD_SHARE,
    modes: tuple[str, ...] = MODES,
    load_s: float = LOAD_S,
    client_retries: int = 0,
    load_of_world: bool = False,
    target_utilization: float | None = None,
    queue_wait_budget_s: float | None = None,
    engine_priority: str | None = None,
    engine_max_seqs: int | None = None,
    give_up_at_deadline: bool = False,
) -> int:
    pg = acquire_server()
    env = await throwaway_dev_server()
    results: dict[str, list[RunResult]] = {}
    index = 0
    async with env, contextlib.AsyncExitStack() as cleanup:
        cleanup.callback(pg.stop)  # an embedded Postgres would outlive the bench otherwise
        for fault_class in classes:
            fault = CLASSES[fault_class]
            # A load other than the default is its own table (and its own key in --json).
            name = fault_class if load_share == LOAD_SHARE else f"{fault_class} at {load_share:.0%} load"
            if load_of_world:
                name = f"{fault_class} at {load_share:.0%} of the world's capacity, {load_s:g} s of load"
            if client_retries:
                name += f", clients retry {client_retries}x"
            if target_utilization is not None:
                name += f", fleetmend plans {target_utilization:.0%} utilization"
            if queue_wait_budget_s is not None:
                name += f", queue wait budget {queue_wait_budget_s:g} s"
            if engine_priority == "deadline":
                name += ", engines schedule by deadline (and fleetmend is told so)"
            elif engine_priority:
                name += ", engines schedule by tier priority"
            if engine_max_seqs is not None:
                name += f", engines batch at most {engine_max_seqs} sequences"
            if give_up_at_deadline:
                name += ", clients give up at their deadline"
            runs = results.setdefault(name, [])
            # Every round runs the modes on the same seed, so each fleetmend run is compared with
            # Kubernetes alone (and no fault) on the very same arrivals.
            plan = [(mode, r) for r in range(rounds) for mode in modes]
            for mode, r in plan:
                url = pg.create_database("stages")
                upgrade_head(url)
                index += 1
                try:
                    result = await one_run(
                        env.client,
                        url,
                        fault,
                        mode,
                        index,
                        seed=11 + r,
                        load_share=load_share,
                        load_s=load_s,
                        client_retries=client_retries,
                        load_of_world=load_of_world,
                        target_utilization=target_utilization,
                        queue_wait_budget_s=queue_wait_budget_s,
                        engine_priority=engine_priority,
                        engine_max_seqs=engine_max_seqs,
                        give_up_at_deadline=give_up_at_deadline,
                    )
                except Exception as err:  # one broken run is reported, the table goes on without it
                    print(f"{name} {mode} #{r + 1}: FAILED: {type(err).__name__}: {err}")
                    continue
                finally:
                    pg.drop_database(url)
                runs.append(result)
                shown = {k: round(v, 2) for k, v in result.stages.items() if v is not None}
                world = result.world or {}
                print(
                    f"{name} {mode} #{r + 1}: {shown} goodput {result.goodput}/{result.sent} "
                    f"(world's optimum {world.get('optimum')}, over-shed {world.get('over_shed')}) "
                    f"{result.final_phase or ''}",
                    flush=True,
                )
                if json_path is not None:  # after every run: a long bench that is stopped keeps its runs
                    json_path.write_text(
                        json.dumps({n: [r.__dict__ for r in rs] for n, rs in results.items()}, indent=2)
                    )
    return report(results, plot_path)


def report(results: dict[str, list[RunResult]], plot_path: Path | None) -> int:
    """Print the tables and the README's markdown; 1 when a run beat the world's optimum (a bug)."""
    for name, runs in results.items():
        print_table(name, runs)
    print("\n" + markdown(results))
    if plot_path is not None:
        plot(results, plot_path)
        print(f"\nplot written to {plot_path}")
    beaten = [r for runs in results.values() for r in runs if r.world and r.world["bound_beaten"]]
    if beaten:
        print(f"\nBUG: {len(beaten)} run(s) completed more requests than the world's optimum allows")
    return 1 if beaten else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds (seeds 11, 12, ...) per fault class; each runs every mode on one seed",
    )
    parser.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated: {', '.join(CLASSES)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument(
        "--load-seconds", type=float, default=LOAD_S, help=f"seconds of arrivals per run (default {LOAD_S:g})"
    )
    parser.add_argument(
        "--load-share",
        type=float,
        default=LOAD_SHARE,
        help=f"open-loop load as a share of the pool's capacity before the fault (default {LOAD_SHARE})",
    )
    parser.add_argument(
        "--client-retries",
        type=int,
        default=0,
        help="the users' clients retry a refusal (429, 5xx before the stream) this many times after its "
        "Retry-After, as the OpenAI SDKs do (their default: 2); default 0",
    )
    parser.add_argument(
        "--load-of-world",
        action="store_true",
        help="--load-share is a share of the world's true capacity (world_group_capacity_rps) instead of "
        f"the {GROUP_CAPACITY_RPS:g} req/s per group fleetmend is told",
    )
    parser.add_argument(
        "--target-utilization",
        type=float,
        default=None,
        help="fleetmend's ServingObjectives.target_utilization: the share of the routed capacity it admits "
        "during a gap (default: the objectives' default)",
    )
    parser.add_argument(
        "--queue-wait-budget",
        type=float,
        default=None,
        help="fleetmend's ServingObjectives.queue_wait_budget_s: how long a request may wait in a survivor's "
        "queue during a gap (default: the TTFT objective, 2 s, or with --engine-priority deadline the longest "
        "of the users' deadlines, 5/10/20 s)",
    )
    parser.add_argument(
        "--engine-priority",
        nargs="?",
        const="tier",
        choices=["tier", "deadline"],
        default=None,
        help="the engines run vLLM's --scheduling-policy priority and users send as the request's "
        "priority their tier (tier, the default: critical 0, standard 1, sheddable 2) or their deadline "
        "in milliseconds (deadline: the engines serve earliest deadline first, and fleetmend is told so: "
        "ServingObjectives.engine_queue_order); every mode runs in that world",
    )
    parser.add_argument(
        "--engine-max-seqs",
        type=int,
        default=None,
        help="vLLM's --max-num-seqs for every engine (the scenario's own, 256 for a lost rank, by default): "
        "a batch this size saturates the decode budget and further requests wait in the engine's queue, "
        "where --engine-priority orders them",
    )
    parser.add_argument(
        "--give-up-at-deadline",
        action="store_true",
        help="users' clients time out at their request's deadline and close the connection, which "
        "aborts the request in the engine (LoadSpec.give_up_at_deadline); every mode runs with them",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write the stage timeline (PNG) here")
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="print the tables (and --plot) from saved runs instead of running",
    )
    args = parser.parse_args()
    if args.from_json:
        saved: dict[str, list[RunResult]] = {}
        for path in args.from_json:
            for name, runs in json.loads(path.read_text()).items():
                saved.setdefault(name, []).extend(RunResult(**r) for r in runs)
        raise SystemExit(report(saved, args.plot))
    unknown = [c for c in args.classes.split(",") if c not in CLASSES]
    if unknown:
        parser.error(f"unknown fault class(es) {unknown}; choose from {sorted(CLASSES)}")
    modes = tuple(args.modes.split(","))
    if not set(modes) <= set(MODES) or not modes:
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if not 0 < args.load_share <= 1.5:
        parser.error(f"--load-share {args.load_share} is not a share of capacity; give a number in (0, 1.5]")
    if not FAULT_AT_S + 10 <= args.load_seconds <= 600:
        parser.error(
            f"--load-seconds {args.load_seconds}: give {FAULT_AT_S + 10:g}-600 (the fault lands at {FAULT_AT_S:g} s)"
        )
    if args.target_utilization is not None and not 0 < args.target_utilization <= 1:
        parser.error(f"--target-utilization {args.target_utilization}: give a share in (0, 1]")
    if args.engine_max_seqs is not None and not 1 <= args.engine_max_seqs <= 4096:
        parser.error(f"--engine-max-seqs {args.engine_max_seqs}: give a batch size in [1, 4096]")
    if args.queue_wait_budget is not None and not 0 <= args.queue_wait_budget <= 600:
        parser.error(f"--queue-wait-budget {args.queue_wait_budget}: give seconds in [0, 600]")
    code = asyncio.run(
        main(
            args.rounds,
            args.classes.split(","),
            args.plot,
            args.json,
            args.load_share,
            modes,
            args.load_seconds,
            args.client_retries,
            args.load_of_world,
            args.target_utilization,
            args.queue_wait_budget,
            args.engine_priority,
            args.engine_max_seqs,
            args.give_up_at_deadline,
        )
    )
    raise SystemExit(code)
