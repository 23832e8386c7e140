"""The shipped RBAC against the Kubernetes calls fleetmend really makes.

A real replica-loss recovery (real worker, real Temporal and Postgres, the simulated fleet over
HTTP) and the webhook's alert lookups run with the recorder on; every call must be allowed by the
rendered Roles and bindings of every overlay, and every permission granted must have been used
(or be listed below with the feature that needs it). A call outside the Role fails, naming the
rule to add. For the whole integration suite: ``pytest -p tests.deploy.rbac_audit ...``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from temporalio.client import Client

from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.deploy.kube_calls import KubeCall, Rbac, recording, request_info
from tests.deploy.manifests import OVERLAYS, SERVICE_ACCOUNTS, render
from tests.deploy.secrets_probe import ReadSecrets, list_secrets
from tests.support import finish, gpu_pool, incident_config, node_report, wait_for_child
from worker.config import load_settings
from worker.intake.topology import PoolTopology
from worker.worker import MAX_CONCURRENT_ACTIVITIES, build_worker

# Granted but not exercised by the gpu-node-loss recovery recorded here, each with the feature
# that needs it (and the test that exercises that feature).
NEEDED_ELSEWHERE = {
    (
        "worker",
        "delete",
        "",
        "pods",
    ): "retire a replaced pod / approved force-delete (tests/recovery, tests/scale_down)",
    (
        "worker",
        "patch",
        "",
        "pods/status",
    ): "ReadinessKeeper's readiness gates (tests/scale_down/test_readiness.py)",
    ("worker", "patch", "apps", "deployments/scale"): "scale-down and warm-floor rebuild of Deployments",
    ("worker", "get", "apps", "deployments"): "read a Deployment's replicas before scaling it",
    (
        "worker",
        "get",
        "leaderworkerset.x-k8s.io",
        "leaderworkersets",
    ): "multi-node replica groups (rank-lost)",
    ("worker", "patch", "leaderworkerset.x-k8s.io", "leaderworkersets/scale"): "scale LeaderWorkerSet groups",
    ("worker", "list", "", "events"): "bad-rollout evidence (image pull / crash events)",
    ("webhook", "get", "", "pods"): "alerts that name a pod (tests/webhook/test_routing_k8s.py)",
    # A lost node is unreachable: its qualification waits. The GPU-fault path runs it
    # (tests/recovery/test_hardware_path.py; run it with -p tests.deploy.rbac_audit).
    ("worker", "create", "batch", "jobs"): "qualification Job of a quarantined node",
    ("worker", "get", "batch", "jobs"): "read the qualification Job's outcome",
    ("worker", "delete", "batch", "jobs"): "delete the qualification Job once read",
    ("worker", "get", "", "pods/log"): "read the DCGM report from the qualification pod's log",
    **{
        ("gateway", verb, group, resource): "the gateway control plane's routing set (test below)"
        for group, resource in (("", "services"), ("", "pods"), ("discovery.k8s.io", "endpointslices"))
        for verb in ("list", "watch")
    },
    ("worker", "watch", "", "nodes"): "the fast path's Node informer (tests/recovery/test_fast_path.py)",
    ("worker", "watch", "", "pods"): "the fast path's Pod informer (tests/recovery/test_fast_path.py)",
    (
        "worker",
        "watch",
        "discovery.k8s.io",
        "endpointslices",
    ): "the fast path's EndpointSlice informer (tests/recovery/test_fast_path.py)",
    ("worker", "get", "coordination.k8s.io", "leases"): "fast path leader election (tests/fastpath)",
    ("worker", "create", "coordination.k8s.io", "leases"): "fast path leader election (tests/fastpath)",
    ("worker", "update", "coordination.k8s.io", "leases"): "fast path leader election (tests/fastpath)",
}


def _info(method: str, url: str) -> tuple[str, ...]:
    resolved = request_info(method, url)
    assert resolved is not None
    return resolved


def test_the_recorder_resolves_requests_as_the_api_server_does() -> None:
    assert request_info("GET", "https://k/api/v1/namespaces/inference/pods?labelSelector=a") == (
        "list", "", "pods", "", "inference", ""
    )  # fmt: skip
    assert _info("PATCH", "https://k/api/v1/namespaces/inference/pods/p-1/status")[:4] == (
        "patch", "", "pods", "status"
    )  # fmt: skip
    assert request_info("GET", "https://k/api/v1/pods?fieldSelector=spec.nodeName%3Dn") == (
        "list", "", "pods", "", "", ""
    )  # fmt: skip
    assert _info("GET", "https://k/apis/apps/v1/namespaces/x/deployments/d/scale")[:4] == (
        "get", "apps", "deployments", "scale"
    )  # fmt: skip
    assert _info("GET", "https://k/api/v1/nodes?watch=true")[0] == "watch"
    assert _info("DELETE", "https://k/api/v1/namespaces/x/pods")[0] == "deletecollection"
    assert request_info("GET", "https://k/api/v1") is None  # discovery


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_real_recovery_and_the_webhook_lookups_stay_within_the_shipped_rbac(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    with recording() as recorder:
        async with gpu_pool(temporal_client, task_queue, ledger_url) as rig:
            topology = PoolTopology.from_settings(rig.settings)
            before = await topology.groups_on_node("gpu-node-0")  # what the webhook does for a node alert
            assert before
            assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
            incident = await rig.report_loss(node_report("gpu-node-0"), incident_config())
            status = await finish(await wait_for_child(temporal_client, incident))
            assert status.phase == Phase.DONE
            survivor = next(g for g in await topology.groups_on_node("gpu-node-1"))
            assert await topology.groups_of_pod(survivor.pool.namespace, survivor.pods[0])  # a pod alert
    calls = recorder.distinct()
    assert {"worker", "webhook"} <= {c.component for c in calls}
    objects = {overlay: render(overlay) for overlay in OVERLAYS}
    for overlay, rendered in objects.items():
        rbac = Rbac(rendered, SERVICE_ACCOUNTS)
        assert rbac.denied(calls) == [], overlay
        unused = rbac.unused(calls)
        unexplained = [line for line in unused if not any(_names(key, line) for key in NEEDED_ELSEWHERE)]
        assert unexplained == [], (overlay, unexplained)


def _names(key: tuple[str, str, str, str], line: str) -> bool:
    component, verb, group, resource = key
    return f"grants {verb} {resource} ({group or 'core'}) that {component} never called" in line


async def test_a_call_outside_the_role_fails_and_names_the_rule(
    temporal_client: Client, task_queue: str
) -> None:
    """A worker activity that reads Secrets (nothing in fleetmend needs them): the audit must refuse it."""
    from sim.runner import start_sim
    from sim.scenario import shipped_scenarios

    sim = await asyncio.to_thread(start_sim, shipped_scenarios()["gpu-node-loss"], 1.0, serving=False)
    try:
        settings = load_settings(
            temporal_address=temporal_client.service_client.config.target_host,
            task_queue=task_queue,
            kubeconfig=sim.kubeconfig,
            worker_metrics_port=0,
        )
        with (
            recording() as recorder,
            ThreadPoolExecutor(MAX_CONCURRENT_ACTIVITIES, thread_name_prefix="fleetmend-activity") as pool,
        ):
            worker = build_worker(
                temporal_client,
                settings,
                activity_executor=pool,
                workflows=[ReadSecrets],
                activities=[list_secrets],
            )
            async with worker:
                await temporal_client.execute_workflow(
                    ReadSecrets.run,
                    str(sim.kubeconfig),
                    id=f"read-secrets-{uuid.uuid4().hex[:8]}",
                    task_queue=task_queue,
                    execution_timeout=timedelta(seconds=60),
                )
    finally:
        await asyncio.to_thread(sim.stop)
    calls = recorder.distinct()
    assert KubeCall("worker", "list", "", "secrets", "", "inference") in calls
    for overlay in OVERLAYS:
        denied = Rbac(render(overlay), SERVICE_ACCOUNTS).denied(calls)
        assert denied == [
            "RBAC denies fleetmend/fleetmend-worker (worker): list secrets (core) in namespace inference; "
            "needs {apiGroups: [''], resources: [secrets], verbs: [list]} in a Role/RoleBinding in namespace inference"
        ], overlay


def test_the_gateway_control_plane_reads_only_what_its_role_grants() -> None:
    """The control plane's cluster-wide lists (Services, EndpointSlices, labelled Pods), recorded
    against the simulated API server: all allowed, every rule of fleetmend-gateway used."""
    from gateway.run import hosts_reader
    from sim.runner import start_sim
    from sim.scenario import shipped_scenarios

    sim = start_sim(shipped_scenarios()["gpu-node-loss"], 1.0, serving=False)
    try:
        with recording() as recorder:
            read = hosts_reader(sim.kubeconfig, None)
            assert "inference/llama" in read()
            deadline = time.monotonic() + 10
            while len({c.resource for c in recorder.distinct() if c.verb == "watch"}) < 3:
                assert time.monotonic() < deadline, recorder.distinct()
                time.sleep(0.05)  # until all three watches are open
            read.stop()
    finally:
        sim.stop()
    calls = recorder.distinct()
    assert {(c.verb, c.group, c.resource) for c in calls} == {
        (verb, group, resource)
        for group, resource in (("", "services"), ("", "pods"), ("discovery.k8s.io", "endpointslices"))
        for verb in ("list", "watch")
    }
    for overlay in OVERLAYS:
        rbac = Rbac(render(overlay), SERVICE_ACCOUNTS)
        assert rbac.denied(calls) == [], overlay
        assert [line for line in rbac.unused(calls) if "that gateway never called" in line] == [], overlay
