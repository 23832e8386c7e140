"""Readiness is "can take more work", not "the process is up": the ReadinessKeeper against the simulated
fleet under load. A replica whose KV cache crosses the ceiling loses its serving-ready gate, Kubernetes
drops it from the EndpointSlice, the gateway sends it nothing new, and it comes back once it has headroom;
its liveness is never touched."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from temporalio.client import Client
from typer.testing import CliRunner

from fleet.vocabulary import SERVING_READY_CONDITION, FaultKind
from gateway.resources import DataPlaneSettings
from tests.scale_down.support import vllm_default_scenario
from tests.support import POOL, load_reaches, restart_control_plane
from worker.cli.app import app
from worker.devstack.rig import FleetRig, fleet_rig
from workflows.readiness_keeper import KeeperStatus, readiness_keeper_workflow_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]


async def _cli(env: dict[str, str], *args: str) -> Any:
    return await asyncio.to_thread(CliRunner().invoke, app, ["readiness", *args], env=env)


async def _gate(rig: FleetRig, pod: str) -> dict[str, str]:
    obj = await asyncio.to_thread(rig.core.read_namespaced_pod, pod, POOL.namespace)
    status = obj.status
    assert status is not None
    restarts = sum(int(cs.restart_count or 0) for cs in status.container_statuses or [])
    return {c.type: c.status for c in status.conditions or []} | {"restarts": str(restarts)}


async def _wait_gate(rig: FleetRig, pod: str, value: str, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await _gate(rig, pod)).get(SERVING_READY_CONDITION) == value:
            return await rig.sim_now()
        await asyncio.sleep(0.2)
    raise AssertionError(f"{SERVING_READY_CONDITION} of {pod} did not become {value} within {timeout_s} s")


async def _until_routed(rig: FleetRig, pod: str, routed: bool, timeout_s: float = 10) -> None:
    """Until Envoy's routing set has ``pod`` (``routed``) or not."""
    deadline = time.monotonic() + timeout_s
    while (pod in await rig.routing_set(POOL)) != routed:
        assert time.monotonic() < deadline, f"{pod} {'not ' if routed else ''}routed after {timeout_s:g} s"
        await asyncio.sleep(0.1)


async def test_kv_over_the_ceiling_loses_readiness_gets_no_new_requests_and_recovers(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    # A small KV cache so a replica that decodes slowly fills it within seconds of load.
    scenario = vllm_default_scenario(kv_capacity_tokens=40_000)
    async with fleet_rig(
        temporal_client, scenario=scenario, database_url=ledger_url, task_queue=task_queue
    ) as rig:
        # An equal share per replica (round robin), as a Service or a plain router gives it: Envoy's
        # least request would already starve the slow replica of new requests, and its KV cache would
        # never fill. The keeper's gate is what protects it where the gateway does not.
        await restart_control_plane(rig, DataPlaneSettings(balancing="round-robin"), reconnected=POOL)
        env = {
            "FLEETMEND_TEMPORAL_ADDRESS": temporal_client.service_client.config.target_host,
            "FLEETMEND_TEMPORAL_NAMESPACE": temporal_client.namespace,
            "FLEETMEND_TASK_QUEUE": task_queue,
        }
        args = ["--pool", POOL.key, "--interval", "0.3s", "--queue-bound", "50", "--queue-release", "10"]
        started = await _cli(env, "start", *args)
        assert started.exit_code == 0, started.output
        again = await _cli(env, "start", *args)
        assert again.exit_code == 2 and "already runs" in again.output, again.output
        keeper = temporal_client.get_workflow_handle(readiness_keeper_workflow_id(POOL))
        await rig.start_load(
            rate=24, duration_s=90, seed=3, tiers={"standard": 1.0}, output_tokens=[100, 300]
        )
        pods = await load_reaches(rig)
        assert len(pods) == 8
        hot = pods[0]
        await rig.inject(FaultKind.SLOW_REPLICA, f"{POOL.namespace}/{hot}", factor=0.03)

        await _wait_gate(rig, hot, "False", 40)
        # The gate is written inside the keeper's sample; its status shows the verdict once the sample returned.
        for _ in range(50):
            status = await keeper.query("status", result_type=KeeperStatus)
            if status.verdicts[hot].startswith("not ready"):
                break
            await asyncio.sleep(0.1)
        assert "KV" in status.verdicts[hot] and "ceiling" in status.verdicts[hot], status.verdicts
        conditions = await _gate(rig, hot)
        # Not ready, yet live: the container is ready, nothing restarted, /health answers.
        assert conditions["Ready"] == "False" and conditions["ContainersReady"] == "True", conditions
        assert conditions["restarts"] == "0"
        assert (await rig.engine_get(POOL.namespace, hot, "/health")).status_code == 200
        await _until_routed(rig, hot, False)
        out_of_rotation = time.time()  # Envoy's access log stamps requests in wall-clock seconds

        # While the gate is false Envoy sends it nothing new (checked below, once those requests ended): the
        # others meanwhile take five requests each.
        await load_reaches(rig, pods=[p for p in pods if p != hot], requests=5)
        metrics = (await rig.engine_get(POOL.namespace, hot, "/metrics")).text
        assert "num_requests_running" in metrics

        # It recovers: the slowdown clears, its queue drains, the gate turns true after the hysteresis.
        await rig.inject(FaultKind.SLOW_REPLICA, f"{POOL.namespace}/{hot}", clear=True)
        await _wait_gate(rig, hot, "True", 30)
        back_ready = time.time()
        await _until_routed(rig, hot, True)
        # Every request sent meanwhile has ended and is in Envoy's access log. Streams last 2.5-7.5 s, and
        # nothing outside the load generator says when the last one sent before back_ready ended.
        await asyncio.sleep(8)
        served = await rig.request_outcomes(POOL, replica=hot)
        assert served, "Envoy's access log shows no request served by the hot replica at all"
        sent_while_out = [e for e in served if out_of_rotation < e.started_at < back_ready]
        assert sent_while_out == [], sent_while_out
        # As above: the write shows in the keeper's status once the sample that made it returned.
        for _ in range(50):
            status = await keeper.query("status", result_type=KeeperStatus)
            hot_writes = [(w.ready, w.reason) for w in status.recent_writes if w.pod == hot]
            if len(hot_writes) >= 2:
                break
            await asyncio.sleep(0.1)
        assert hot_writes == [(False, "Saturated"), (True, "HasHeadroom")], status.recent_writes
        # Nobody else flapped.
        assert all(w.pod == hot for w in status.recent_writes), status.recent_writes
        shown = await _cli(env, "status", "--pool", POOL.key, "--json")
        assert KeeperStatus.model_validate_json(shown.output).verdicts[hot].startswith("ready")
        assert (await _cli(env, "stop", "--pool", POOL.key)).exit_code == 0
