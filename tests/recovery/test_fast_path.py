"""The fast path beside the alert path: Kubernetes watches + Envoy's view of the engines open the pool's incident.

Real Temporal dev server, real Postgres, the simulated cluster over the official ``kubernetes``
client (list + watch, Leases), Envoy's view of the engines' health (its admin API), the suspects'
own /health over HTTP, the webhook's own intake for the signal-with-start. Each test asserts what an SRE checks: which path opened the incident, that the
later alert landed in it, that a slow replica opened nothing, and the evidence on record.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from pathlib import Path

import pytest
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from temporalio.client import Client

from fleet.arrivals import PRE_LOSS_GAP_S, PRE_LOSS_MIN_S
from fleet.detection import Verdict
from fleet.incident import incident_workflow_id
from fleet.recovery import Phase, ProcedureStatus, RecoveryInput
from fleet.vocabulary import QUARANTINE_LABEL, FaultKind
from tests.support import (
    FAST,
    FAST_PATH_SETTINGS,
    POOL,
    decisions,
    finish,
    gpu_pool,
    load_reaches,
    start_worker_process,
    stop_processes,
    wait_for_child,
)
from worker.devstack.rig import FleetRig
from worker.fastpath.service import FAST_PATH_ALERT, FastPath
from worker.intake.alertmanager import AlertmanagerPayload
from worker.intake.intake import AlertIntake
from worker.intake.metrics import WebhookMetrics
from worker.intake.routing import AlertRouter
from worker.intake.rules import load_alert_rules
from worker.intake.topology import PoolTopology
from worker.webhook.examples import alert, notification

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _webhook_intake(rig: FleetRig) -> AlertIntake:
    """The webhook's intake as ``create_app`` builds it (rules, topology, Temporal client)."""
    client = rig.client

    async def same_client() -> Client:
        return client

    topology = PoolTopology.from_settings(rig.settings)
    rules = load_alert_rules(rig.settings.alert_rules_file)
    return AlertIntake(rig.settings, AlertRouter(rules, topology), same_client, WebhookMetrics())


async def _watched(fast: FastPath, pods: list[str], readings: int, timeout_s: float = 30) -> None:
    """Until the fast path knows each of ``pods`` as answering (Envoy's health check passes it) with no
    failure counted, and has read Envoy's view ``readings`` more times."""
    deadline = time.monotonic() + timeout_s
    start = fast.counts["gateway_readings"]
    while True:
        states = [fast.state(f"pod:{POOL.namespace}/{pod}") for pod in pods]
        if fast.counts["gateway_readings"] >= start + readings and all(
            state is not None and state.answered and state.failures == 0 for state in states
        ):
            return
        assert time.monotonic() < deadline, f"the fast path did not see {pods} answer: {states}"
        await asyncio.sleep(0.2)


async def _counted(fast: FastPath, seconds: float, timeout_s: float = 30) -> None:
    """Until the fast path has kept ``seconds`` of the pool's admitted-requests counter."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = fast.counters.readings(POOL.key)
        if readings and readings[-1].at - readings[0].at >= seconds:
            return
        assert time.monotonic() < deadline, f"the fast path kept no {seconds:g} s of counts: {readings}"
        await asyncio.sleep(0.2)


async def _incident_running(client: Client) -> bool:
    try:
        desc = await client.get_workflow_handle(incident_workflow_id(POOL)).describe()
    except Exception:
        return False
    return desc.status is not None and desc.status.name == "RUNNING"


async def test_gpu_node_lost_under_load_opens_the_incident_by_the_fast_path_and_the_alert_is_absorbed(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        async with rig.fast_path() as fast:
            await rig.start_load(rate=52, duration_s=90, seed=3)
            routed = await load_reaches(rig)
            await _watched(fast, routed, 3)
            await _counted(fast, PRE_LOSS_GAP_S + PRE_LOSS_MIN_S + 1)
            assert not await _incident_running(temporal_client)  # healthy load opens nothing
            fault_at = time.time()
            assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
            deadline = time.monotonic() + 30
            while not await _incident_running(temporal_client):
                assert time.monotonic() < deadline, f"no incident; fast path saw {fast.detections}"
                await asyncio.sleep(0.1)
            opened = (
                await temporal_client.get_workflow_handle(incident_workflow_id(POOL)).describe()
            ).start_time
            assert opened is not None
            print(f"fault -> incident opened by the fast path: {opened.timestamp() - fault_at:.2f} s")
            incident = temporal_client.get_workflow_handle(incident_workflow_id(POOL))
            child = await wait_for_child(temporal_client, incident)
            # The alert path's KubeNodeNotReady arrives later (Alertmanager's notification through the
            # webhook's intake: node -> replica groups) and lands in the same open incident.
            payload = AlertmanagerPayload.model_validate(
                notification(
                    [alert({"alertname": "KubeNodeNotReady", "node": "gpu-node-0", "severity": "critical"})]
                )
            )
            delivered = await _webhook_intake(rig).handle(payload)
            assert delivered.workflows == [incident_workflow_id(POOL)], delivered
            status = await finish(child)
            text_ = decisions(status)
            inc = await incident.query("status", result_type=ProcedureStatus)
            started = (await child.fetch_history()).events[0]
            [recovery_input] = await temporal_client.data_converter.decode(
                started.workflow_execution_started_event_attributes.input.payloads, [RecoveryInput]
            )

        assert status.phase == Phase.DONE, text_
        assert len(inc.children) == 1, inc.children  # one incident, one recovery
        assert inc.figures["alerts_absorbed"] >= 1, inc.figures
        losses = [d for d in fast.detections if d.verdict is Verdict.LOSS]
        assert losses and all(d.entity.startswith(("pod:inference/", "node:gpu-node-0")) for d in losses)
        # The evidence the fast path acted on is in the incident's record.
        assert f"{FAST_PATH_ALERT}" in text_ and "consecutive failed checks" in text_, text_
        assert fast.counts["reports_delivered"] >= 2  # both groups on the node
        # A fast-path report starts when its spell of failing evidence began: after the fault, not at a
        # healthy reading kept from before it.
        starts = [r.observed_at for r in recovery_input.reports if r.source == "fastpath"]
        assert starts and all(s is not None and fault_at <= s <= fault_at + 30 for s in starts), (
            fault_at,
            starts,
        )
        # The first shed planned on the arrivals the gateway counted before the loss (the fast path's
        # readings), not on the count since it, which holds the cut streams sent again: the users' rate.
        planned = re.search(
            r"arrivals ([\d.]+) req/s \(counted by the gateway over the \d+ s before the loss", text_
        )
        assert planned is not None, text_
        assert 52 * 0.75 <= float(planned.group(1)) <= 52 * 1.25, planned.group(0)


async def test_a_dead_gpu_node_the_fast_path_reported_only_by_its_pods_is_fenced_and_quarantined(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """No node alert ever arrives: the fast path reports the dead machine's pods as they stop
    answering, while the API still calls the node Ready. The recovery must still see a machine,
    not two crashed containers: fence the node before anything is placed, and quarantine it."""
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        async with rig.fast_path():
            await rig.start_load(rate=20, duration_s=60, seed=4)
            await load_reaches(rig)
            assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
            deadline = time.monotonic() + 30
            while not await _incident_running(temporal_client):
                assert time.monotonic() < deadline, "no incident"
                await asyncio.sleep(0.1)
            child = await wait_for_child(
                temporal_client, temporal_client.get_workflow_handle(incident_workflow_id(POOL))
            )
            status = await finish(child)
        text_ = decisions(status)
        node = await asyncio.to_thread(rig.core.read_node, "gpu-node-0")

    assert status.phase == Phase.DONE, text_
    reports = [d for d in status.decisions if d.summary.startswith("reported by the fast path")]
    assert reports and all(", gpu-node-0)" not in d.summary for d in reports), text_  # its pods, not the node
    # Cordoned by the recovery's fence step, or found cordoned there by the fence at detection (the
    # node's Ready condition went Unknown while the recovery gathered its reports).
    fenced = [
        d
        for d in status.decisions
        if d.summary.startswith(("cordoned gpu-node-0", "gpu-node-0 already cordoned"))
    ]
    assert fenced, text_
    placed = [d for d in status.decisions if d.phase == Phase.PLACING]
    assert placed and min(d.at for d in placed) >= fenced[0].at, (
        text_
    )  # fenced before any replacement was placed
    assert node.spec is not None and node.spec.unschedulable, node.spec
    assert node.metadata is not None and QUARANTINE_LABEL in (node.metadata.labels or {}), node.metadata


async def test_a_slow_replica_opens_nothing_its_health_answers(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        pods = await rig.routing_set(POOL)
        async with rig.fast_path() as fast:
            await rig.start_load(rate=40, duration_s=30, seed=5)
            fault = await rig.inject(FaultKind.SLOW_REPLICA, f"{POOL.namespace}/{pods[0]}", factor=0.3)
            assert fault["accepted"], fault
            await _watched(fast, pods[:1], 5)
            assert not await _incident_running(temporal_client)
            state = fast.state(f"pod:{POOL.namespace}/{pods[0]}")
        # Slow at 0.3x, but present: its health checks answer, no failure counted, no loss reported.
        assert state is not None and state.answered and state.failures == 0 and not state.reported
        assert not [d for d in fast.detections if d.verdict is Verdict.LOSS], fast.detections


def _lease_holder(rig: FleetRig) -> str | None:
    api = k8s_config.new_client_from_config(config_file=str(rig.settings.kubeconfig), context="sim")
    try:
        lease = k8s_client.CoordinationV1Api(api).read_namespaced_lease(
            rig.settings.fastpath_lease_name, rig.settings.fastpath_lease_namespace
        )
        return lease.spec.holder_identity if lease.spec else None
    except k8s_client.exceptions.ApiException:
        return None
    finally:
        api.close()


def _acquired_at(rig: FleetRig) -> float:
    """When the Lease's current holder acquired it (its acquireTime, Unix seconds)."""
    api = k8s_config.new_client_from_config(config_file=str(rig.settings.kubeconfig), context="sim")
    try:
        lease = k8s_client.CoordinationV1Api(api).read_namespaced_lease(
            rig.settings.fastpath_lease_name, rig.settings.fastpath_lease_namespace
        )
        assert lease.spec is not None and lease.spec.acquire_time is not None, lease
        return float(lease.spec.acquire_time.timestamp())
    finally:
        api.close()


async def _holder(rig: FleetRig, *, not_: str | None = None, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        holder = await asyncio.to_thread(_lease_holder, rig)
        if holder and holder != not_:
            return holder
        await asyncio.sleep(0.2)
    raise AssertionError(f"no lease holder other than {not_!r} within {timeout_s} s")


async def test_two_workers_one_leads_kill_9_it_and_the_other_detects_the_next_loss(
    temporal_client: Client, task_queue: str, ledger_url: str, tmp_path: Path
) -> None:
    async with gpu_pool(
        temporal_client,
        task_queue,
        ledger_url,
        run_worker=False,
        fastpath_enabled=True,
        **FAST_PATH_SETTINGS,
        routed=0,
    ) as rig:
        log = tmp_path / "workers.log"
        # Two workers on one machine: no fixed health port for both (each would want :8081).
        env = {"FLEETMEND_RECOVERY_TIMINGS": FAST.model_dump_json(), "FLEETMEND_WORKER_HEALTH_PORT": "0"}
        # Started one after the other, as a rollout does (two workers registering the same new
        # deployment version at the same instant can be refused by Temporal with "too many requests").
        leader = start_worker_process(rig, log, extra_env=env)
        workers = [leader]
        try:
            first = await _holder(rig)
            assert first.endswith(f"-{leader.pid}"), first  # identity is host-pid
            standby = start_worker_process(rig, log, extra_env=env)
            workers.append(standby)
            deadline = time.monotonic() + 60
            while f'"identity": "{first.rsplit("-", 1)[0]}-{standby.pid}"' not in log.read_text():
                assert standby.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                await asyncio.sleep(0.2)  # until the standby campaigns
            # A second for the standby to read the leader's Lease after campaigning: the read happens inside
            # its process, which shows nothing of it until it leads.
            await asyncio.sleep(1.0)
            killed = time.time()
            leader.send_signal(signal.SIGKILL)
            leader.wait(10)
            # The standby holds the Lease within lease duration + one retry period of the kill
            # (kube/lease.py); the Lease's acquireTime is the standby's own record of that moment.
            bound = (
                FAST_PATH_SETTINGS["fastpath_lease_duration_s"]
                + FAST_PATH_SETTINGS["fastpath_retry_period_s"]
            )
            assert standby.poll() is None, log.read_text()[-3000:]
            try:
                second = await _holder(rig, not_=first, timeout_s=2 * bound)
            except AssertionError as err:
                raise AssertionError(f"{err}\n{log.read_text()[-4000:]}") from err
            assert second.endswith(f"-{standby.pid}"), (first, second)
            took = await asyncio.to_thread(_acquired_at, rig) - killed
            print(f"leader killed -> standby holds the Lease: {took:.2f} s (bound {bound:g} s)")
            assert took <= bound, (took, log.read_text()[-3000:])
            # The new leader lists before it watches; it logs "fast path: watching" once every informer holds
            # its first snapshot (a node lost before that list would be missed by design).
            watching = f'"fast path: watching", "identity": "{second}"'
            deadline = time.monotonic() + 60
            while watching not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                await asyncio.sleep(0.2)
            assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
            incident = temporal_client.get_workflow_handle(incident_workflow_id(POOL))
            # A condition with a generous bound: on 2 cores under the whole suite (-n 4) the node-monitor
            # grace, the detection and the incident's start take longer than alone.
            try:
                child = await wait_for_child(temporal_client, incident, timeout_s=90)
            except AssertionError as err:
                raise AssertionError(f"{err}\n{log.read_text()[-4000:]}") from err
            deadline = time.monotonic() + 30
            text_ = ""
            while "reported by the fast path" not in text_:
                assert time.monotonic() < deadline, text_ + "\n" + log.read_text()[-3000:]
                await asyncio.sleep(0.5)
                with contextlib.suppress(Exception):
                    text_ = decisions(await child.query("status", result_type=ProcedureStatus))
            assert FAST_PATH_ALERT in text_
            assert standby.poll() is None
        finally:
            stop_processes(*workers)
