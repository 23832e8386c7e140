"""The shipped RBAC, enforced by the simulated API server and derived from its audit log.

The sim loads the rendered RBAC objects of ``deploy/k8s`` and each fleetmend component talks to it
with its own ServiceAccount's token (``worker.devstack.rbac_wiring``): a call outside the Roles is
the API server's 403, in whichever process made it. Every test-rig run of the suite copies its audit
events for the suite's report (``tests.deploy.rbac_audit``); the runs here are the representative
ones: the webhook's lookups, the gateway control plane's routing set, and a real replica-loss
recovery with the fast path on. Each ends with the report derived from the audit log: every call
allowed, and every grant of the component it exercised used by a call.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from temporalio.client import Client

from activities.kube_reads import get_service
from fleet.recovery import Phase
from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE, FaultKind
from kube.client import kube_apis
from sim.k8s.audit import read_events
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.deploy.manifests import OVERLAYS, render
from tests.deploy.rbac_report import RbacReport, build_report
from tests.support import FAST, finish, gpu_pool, incident_config, node_report, wait_for_child
from worker.devstack.rbac_wiring import COMPONENTS, grant_components
from worker.devstack.rig import keep_audit_events
from worker.intake.topology import PoolTopology

Obj = dict[str, Any]
OVERLAY = "in-cluster-temporal"


@dataclass(frozen=True)
class Address:
    """A ``kube.client.ClusterAddress``: one component's kubeconfig."""

    kubeconfig: Path | None
    kube_context: str | None = None


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[RunningSim]:
    """The Kubernetes side of gpu-node-loss; its audit log (``tmp_path/audit.log``) outlives it and
    joins the suite's RBAC report."""
    running = _start(tmp_path)
    try:
        yield running
    finally:
        running.stop()
        keep_audit_events(running.audit_log)  # for the suite's report (tests.deploy.rbac_audit)


@pytest.fixture
def private_sim(tmp_path: Path) -> Iterator[RunningSim]:
    """Like ``sim``, kept out of the suite's report (its 403s are deliberate)."""
    running = _start(tmp_path)
    try:
        yield running
    finally:
        running.stop()


def _start(tmp_path: Path, scenario: str = "gpu-node-loss") -> RunningSim:
    return start_sim(shipped_scenarios()[scenario], 1.0, serving=False, kubeconfig=tmp_path / "kubeconfig")


def _report(sim: Any, objects: list[Obj]) -> RbacReport:
    assert sim.audit_log is not None
    report = build_report(objects, COMPONENTS, read_events(Path(sim.audit_log)))
    print("\n".join(report.lines()))  # the report, in the test's output
    return report


def _unused(report: RbacReport, component: str) -> list[str]:
    return [g.describe() for g in report.unused if g.component == component]


def _without(objects: list[Obj], kind: str, name: str, resource: str, verb: str) -> list[Obj]:
    """The rendered objects with ``verb`` on ``resource`` taken out of one Role's rules."""
    changed = copy.deepcopy(objects)
    for obj in changed:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            for rule in obj["rules"]:
                if resource in rule["resources"] and verb in rule["verbs"]:
                    rule["verbs"] = [v for v in rule["verbs"] if v != verb]
                    return changed
    raise AssertionError(f"{kind}/{name} grants no {verb} {resource}")


def test_a_removed_grant_is_a_403_naming_the_missing_rule(private_sim: RunningSim) -> None:
    """deploy/k8s rendered with ``get services`` taken out of the worker's pool Role: the worker's
    read of its pool's Service (every recovery's first step) is refused with the rule it lacks."""
    objects = render(OVERLAY)
    kubeconfigs = grant_components(
        Path(private_sim.kubeconfig),
        _without(objects, "ClusterRole", "fleetmend-worker-pool", "services", "get"),
    )
    worker = kube_apis(Address(kubeconfigs["worker"]))
    with pytest.raises(ApiException) as refused:
        get_service(worker, "inference", "llama")
    assert refused.value.status == 403
    missing = (
        'User "system:serviceaccount:fleetmend:fleetmend-worker" cannot get resource "services" '
        'in API group "" in the namespace "inference"'
    )
    assert json.loads(str(refused.value.body))["message"] == f'services "llama" is forbidden: {missing}'
    assert _report(private_sim, objects).denied == [f'worker: services "llama" is forbidden: {missing}']
    # The Role as shipped allows it.
    grant_components(Path(private_sim.kubeconfig), objects)
    assert get_service(worker, "inference", "llama")["metadata"]["name"] == "llama"


async def test_the_webhooks_lookups_use_every_grant_of_its_role_and_nothing_else(sim: RunningSim) -> None:
    objects = render(OVERLAY)
    kubeconfigs = grant_components(Path(sim.kubeconfig), objects)
    webhook = Address(kubeconfigs["webhook"])
    topology = PoolTopology(lambda: kube_apis(webhook), router_label=ROUTER_LABEL)
    groups = await topology.groups_on_node("gpu-node-0")  # a node alert
    assert groups
    assert await topology.groups_of_pod(groups[0].pool.namespace, groups[0].pods[0])  # a pod alert
    report = _report(sim, objects)
    assert report.denied == []
    assert _unused(report, "webhook") == []


def test_the_gateway_control_plane_uses_every_grant_of_its_role_and_nothing_else(sim: RunningSim) -> None:
    from kubernetes import client, config

    from gateway.run import hosts_reader

    objects = render(OVERLAY)
    kubeconfigs = grant_components(Path(sim.kubeconfig), objects)
    admin = config.new_client_from_config(config_file=str(sim.kubeconfig))
    core, discovery = client.CoreV1Api(admin), client.DiscoveryV1Api(admin)
    routed = core.list_namespaced_pod("inference", label_selector=f"{ROUTER_LABEL}={ROUTER_LABEL_VALUE}")
    pod = str(routed.items[0].metadata.name)  # type: ignore[union-attr]
    slices = discovery.list_namespaced_endpoint_slice("inference")
    slice_ = str(slices.items[0].metadata.name)  # type: ignore[union-attr]
    touch = {"metadata": {"annotations": {"fleetmend.test/touched": "yes"}}}
    read = hosts_reader(kubeconfigs["gateway"], None)
    try:
        assert "inference/llama" in read()
        # Each of its three watches is open: a change to each kind reaches the routing set.
        for change in (
            lambda: core.patch_namespaced_service("llama", "inference", touch),
            lambda: core.patch_namespaced_pod(pod, "inference", touch),
            lambda: discovery.patch_namespaced_endpoint_slice(slice_, "inference", touch),
        ):
            seen = read.generation
            change()
            _until(functools.partial(_moved_on, read, seen), "the gateway's watch saw the change")
    finally:
        read.stop()
    sim.stop()  # the open watches end, and are audited
    report = _report(sim, objects)
    assert report.denied == []
    assert _unused(report, "gateway") == []


def _moved_on(read: Any, seen: int) -> bool:
    return bool(read.generation > seen)


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("scenario", "kind"), [("gpu-node-loss", "Deployment"), ("rank-lost", "LeaderWorkerSet")]
)
def test_the_scale_effect_and_its_probe_use_the_workers_scale_and_read_grants(
    tmp_path: Path, scenario: str, kind: str
) -> None:
    """The worker's ``ScaleWorkload`` effect as the worker's ServiceAccount: the absolute scale through
    the ``scale`` subresource, and the probe that reads the workload back after an ambiguous answer
    (a timeout), for both workload kinds fleetmend scales."""
    from kubernetes import client, config

    from activities.world_effects import ScaleWorkload
    from kube.client import LWS_GROUP, LWS_PLURAL, LWS_VERSION
    from ledger.effect import Attempt

    running = _start(tmp_path, scenario)
    try:
        objects = render(OVERLAY)
        kubeconfigs = grant_components(Path(running.kubeconfig), objects)
        admin = config.new_client_from_config(config_file=str(running.kubeconfig))
        if kind == "Deployment":
            name = str(client.AppsV1Api(admin).list_namespaced_deployment("inference").items[0].metadata.name)  # type: ignore[union-attr]
        else:
            listed: Any = client.CustomObjectsApi(admin).list_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, "inference", LWS_PLURAL
            )
            name = str(listed["items"][0]["metadata"]["name"])
        worker = kube_apis(Address(kubeconfigs["worker"]))
        effect = ScaleWorkload(worker, kind, "inference", name, 4)
        attempt = Attempt(op_id="op-rbac", kind="scale", target=name, params={}, fence=1, attempt=1)
        assert effect.apply(attempt)["replicas"] == 4
        assert (effect.probe(attempt) or {}).get("found_by_probe") is True
    finally:
        running.stop()
        keep_audit_events(running.audit_log)
    report = _report(running, objects)
    assert report.denied == []
    group, plural = ("apps", "deployments") if kind == "Deployment" else (LWS_GROUP, LWS_PLURAL)
    used = {(g.verb, g.group, g.resource) for g in report.grants if report.used.get(g)}
    assert {("patch", group, f"{plural}/scale"), ("get", group, plural)} <= used


FAST_PATH: dict[str, Any] = {
    "fastpath_enabled": True,
    "recovery_timings": FAST,
    "fastpath_health_timeout_s": 3.0,
    "fastpath_lease_duration_s": 3.0,
    "fastpath_renew_deadline_s": 2.0,
    "fastpath_retry_period_s": 0.5,
    "fastpath_watch_timeout_s": 5,
}


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_real_recovery_with_the_fast_path_stays_within_the_workers_role(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """A node lost under a worker with its fast path, as the worker's ServiceAccount: the recovery
    completes, no call is refused, and the fast path used every grant it has (Lease, informers)."""
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH) as rig:
        assert rig.settings.kubeconfig == rig.kubeconfigs["worker"]
        async with rig.fast_path():
            assert (await rig.inject(FaultKind.NODE_LOST, "gpu-node-0"))["accepted"]
            incident = await rig.report_loss(node_report("gpu-node-0"), incident_config())
            status = await finish(await wait_for_child(temporal_client, incident))
            assert status.phase == Phase.DONE
        await asyncio.to_thread(rig.sim.stop)  # the open watches end, and are audited
        report = _report(rig.sim, render(OVERLAY))
    assert report.denied == []
    fast_path = [
        line for line in _unused(report, "worker") if " leases " in line or line.startswith("worker: watch ")
    ]
    assert fast_path == []
    assert not [line for line in _unused(report, "worker") if "ClusterRole/fleetmend-worker-cluster" in line]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_binds_each_component_to_the_same_grants(overlay: str) -> None:
    """The report's grants are the rendered overlay's: the sim is loaded with the same objects."""
    from tests.deploy.rbac_report import grant_rules
    from worker.devstack.rbac_wiring import shipped_rbac_objects

    rendered = {
        (g.component, g.verb, g.group, g.resource, g.namespace)
        for g in grant_rules(render(overlay), COMPONENTS)
    }
    shipped = {
        (g.component, g.verb, g.group, g.resource, g.namespace)
        for g in grant_rules(shipped_rbac_objects(), COMPONENTS)
    }
    assert rendered == shipped
    assert {g[0] for g in rendered} == set(COMPONENTS)
