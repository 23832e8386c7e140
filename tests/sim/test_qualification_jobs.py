"""Qualification as the simulated cluster runs it: a batch/v1 Job, its pod pinned by node affinity,
`dcgmi diag` run by the kubelet on the node's simulated GPUs, the report on ``pods/log``.

Through the sim's Kubernetes API over HTTPS (the kubeconfig's token), as any client would."""

from __future__ import annotations

import json

from fleet.qualification import parse_dcgm_diag
from tests.sim.serving_fixtures import running_serving, scenario
from tests.sim.support import JOBS, NS, condition, finished_job, job_pod, pod_log, start_job


async def test_a_job_runs_dcgm_on_its_pinned_node_and_its_report_is_the_pod_log() -> None:
    async with running_serving(scenario(workloads=[]), speed=40) as sim:
        await start_job(sim, "q-healthy", "gpu-node-1", gpus=8)
        job = await finished_job(sim, "q-healthy")
        assert condition(job, "Complete") is not None and job["status"]["succeeded"] == 1
        pod = await job_pod(sim, "q-healthy")
        assert pod is not None and pod["spec"]["nodeName"] == "gpu-node-1"  # node affinity, never elsewhere
        assert pod["status"]["phase"] == "Succeeded"
        state = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert state["exitCode"] == 0 and state["reason"] == "Completed"
        report = parse_dcgm_diag(await pod_log(sim, pod["metadata"]["name"]))
        assert report.passed and report.tests == 11  # level 2: deployment + PCIe + GPU memory
        # Deleting the Job (Background) garbage-collects its pod.
        r = await sim.kube.request("DELETE", f"{JOBS}/q-healthy", json={"propagationPolicy": "Background"})
        assert r.status_code == 200

        async def pod_gone() -> bool:
            return await job_pod(sim, "q-healthy") is None

        await sim.wait_for(pod_gone, 30, "the Job's pod to be collected")


async def test_a_gpu_that_passes_idle_fails_under_load_is_caught_at_level_2_not_level_1() -> None:
    async with running_serving(scenario(workloads=[]), speed=40) as sim:
        node = "gpu-node-0"
        assert (await sim.fault("gpu-xid", node, code=79, gpu=3)).status_code == 202
        # A reset clears the Xid and brings the GPU back, but it still fails under load.
        assert (await sim.fault("gpu-xid", node, clear=True, under_load_defect=True)).status_code == 202
        metrics = (await sim.http.get(f"/nodes/{node}/metrics")).text
        assert 'DCGM_FI_DEV_XID_ERRORS{gpu="3"' in metrics and "err_code" not in metrics  # idle: clean
        await start_job(sim, "q-idle", node, gpus=8, level=1)
        idle = await finished_job(sim, "q-idle")
        assert condition(idle, "Complete") is not None  # the no-load check passes it
        await start_job(sim, "q-load", node, gpus=8, level=2)
        loaded = await finished_job(sim, "q-load")
        failed = condition(loaded, "Failed")
        assert failed is not None and failed["reason"] == "BackoffLimitExceeded"
        pod = await job_pod(sim, "q-load")
        assert pod is not None and pod["status"]["phase"] == "Failed"
        assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] != 0
        report = parse_dcgm_diag(await pod_log(sim, pod["metadata"]["name"]))
        assert not report.passed
        assert any("GPU 3" in f and "fails under load" in f for f in report.failures), report.failures


async def test_a_job_that_cannot_get_every_gpu_stays_pending_until_its_deadline() -> None:
    async with running_serving(scenario(), speed=40) as sim:
        await sim.wait_serving(2)
        # A serving replica holds 4 of gpu-node-0's GPUs: a diagnostic asking for all 8 cannot schedule.
        await start_job(sim, "q-busy", "gpu-node-0", gpus=8, deadline_s=30)

        async def pending_reason(name: str = "q-busy") -> str:
            pod = await job_pod(sim, name)
            conds = {c["type"]: c for c in (pod or {}).get("status", {}).get("conditions") or []}
            return str(conds.get("PodScheduled", {}).get("message", ""))

        await sim.wait_for(pending_reason, 30, "the scheduler's verdict")
        message = await pending_reason()
        assert "1 Insufficient nvidia.com/gpu" in message and "didn't match Pod's node affinity" in message
        job = await finished_job(sim, "q-busy", timeout_sim_s=120)
        failed = condition(job, "Failed")
        assert failed is not None and failed["reason"] == "DeadlineExceeded"
        assert await job_pod(sim, "q-busy") is None  # the deadline deletes the pending pod
        # A log of a pod that never started is refused the way the kubelet refuses it.
        await start_job(sim, "q-busy-2", "gpu-node-0", gpus=8, deadline_s=600)
        await sim.wait_for(lambda: pending_reason("q-busy-2"), 30, "the pod")
        pod = await job_pod(sim, "q-busy-2")
        assert pod is not None
        r = await sim.kube.get(f"/api/v1/namespaces/{NS}/pods/{pod['metadata']['name']}/log")
        assert r.status_code == 400 and "waiting to start" in json.loads(r.text)["message"]
