"""The fast path's Kubernetes side against the simulated API server, through the official client:
an informer whose watch falls behind (410 Gone) re-lists and still sees the loss, and the Lease
election (one holder; a standby takes over once the holder stops renewing; a race has one winner)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, config

from fleet.detection import Evidence, EvidenceKind, observe
from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL, MODEL_LABEL, ROUTER_LABEL
from kube.informer import Informer
from kube.lease import LeaderElector
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from worker.config import load_settings
from worker.devstack.sim_wiring import settings_for_running_sim
from worker.fastpath.service import FastPath
from worker.intake.topology import PoolTopology

NS = "inference"


@pytest.fixture
def short_history() -> Iterator[RunningSim]:
    """A sim whose watch history keeps only 20 events per resource (so a watch can fall behind)."""
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0, serving=False, watch_history=20)
    try:
        yield running
    finally:
        running.stop()


def _core(sim: RunningSim) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(sim.kubeconfig), context="sim"))


async def _no_delivery(reports: list[Any]) -> list[Any]:
    raise AssertionError(f"nothing is delivered in this test: {reports}")


def _detector(sim: RunningSim) -> FastPath:
    """A fast path against ``sim`` whose evidence stays in its queue (nothing delivered, no lookup)."""
    fast = FastPath(load_settings(**settings_for_running_sim(sim)), _no_delivery, topology=None)  # type: ignore[arg-type]
    fast._loop, fast._queue = asyncio.get_running_loop(), asyncio.Queue()
    return fast


@contextlib.contextmanager
def _watching(fast: FastPath, *informers: Informer) -> Iterator[None]:
    """Run ``informers`` (feeding ``fast``'s handlers) on their own threads, as the fast path does."""
    fast.informers = list(informers)
    halt = threading.Event()
    for i in fast.informers:
        threading.Thread(target=i.run, args=(halt,), daemon=True).start()
    try:
        yield
    finally:
        halt.set()
        for i in fast.informers:
            i.stop()


def _evidence(fast: FastPath) -> list[Any]:
    assert fast._queue is not None
    return [fast._queue.get_nowait() for _ in range(fast._queue.qsize())]


async def _evidence_until(
    fast: FastPath, arrived: Callable[[list[Any]], bool], what: str, timeout_s: float = 20
) -> list[Any]:
    """The evidence queued so far, once ``arrived(evidence)`` holds."""
    collected: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while True:
        collected.extend(_evidence(fast))
        if arrived(collected):
            return collected
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}: {collected}"
        await asyncio.sleep(0.05)


async def _watches_open(sim: RunningSim, count: int, timeout_s: float = 20) -> None:
    """Until the API server serves ``count`` watch streams (the informers have listed and watch)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
        while (await http.get("/sim/v1/api-server")).json()["open_watches"] < count:
            assert time.monotonic() < deadline, f"fewer than {count} watches open after {timeout_s:g} s"
            await asyncio.sleep(0.05)


async def _routed(core: client.CoreV1Api, timeout_s: float = 30) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pods = core.list_namespaced_pod(NS, label_selector=ROUTER_LABEL).items
        if pods:
            return list(pods)
        await asyncio.sleep(0.2)
    raise AssertionError(f"no routed pod within {timeout_s:g} s")


async def _fault(sim: RunningSim, body: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
        r = await http.post("/sim/v1/faults", json=body)
        assert r.status_code < 300, r.text


async def test_a_watch_that_falls_behind_relists_and_still_reports_the_routed_pod_that_went(
    short_history: RunningSim,
) -> None:
    sim = short_history
    core = _core(sim)
    settings = load_settings(**settings_for_running_sim(sim))
    fast = FastPath(settings, _no_delivery, topology=None)  # type: ignore[arg-type]  # no lookup here
    fast._loop, fast._queue = asyncio.get_running_loop(), asyncio.Queue()
    pods = Informer("pods", core.list_pod_for_all_namespaces, fast._on_pod, label_selector=MODEL_LABEL)
    fast.informers = [pods]
    await asyncio.to_thread(pods.sync)
    stale = pods.resource_version
    routed = sorted(p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=ROUTER_LABEL).items)
    spare = core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=spare").items[0].metadata.name
    # While the watch is down: more changes than the API server's history keeps, and a routed pod goes.
    for step in range(30):
        core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"step": str(step)}}})
    core.delete_namespaced_pod(routed[0], NS, grace_period_seconds=0)
    assert routed[0] not in {p.metadata.name for p in core.list_namespaced_pod(NS).items}

    await asyncio.to_thread(pods.watch_once, threading.Event())  # from the stale resourceVersion

    assert pods.relists_after_gone == 1 and pods.lists == 2
    assert pods.resource_version != stale
    assert f"{NS}/{routed[0]}" not in pods.cache
    evidence = [fast._queue.get_nowait() for _ in range(fast._queue.qsize())]
    gone = [e for e in evidence if e.kind is EvidenceKind.POD_GONE]
    assert [e.entity for e in gone] == [f"pod:{NS}/{routed[0]}"], evidence
    _, detection = observe(None, gone[0])
    assert detection.loss and "deleted while carrying fleetmend.io/serving" in detection.reason


def test_one_lease_holder_a_standby_takes_over_after_the_holder_stops_renewing_a_race_has_one_winner(
    short_history: RunningSim,
) -> None:
    api = client.CoordinationV1Api(
        config.new_client_from_config(config_file=str(short_history.kubeconfig), context="sim")
    )

    def elector(identity: str) -> LeaderElector:
        return LeaderElector(
            lambda: api,
            namespace=NS,
            name="fleetmend-fastpath",
            identity=identity,
            lease_duration_s=1.5,
            renew_deadline_s=1.0,
            retry_period_s=0.2,
        )

    a, b = elector("worker-a"), elector("worker-b")
    assert a.try_acquire_or_renew()  # creates the Lease
    assert not b.try_acquire_or_renew()  # a valid Lease held by a: b stands by
    assert a.try_acquire_or_renew()  # renew
    lease = api.read_namespaced_lease("fleetmend-fastpath", NS)
    assert lease.spec.holder_identity == "worker-a" and lease.spec.lease_duration_seconds == 2
    # a dies (kill -9: it simply stops renewing). b judges expiry by its own clock since the record last changed.
    assert not b.try_acquire_or_renew()
    # b's own clock must pass the 2 s lease duration: expiry is elapsed time on the standby, not a state to watch.
    time.sleep(2.2)
    assert b.try_acquire_or_renew()
    lease = api.read_namespaced_lease("fleetmend-fastpath", NS)
    assert lease.spec.holder_identity == "worker-b" and lease.spec.lease_transitions == 1
    assert not a.try_acquire_or_renew()  # a back from the dead finds b's valid Lease
    # A race on a stale read: the update conditioned on the old resourceVersion loses with 409.
    c = elector("worker-c")
    stale = api.read_namespaced_lease("fleetmend-fastpath", NS)
    assert b.try_acquire_or_renew()  # b renews: the resourceVersion moves on
    body = {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": "fleetmend-fastpath",
            "namespace": NS,
            "resourceVersion": stale.metadata.resource_version,
        },
        "spec": {"holderIdentity": "worker-c", "leaseDurationSeconds": 2},
    }
    with pytest.raises(client.exceptions.ApiException) as conflict:
        api.replace_namespaced_lease("fleetmend-fastpath", NS, body)
    assert conflict.value.status == 409
    assert not c.try_acquire_or_renew()
    # A graceful stop releases the Lease: a standby takes it at once.
    b.release()
    assert c.try_acquire_or_renew()
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaderElector(
            lambda: api, namespace=NS, name="x", identity="y", lease_duration_s=1, renew_deadline_s=2
        )


async def test_a_graceful_deletion_of_a_routed_pod_sends_no_evidence_a_forced_one_is_a_loss(
    short_history: RunningSim,
) -> None:
    """A rollout or `kubectl delete pod` terminates gracefully (the EndpointSlice endpoint turns
    ``terminating``): the evidence says so, and a healthy pod terminated is not a loss. A forced
    deletion (grace 0) of a routed pod nobody derouted is one."""
    sim = short_history
    core = _core(sim)
    discovery = client.DiscoveryV1Api(core.api_client)
    fast = _detector(sim)
    with _watching(
        fast,
        Informer("pods", core.list_pod_for_all_namespaces, fast._on_pod, label_selector=MODEL_LABEL),
        Informer("endpointslices", discovery.list_endpoint_slice_for_all_namespaces, fast._on_slice),
    ):
        routed = sorted(
            p.metadata.name for p in core.list_namespaced_pod(NS, label_selector=ROUTER_LABEL).items
        )
        graceful, forced = routed[0], routed[1]
        await _watches_open(sim, 2)
        core.delete_namespaced_pod(graceful, NS)  # its terminationGracePeriodSeconds
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
            p.metadata.name == graceful for p in core.list_namespaced_pod(NS).items
        ):
            await asyncio.sleep(0.2)
        assert all(p.metadata.name != graceful for p in core.list_namespaced_pod(NS).items), (
            "still terminating"
        )
        core.delete_namespaced_pod(forced, NS, grace_period_seconds=0)
        evidence = await _evidence_until(
            fast, lambda ev: any(e.entity == f"pod:{NS}/{forced}" for e in ev), "the forced deletion"
        )
    terminated = [e for e in evidence if e.entity == f"pod:{NS}/{graceful}"]
    assert terminated and {e.kind for e in terminated} == {EvidenceKind.POD_TERMINATED}, evidence
    state = None
    for e in terminated:  # a healthy pod terminated on purpose: never a loss
        state, detection = observe(state, e)
        assert not detection.loss, detection
    assert [(e.entity, e.kind) for e in evidence if e.entity == f"pod:{NS}/{forced}"] == [
        (f"pod:{NS}/{forced}", EvidenceKind.POD_GONE)
    ], evidence


async def test_an_xid_on_a_serving_node_is_gpu_fault_evidence_from_the_node_watch() -> None:
    """A node problem detector's ``GpuXid`` condition on a node that serves a managed pool is
    evidence the node watch sends at once (with the condition's own words); the engine on the
    broken GPU may still answer (``keep_alive``), the node's Ready stays True."""
    sim = start_sim(shipped_scenarios()["gpu-node-loss"], speed=100.0)
    try:
        core = _core(sim)
        fast = _detector(sim)
        routed = await _routed(core)
        node = str(routed[0].spec.node_name)
        spare_nodes = {str(n.metadata.name) for n in core.list_node().items} - {
            str(p.spec.node_name) for p in routed
        }
        with _watching(
            fast,
            Informer("pods", core.list_pod_for_all_namespaces, fast._on_pod, label_selector=MODEL_LABEL),
            Informer("nodes", core.list_node, fast._on_node),
        ):
            await _watches_open(sim, 2)
            await _fault(
                sim, {"kind": "gpu-xid", "target": node, "params": {"code": 79, "gpu": 0, "keep_alive": True}}
            )
            evidence = await _evidence_until(
                fast, lambda ev: any(e.kind is EvidenceKind.NODE_GPU_FAULT for e in ev), "the Xid evidence"
            )
    finally:
        sim.stop()
    faults = [e for e in evidence if e.kind is EvidenceKind.NODE_GPU_FAULT]
    assert faults and {e.entity for e in faults} == {f"node:{node}"}, evidence
    assert "GpuXid=True" in faults[0].detail and "Xid 79" in faults[0].detail, faults[0]
    _, detection = observe(None, faults[0])
    assert detection.loss
    # Nodes serving no managed pool send nothing, whatever their conditions.
    assert not {e.entity for e in evidence} & {f"node:{n}" for n in spare_nodes}, evidence


async def test_a_rank_that_restarts_is_evidence_about_its_groups_routed_leader() -> None:
    """One rank of a LeaderWorkerSet group dies: the worker pod's restart (its restartCount, from the
    pods watch) is evidence about the group's leader, at once, with the rank's own termination words."""
    sim = start_sim(shipped_scenarios()["rank-lost"], speed=100.0)
    try:
        core = _core(sim)
        fast = _detector(sim)
        leader = sorted(p.metadata.name for p in await _routed(core))[0]
        group = core.read_namespaced_pod(leader, NS).metadata.labels[LWS_GROUP_KEY_LABEL]
        rank = next(
            p.metadata.name
            for p in core.list_namespaced_pod(NS).items
            if p.metadata.labels.get(LWS_GROUP_KEY_LABEL) == group
            and p.metadata.labels.get(LWS_WORKER_INDEX_LABEL) == "1"
        )
        with _watching(
            fast, Informer("pods", core.list_pod_for_all_namespaces, fast._on_pod, label_selector=MODEL_LABEL)
        ):
            await _watches_open(sim, 1)
            assert fast._queue is not None and fast._queue.qsize() == 0  # earlier restarts are history
            await _fault(sim, {"kind": "rank-lost", "target": f"{NS}/{rank}"})
            evidence = await _evidence_until(
                fast, lambda ev: any(e.kind is EvidenceKind.RANK_FAILED for e in ev), "the rank's failure"
            )
    finally:
        sim.stop()
    failed = [e for e in evidence if e.kind is EvidenceKind.RANK_FAILED]
    assert failed and {e.entity for e in failed} == {f"pod:{NS}/{leader}"}, evidence
    assert rank in failed[0].detail and "NCCL" in failed[0].detail, failed[0]


async def test_a_loss_whose_pod_is_gone_before_its_groups_are_read_is_reported_when_its_deletion_arrives() -> (
    None
):
    """A rank fails and the LeaderWorkerSet deletes its group at once: the fast path can judge the loss,
    look the leader up, and find it gone from the API while the watch has not yet brought its deletion
    (so its last labels are unknown). That loss reaches no pool. It used to stay marked reported, and
    no recovery started (a bench run of 2026-12-07); now it is re-armed, and the deletion event that
    follows reports it with the pod's last labels."""
    sim = start_sim(shipped_scenarios()["rank-lost"], speed=100.0)
    delivered: list[Any] = []

    async def deliver(reports: list[Any]) -> list[Any]:
        delivered.extend(reports)
        return [None] * len(reports)

    try:
        settings = load_settings(**settings_for_running_sim(sim))
        fast = FastPath(settings, deliver, PoolTopology.from_settings(settings))
        fast._loop, fast._queue = asyncio.get_running_loop(), asyncio.Queue()
        core = _core(sim)
        leader = sorted(p.metadata.name for p in await _routed(core))[0]
        last_seen = client.ApiClient().sanitize_for_serialization(core.read_namespaced_pod(leader, NS))
        gone = f"{leader}-gone"  # a leader the API no longer has: its deletion is still on the way
        last_seen["metadata"]["name"] = gone
        entity = f"pod:{NS}/{gone}"

        async def handled(evidence: Evidence) -> None:
            await fast._handle(evidence)
            await asyncio.gather(*fast._tasks)

        await handled(Evidence(entity=entity, kind=EvidenceKind.RANK_FAILED, at=time.time(), detail="rank 1"))
        assert fast.counts["loss"] == 1 and fast.counts["reports_unrouted"] == 1 and not delivered
        state = fast.state(entity)
        assert state is not None and not state.reported  # re-armed
        fast._on_pod("DELETED", last_seen)
        assert fast._queue is not None
        await handled(await asyncio.wait_for(fast._queue.get(), 5))
    finally:
        sim.stop()
    assert fast.counts["loss"] == 2 and fast.counts["reports_delivered"] == 1, fast.counts
    assert [(r.report.pool.service, r.report.pod) for r in delivered] == [("llama-405b", gone)], delivered


LEADER_PROCESS = """
import asyncio, sys, time
from kubernetes import client, config
from kube.lease import LeaderElector

api = client.CoordinationV1Api(config.new_client_from_config(config_file=sys.argv[1], context="sim"))


class Holder(LeaderElector):
    def try_acquire_or_renew(self) -> bool:
        started = time.monotonic()
        held = super().try_acquire_or_renew()
        if held:
            print(f"renewed {started!r}", flush=True)  # the system-wide monotonic clock
        return held


elector = Holder(
    lambda: api, namespace=sys.argv[2], name="fleetmend-fastpath", identity="worker-killed",
    lease_duration_s=float(sys.argv[3]), renew_deadline_s=float(sys.argv[4]), retry_period_s=float(sys.argv[5]),
)


async def lead(lost: asyncio.Event) -> None:
    await lost.wait()


asyncio.run(elector.run(asyncio.Event(), lead))
"""


async def test_a_standby_holds_the_lease_within_lease_duration_plus_one_retry_period_of_the_leaders_kill_9(
    short_history: RunningSim, tmp_path: Path
) -> None:
    """The holder is a process killed with SIGKILL right after a renewal (it stops renewing and
    releases nothing). The standby's tries fall late in the holder's renewal period, so it sees that
    last renewal most of a retry period after it. It must still hold the Lease within lease duration
    + one retry period of the kill (kube/lease.py: it tries again the moment its observation is a
    lease duration old, not at its next retry tick), and never before the Lease expired."""
    lease_s, renew_s, retry_s = 3.0, 2.0, 1.2
    phase = 0.7  # the standby tries this far (in retry periods) after each of the holder's renewals
    api = client.CoordinationV1Api(
        config.new_client_from_config(config_file=str(short_history.kubeconfig), context="sim")
    )
    script = tmp_path / "leader.py"
    script.write_text(LEADER_PROCESS)
    leader = subprocess.Popen(
        [
            sys.executable,
            str(script),
            str(short_history.kubeconfig),
            NS,
            str(lease_s),
            str(renew_s),
            str(retry_s),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert leader.stdout is not None
    out = leader.stdout

    async def next_renewal() -> float:
        """The start (monotonic) of the holder's next renewal, read as it is reported."""
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(out.readline), 30)
            assert line.startswith("renewed "), line
            started = float(line.split()[1])
            if time.monotonic() - started < retry_s / 2:  # fresh, not one queued in the pipe
                return started

    standby = LeaderElector(
        lambda: api,
        namespace=NS,
        name="fleetmend-fastpath",
        identity="worker-standby",
        lease_duration_s=lease_s,
        renew_deadline_s=renew_s,
        retry_period_s=retry_s,
    )
    holding: list[float] = []

    async def lead(lost: asyncio.Event) -> None:
        holding.append(time.monotonic())
        await lost.wait()

    stop = asyncio.Event()
    campaign: asyncio.Task[None] | None = None
    try:
        renewed = await next_renewal()
        await asyncio.sleep(max(0.0, renewed + phase * retry_s - time.monotonic()))
        campaign = asyncio.create_task(standby.run(stop, lead))
        await next_renewal()
        assert standby.expires_at is not None and not holding  # it has seen the holder's valid Lease
        last_renewal = await next_renewal()
        leader.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 2 * (lease_s + retry_s)
        while not holding:
            assert time.monotonic() < deadline, "the standby never took the Lease over"
            await asyncio.sleep(0.02)
        took = holding[0] - killed
        print(f"holder killed -> standby holds the Lease: {took:.3f} s (bound {lease_s + retry_s:g} s)")
        assert took <= lease_s + retry_s, took
        assert holding[0] >= last_renewal + lease_s, (holding[0], last_renewal)  # never before expiry
        lease = await asyncio.to_thread(api.read_namespaced_lease, "fleetmend-fastpath", NS)
        assert lease.spec.holder_identity == "worker-standby" and lease.spec.lease_transitions == 1
    finally:
        stop.set()
        if campaign is not None:
            await asyncio.wait_for(campaign, 15)
        if leader.poll() is None:
            leader.kill()
        leader.wait(10)


async def test_the_leader_keeps_renewing_while_the_event_loops_default_executor_is_busy(
    short_history: RunningSim,
) -> None:
    """A burst's topology lookups fill the loop's default executor with blocking calls: the Lease's
    renewals do not queue behind them (the elector has its own thread), so the leader does not step
    down in the middle of the burst it is detecting."""
    api = client.CoordinationV1Api(
        config.new_client_from_config(config_file=str(short_history.kubeconfig), context="sim")
    )
    elector = LeaderElector(
        lambda: api,
        namespace=NS,
        name="fleetmend-fastpath-busy",
        identity="worker-a",
        lease_duration_s=1.5,
        renew_deadline_s=1.0,
        retry_period_s=0.2,
    )
    stop, released = asyncio.Event(), threading.Event()
    led: list[asyncio.Event] = []

    async def lead(lost: asyncio.Event) -> None:
        led.append(lost)
        await lost.wait()

    running = asyncio.create_task(elector.run(stop, lead))
    try:
        while not elector.leading:
            await asyncio.sleep(0.05)
        # More blocking calls than the default executor has threads, each longer than the renew deadline.
        busy = [asyncio.create_task(asyncio.to_thread(released.wait, 5.0)) for _ in range(64)]
        seen: set[Any] = set()
        deadline = time.monotonic() + 10
        # Six renewals at a 0.2 s retry period span more than the 1 s renew deadline.
        while len(seen) < 7:
            assert time.monotonic() < deadline, (
                f"renewals stopped while the default executor was busy: {seen}"
            )
            seen.add(api.read_namespaced_lease("fleetmend-fastpath-busy", NS).spec.renew_time)
            await asyncio.sleep(0.05)
        assert all(not t.done() for t in busy), "the executor was not busy for the whole check"
        assert elector.leading and len(led) == 1 and not led[0].is_set(), "the leader stepped down"
    finally:
        released.set()
        stop.set()
        await asyncio.wait_for(running, 10)
