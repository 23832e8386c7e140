"""Each injected fault leaves the Kubernetes, engine-metrics and DCGM signals a real one would."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.qualification import parse_dcgm_diag
from tests.sim.serving_fixtures import (
    NAMESPACE,
    RunningServing,
    pod_node_and_gpu,
    running_serving,
    scenario,
)
from tests.sim.support import condition, finished_job, job_pod, pod_log, start_job

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


async def families(sim: RunningServing, path: str) -> dict[str, Any]:
    r = await sim.http.get(path)
    r.raise_for_status()
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(family: Any, **labels: str) -> list[Any]:
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


async def ksm_value(sim: RunningServing, name: str, **labels: str) -> float:
    fams = await families(sim, "/metrics")
    if name not in fams:
        return 0.0
    return sum(s.value for s in samples(fams[name], **labels))


async def test_gpu_xid_79_kills_the_replica_on_that_gpu_shows_in_dcgm_and_fails_a_qualification_job() -> None:
    async with running_serving(scenario(), speed=40) as sim:
        victim, _ = await sim.wait_serving(2)
        node, gpu = pod_node_and_gpu(sim, victim)
        other_node = next(
            n["metadata"]["name"] for n in sim.layer.kube.nodes() if n["metadata"]["name"] != node
        )
        assert (await sim.fault("gpu-xid", node, code=79, gpu=gpu)).status_code == 202
        # DCGM: the last Xid on that GPU, with its code and message.
        dcgm = await families(sim, f"/nodes/{node}/metrics")
        (xid,) = samples(dcgm["DCGM_FI_DEV_XID_ERRORS"], gpu=str(gpu))
        assert xid.value == 79 and xid.labels["err_code"] == "79"
        assert xid.labels["err_msg"] == "GPU has fallen off the bus" and xid.labels["pod"] == victim
        # The device plugin marks the GPU unhealthy: one GPU less is allocatable on that node.
        node_obj = sim.world.store.find("nodes", "", node)
        assert node_obj is not None and node_obj["status"]["allocatable"]["nvidia.com/gpu"] == "7"
        # The engine is dead: /health 503 while the API server lingers, then the container exits.
        assert (await sim.engine_get(victim, "/health")).status_code == 503
        restarts = {"namespace": NAMESPACE, "pod": victim}
        await sim.wait_for(
            lambda: ksm_value(sim, "kube_pod_container_status_restarts", **restarts), 60, "a restart"
        )
        # The GPU stays broken: each restart crashes again.
        await sim.wait_for(
            lambda: ksm_value(
                sim, "kube_pod_container_status_waiting_reason", reason="CrashLoopBackOff", pod=victim
            ),
            60,
            "CrashLoopBackOff",
        )
        assert await ksm_value(
            sim, "kube_pod_container_status_last_terminated_reason", reason="Error", pod=victim
        )
        # Qualification (a DCGM Job on the free GPUs): fails on the broken node, passes on the healthy one.
        await start_job(sim, "q-broken", node, gpus=3)  # 7 offered, 4 held by the victim
        await start_job(sim, "q-other", other_node, gpus=4)
        broken = await finished_job(sim, "q-broken")
        assert condition(broken, "Failed") is not None
        pod = await job_pod(sim, "q-broken")
        assert pod is not None
        report = parse_dcgm_diag(await pod_log(sim, pod["metadata"]["name"]))
        assert any(f"GPU {gpu}: Xid 79" in f for f in report.failures), report.failures
        assert condition(await finished_job(sim, "q-other"), "Complete") is not None
        # A repair (GPU reset / RMA) clears it; the replica comes back and qualification passes.
        assert (await sim.fault("gpu-xid", node, clear=True)).status_code == 202
        assert sim.world.store.find("nodes", "", node)["status"]["allocatable"]["nvidia.com/gpu"] == "8"  # type: ignore[index]
        await sim.wait_for(lambda: victim in sim.serving_pods(), 120, "the replica to come back")
        await start_job(sim, "q-repaired", node, gpus=4)
        assert condition(await finished_job(sim, "q-repaired"), "Complete") is not None


async def test_oom_killed_pod_shows_the_reason_restarts_and_its_engine_counters_reset() -> None:
    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        for _ in range(3):  # to the engine at its pod IP
            r = await sim.http.post(
                sim.pod_url(pod) + "/v1/completions", json={"model": MODEL, "max_tokens": 8}
            )
            assert r.status_code == 200
        before = await sim.metrics(pod)
        assert sum(s.value for s in before["vllm:request_success"].samples if s.name.endswith("_total")) == 3
        assert (await sim.fault("pod-oomkilled", f"{NAMESPACE}/{pod}")).status_code == 202
        reason = {"pod": pod, "reason": "OOMKilled"}
        await sim.wait_for(
            lambda: ksm_value(sim, "kube_pod_container_status_last_terminated_reason", **reason),
            10,
            "OOMKilled",
        )
        await sim.wait_for(lambda: pod in sim.serving_pods(), 60, "restart")
        after = await sim.metrics(pod)
        assert sum(s.value for s in after["vllm:request_success"].samples if s.name.endswith("_total")) == 0
        assert await ksm_value(sim, "kube_pod_container_status_restarts", pod=pod) == 1
        obj = sim.layer.kube.pod(NAMESPACE, pod)
        assert obj is not None
        terminated = obj["status"]["containerStatuses"][0]["lastState"]["terminated"]
        assert terminated["reason"] == "OOMKilled" and terminated["exitCode"] == 137


async def test_node_lost_silences_its_exporters_then_kubernetes_marks_it_unknown_and_taints_it() -> None:
    async with running_serving(scenario(), speed=40) as sim:
        pod, _ = await sim.wait_serving(2)
        node, _ = pod_node_and_gpu(sim, pod)
        assert (await sim.fault("node-lost", node)).status_code == 202
        assert (await sim.http.get(f"/nodes/{node}/metrics")).status_code == 503
        # Its engines' processes are gone with it: their pod IPs refuse connections.
        with pytest.raises(httpx.ConnectError):
            await sim.engine_get(pod, "/health")
        unknown = {"node": node, "condition": "Ready", "status": "unknown"}
        await sim.wait_for(
            lambda: ksm_value(sim, "kube_node_status_condition", **unknown), 120, "Ready=Unknown"
        )
        taint = {"node": node, "key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
        await sim.wait_for(lambda: ksm_value(sim, "kube_node_spec_taint", **taint), 60, "unreachable taint")

        await sim.wait_for(lambda: pod not in sim.routed(), 60, "the lost pod to leave the routing set")
        assert await ksm_value(sim, "kube_pod_status_ready", pod=pod, condition="false") == 1


async def test_slow_wedged_thermal_and_nvlink_faults_show_their_signals() -> None:
    async with running_serving(scenario(load={"engine": {"max_tokens_per_seq_s": 10.0}}), speed=20) as sim:
        slow, wedged = await sim.wait_serving(2)
        slow_engine = sim.layer.supervisor.get(f"{NAMESPACE}/{slow}")
        wedged_engine = sim.layer.supervisor.get(f"{NAMESPACE}/{wedged}")
        assert slow_engine is not None and wedged_engine is not None
        healthy_rate = slow_engine.rate(sim.world.clock.now())
        assert (await sim.fault("slow-replica", f"{NAMESPACE}/{slow}", factor=0.25)).status_code == 202
        assert (await sim.fault("wedged-engine", f"{NAMESPACE}/{wedged}")).status_code == 202
        assert slow_engine.rate(sim.world.clock.now()) < 0.3 * healthy_rate
        # The wedged engine takes requests and never answers; /health stays 200 (a progress check must catch it).
        url = sim.pod_url(wedged) + "/v1/completions"
        pending = [
            asyncio.create_task(sim.http.post(url, json={"model": MODEL, "max_tokens": 4})) for _ in range(3)
        ]
        await sim.wait_for(
            lambda: wedged_engine.num_waiting + wedged_engine.num_running == 3, 200, "queued"
        )  # 10 s wall at speed 20
        tokens_before = await sim.metrics(wedged)
        await sim.sim_sleep(5.0)
        tokens_after = await sim.metrics(wedged)
        gen = "vllm:generation_tokens"
        assert tokens_before[gen].samples[0].value == tokens_after[gen].samples[0].value == 0
        waiting = tokens_after["vllm:num_requests_waiting"].samples[0].value
        running = tokens_after["vllm:num_requests_running"].samples[0].value
        assert waiting + running == 3
        assert (await sim.engine_get(wedged, "/health")).status_code == 200
        assert await ksm_value(sim, "kube_pod_status_ready", pod=wedged, condition="true") == 1
        for task in pending:
            task.cancel()
        # Thermal: hot GPUs with thermal clock-event reasons; engines there slow down.
        node, _ = pod_node_and_gpu(sim, slow)
        assert (await sim.fault("thermal", node, temp_c=95, factor=0.5)).status_code == 202
        dcgm = await families(sim, f"/nodes/{node}/metrics")
        assert all(s.value == 95 for s in dcgm["DCGM_FI_DEV_GPU_TEMP"].samples)
        assert all(int(s.value) & 0x40 for s in dcgm["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"].samples)
        assert slow_engine.rate(sim.world.clock.now()) < 0.15 * healthy_rate
        # NVLink: Xid 74 and NVLink error counters; the TP=4 replica on that GPU dies.
        node, gpu = pod_node_and_gpu(sim, wedged)
        assert (await sim.fault("nvlink-error", node, gpu=gpu)).status_code == 202
        dcgm = await families(sim, f"/nodes/{node}/metrics")
        (xid,) = samples(dcgm["DCGM_FI_DEV_XID_ERRORS"], gpu=str(gpu))
        assert xid.value == 74 and xid.labels["err_msg"] == "NVLink Error"
        (crc,) = samples(dcgm["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"], gpu=str(gpu))
        assert crc.value > 0
        assert not wedged_engine.alive and "NVLink" in wedged_engine.death_reason


async def test_bad_rollout_pods_crash_loop_and_faults_with_bad_targets_are_refused() -> None:
    async with running_serving(scenario(), speed=40) as sim:
        await sim.wait_serving(2)
        missing = await sim.fault("gpu-xid", "gpu-node-9", code=79)
        assert missing.status_code == 404 and "known nodes" in missing.json()["detail"]
        bad_code = await sim.fault("gpu-xid", "gpu-node-0", code="seventy-nine")
        assert bad_code.status_code == 422 and "params.code" in missing.text + bad_code.text
        assert (
            await sim.http.post("/sim/v1/faults", json={"kind": "meteor", "target": "x"})
        ).status_code == 422
        assert (await sim.fault("bad-rollout", f"{NAMESPACE}/llama")).status_code == 202

        def new_revision_pods() -> list[dict[str, Any]]:
            return [
                p
                for p in sim.layer.kube.pods()
                if (p["metadata"].get("labels") or {}).get("fleetmend.io/revision") == "r1-bad"
            ]

        async def crash_looping() -> bool:
            pods = new_revision_pods()
            if not pods:
                return False
            name = pods[0]["metadata"]["name"]
            return (
                await ksm_value(
                    sim, "kube_pod_container_status_waiting_reason", pod=name, reason="CrashLoopBackOff"
                )
                == 1
            )

        await sim.wait_for(crash_looping, 120, "the new revision to crash-loop")
        name = new_revision_pods()[0]["metadata"]["name"]
        await sim.wait_for(
            lambda: (
                (
                    sim.layer.kube.pod(NAMESPACE, name)
                    or {"status": {"containerStatuses": [{"restartCount": 0}]}}
                )["status"]["containerStatuses"][0]["restartCount"]
                >= 2
            ),
            120,
            "restarts to climb",
        )
        assert all(
            k.split("/", 1)[1] != name or not e.alive for k, e in sim.layer.supervisor.engines().items()
        )


async def test_losing_one_rank_of_a_multi_node_group_takes_the_whole_group_down_and_it_is_recreated() -> None:
    scn = scenario(
        model={"gpus_per_pod": 8, "pods_per_replica": 2, "distributed_init_s": 1},
        workloads=[
            {
                "name": "llama",
                "model": "llama-8b",
                "kind": "LeaderWorkerSet",
                "replicas": 1,
                "topology_key": "topology.kubernetes.io/zone",
            }
        ],
    )
    async with running_serving(scn, speed=40) as sim:
        (leader,) = await sim.wait_serving(1)
        leader_obj = sim.layer.kube.pod(NAMESPACE, leader)
        assert leader_obj is not None
        leader_uid = leader_obj["metadata"]["uid"]
        group = leader_obj["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-key"]
        (worker,) = [
            p["metadata"]["name"]
            for p in sim.layer.kube.pods()
            if p["metadata"]["labels"].get("leaderworkerset.sigs.k8s.io/group-key") == group
            and p["metadata"]["name"] != leader
        ]
        engine = sim.layer.supervisor.get(f"{NAMESPACE}/{leader}")
        assert engine is not None and engine.alive
        assert (await sim.fault("rank-lost", f"{NAMESPACE}/{worker}")).status_code == 202
        # The leader's engine aborts at once (NCCL), so the group stops serving...
        assert not engine.alive and "rank" in engine.death_reason
        # A dead engine answers 503 until its process exits (quickly at 40x), then its socket is gone.
        try:
            assert (await sim.engine_get(leader, "/health")).status_code == 503
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            pass

        # ...and the LeaderWorkerSet recreates the whole group (a new leader pod), which serves again.
        def recreated() -> bool:
            pod = sim.layer.kube.pod(NAMESPACE, leader)
            new = sim.layer.supervisor.get(f"{NAMESPACE}/{leader}")
            return pod is not None and pod["metadata"]["uid"] != leader_uid and new is not None and new.alive

        await sim.wait_for(recreated, 300, "the group to be recreated")


async def test_fleetmends_own_parsers_read_the_simulators_pages() -> None:
    """The contract between the world and fleetmend: fleet.engine_metrics reads what the sim serves."""
    from fleet.engine_metrics import parse_dcgm_metrics, parse_engine_metrics

    async with running_serving(scenario(), speed=20) as sim:
        pod, _ = await sim.wait_serving(2)
        for _i in range(2):  # to the engine at its pod IP
            answer = await sim.http.post(
                sim.pod_url(pod) + "/v1/completions", json={"model": MODEL, "max_tokens": 8}
            )
            assert answer.status_code == 200
        snap = parse_engine_metrics((await sim.engine_get(pod, "/metrics")).text)
        assert snap.engines == 1 and snap.model_names == (MODEL,)
        assert snap.request_success_total == 2 and snap.generation_tokens_total == 16
        assert snap.kv_usage is not None and snap.kv_era.value != "none"
        node, gpu = pod_node_and_gpu(sim, pod)
        await sim.fault("thermal", node, temp_c=97)
        await sim.fault("gpu-xid", node, code=48, gpu=gpu)
        await sim.sim_sleep(1.0)
        tel = parse_dcgm_metrics(node, (await sim.http.get(f"/nodes/{node}/metrics")).text)
        assert tel.xids == {str(gpu): 48}
        assert len(tel.thermal_throttled) == 8
        bad = next(g for g in tel.gpus if g.gpu == str(gpu))
        assert bad.ecc_dbe_volatile == 1 and bad.temperature_c == 97
        assert bad.thermal_violation_us is not None and bad.thermal_violation_us > 0
