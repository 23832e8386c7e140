"""Workload controllers and EndpointSlices as fleetmend relies on them, through the official client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client, config

from fleet.vocabulary import ROLE_LABEL, ROUTER_LABEL, SERVING_READY_CONDITION
from sim.runner import start_sim
from sim.scenario import load_scenario, shipped_scenarios
from tests.sim.support import TEST_SPEED, Kube, assert_valid_objects, wait_for

NS = "inference"
MERGE = "application/merge-patch+json"


def pods(kube: Kube, selector: str = "app.kubernetes.io/name=llama") -> list[Any]:
    return kube.core.list_namespaced_pod(NS, label_selector=selector).items


def endpoint_conditions(kube: Kube, service: str = "llama") -> dict[str, tuple[bool, bool, bool]]:
    (endpoint_slice,) = kube.discovery.list_namespaced_endpoint_slice(
        NS, label_selector=f"kubernetes.io/service-name={service}"
    ).items
    return {
        e.target_ref.name: (e.conditions.ready, e.conditions.serving, e.conditions.terminating)
        for e in endpoint_slice.endpoints or []
    }


def test_relabeling_a_pod_off_the_selector_orphans_it_and_a_replacement_appears(kube: Kube) -> None:
    victim = pods(kube, "fleetmend.io/role=serving")[0]
    name, node, ip = victim.metadata.name, victim.spec.node_name, victim.status.pod_ip
    assert victim.metadata.owner_references[0].kind == "ReplicaSet"
    kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {ROLE_LABEL: "quarantined"}}})
    orphan = wait_for(
        lambda: (p := kube.core.read_namespaced_pod(name, NS)).metadata.owner_references is None and p,
        what="the ReplicaSet to release the pod",
    )
    assert orphan.metadata.deletion_timestamp is None and orphan.status.phase == "Running"
    assert (orphan.spec.node_name, orphan.status.pod_ip) == (
        node,
        ip,
    )  # keeps running where it was, with its GPUs
    replacement = wait_for(
        lambda: [
            p
            for p in pods(kube, "fleetmend.io/role=serving")
            if p.metadata.name != name and p.metadata.creation_timestamp > victim.metadata.creation_timestamp
        ],
        what="a replacement pod",
    )
    assert len(pods(kube, "fleetmend.io/role=serving")) == 5
    assert replacement[0].metadata.owner_references[0].name == victim.metadata.owner_references[0].name
    wait_for(
        lambda: kube.apps.read_namespaced_deployment("llama", NS).status.ready_replicas == 5,
        what="5 ready replicas again",
    )
    events = kube.core.list_namespaced_event(NS, field_selector="reason=SuccessfulCreate").items
    assert any(replacement[0].metadata.name in e.message for e in events)


@pytest.fixture
def router_only_service() -> Iterator[Kube]:
    """gpu-node-loss with a Service that selects the router-only label (the Deployment does not)."""
    scenario = load_scenario(shipped_scenarios()["gpu-node-loss"])
    workload = scenario.workloads[0].model_copy(
        update={"service": scenario.workloads[0].service.model_copy(update={"select_router_label": True})}
    )
    running = start_sim(
        scenario.model_copy(update={"workloads": [workload]}), speed=TEST_SPEED, serving=False
    )
    api_client = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    try:
        yield Kube(
            api_client,
            client.CoreV1Api(api_client),
            client.AppsV1Api(api_client),
            client.DiscoveryV1Api(api_client),
            client.PolicyV1Api(api_client),
            client.CustomObjectsApi(api_client),
            running,
        )
    finally:
        api_client.close()
        running.stop()


def test_removing_the_router_only_label_changes_only_the_service_endpoints(router_only_service: Kube) -> None:
    kube = router_only_service
    assert len(endpoint_conditions(kube)) == 5  # the spare has no router label: not in this Service
    before = {p.metadata.name: p.metadata.uid for p in pods(kube)}
    victim = pods(kube, "fleetmend.io/role=serving")[0].metadata.name
    kube.core.patch_namespaced_pod(
        victim, NS, {"metadata": {"labels": {ROUTER_LABEL: None}}}, _content_type=MERGE
    )
    wait_for(lambda: victim not in endpoint_conditions(kube), what="the endpoint to leave the slice")
    assert len(endpoint_conditions(kube)) == 4
    pod = kube.core.read_namespaced_pod(victim, NS)
    assert pod.metadata.owner_references and pod.metadata.owner_references[0].kind == "ReplicaSet"
    assert {p.metadata.name: p.metadata.uid for p in pods(kube)} == before  # no orphan, no replacement
    assert kube.apps.read_namespaced_deployment("llama", NS).status.ready_replicas == 5


@pytest.mark.parametrize("sim_server", ["router-label-selected"], indirect=True)
def test_router_label_in_the_controller_selector_makes_label_removal_orphan_the_pod(kube: Kube) -> None:
    selector = kube.apps.read_namespaced_deployment("llama", NS).spec.selector.match_labels
    assert selector[ROUTER_LABEL] == "true"
    victim = pods(kube, "fleetmend.io/role=serving")[0].metadata.name
    kube.core.patch_namespaced_pod(
        victim, NS, {"metadata": {"labels": {ROUTER_LABEL: None}}}, _content_type=MERGE
    )
    wait_for(
        lambda: kube.core.read_namespaced_pod(victim, NS).metadata.owner_references is None,
        what="the orphaning",
    )
    wait_for(
        lambda: len(pods(kube, f"fleetmend.io/role=serving,{ROUTER_LABEL}=true")) == 6, what="a replacement"
    )
    assert kube.core.read_namespaced_pod(victim, NS).status.phase == "Running"  # still holding its 4 GPUs


def test_endpointslice_conditions_follow_ready_serving_terminating(kube: Kube) -> None:
    serving = [p.metadata.name for p in pods(kube, "fleetmend.io/role=serving")]
    gated, terminating = serving[0], serving[1]
    assert set(endpoint_conditions(kube).values()) == {(True, True, False)}
    kube.core.patch_namespaced_pod_status(
        gated, NS, {"status": {"conditions": [{"type": SERVING_READY_CONDITION, "status": "False"}]}}
    )
    kube.core.delete_namespaced_pod(terminating, NS, grace_period_seconds=600)
    # The gated pod: neither ready nor serving. The deleting one, still Ready: serving but not ready, and
    # still listed. Two pods, two updates of the slice: both are waited for.
    wait_for(
        lambda: (
            (c := endpoint_conditions(kube)).get(gated) == (False, False, False)
            and c.get(terminating) == (False, True, True)
        ),
        what="the gated endpoint not ready and the deleting one serving-terminating",
    )
    # The replacement of the terminating pod is listed as soon as it has an IP, not ready while loading.
    conditions = wait_for(
        lambda: (c := endpoint_conditions(kube)) and len(c) == 7 and c, what="the replacement endpoint"
    )
    (new,) = set(conditions) - set(serving) - {p.metadata.name for p in pods(kube, "fleetmend.io/role=spare")}
    assert conditions[new] == (False, False, False)
    kube.core.patch_namespaced_service("llama", NS, {"spec": {"publishNotReadyAddresses": True}})
    wait_for(
        lambda: (
            (c := endpoint_conditions(kube))[gated] == (True, False, False)
            and c[terminating] == (True, True, True)
        ),
        what="publishNotReadyAddresses on both endpoints",
    )
    assert_valid_objects(kube)


def test_pods_without_an_ip_are_left_out_of_the_endpointslice(kube: Kube) -> None:
    kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": 8}})
    pending = wait_for(
        lambda: [
            p
            for p in pods(kube, "fleetmend.io/role=serving")
            if p.status.phase == "Pending" and not p.spec.node_name
        ],
        what="a pod that does not fit",
    )
    placed = wait_for(
        lambda: len(endpoint_conditions(kube)) == 8 and endpoint_conditions(kube),
        what="7 serving + 1 spare endpoints",
    )
    assert pending[0].metadata.name not in placed and pending[0].status.pod_ip is None


@pytest.mark.parametrize("sim_server", ["bad-rollout"], indirect=True)
def test_a_rollout_to_a_crashing_revision_stalls_with_crash_looping_pods(kube: Kube) -> None:
    new_pods = wait_for(
        lambda: pods(kube, "fleetmend.io/revision=r2"), timeout=10, what="the r2 rollout to start (60 sim s)"
    )
    assert (
        len(kube.apps.list_namespaced_replica_set(NS, label_selector="fleetmend.io/role=serving").items) == 2
    )
    crashed = wait_for(
        lambda: [
            s
            for p in pods(kube, "fleetmend.io/revision=r2")
            for s in p.status.container_statuses or []
            if s.restart_count >= 1
        ],
        timeout=15,
        what="an r2 container to crash after loading",
    )
    status = crashed[0]
    assert status.last_state.terminated.reason == "Error" and status.last_state.terminated.exit_code == 1
    # The Deployment's status follows the crash in its controller's next sync: waited for, not assumed.
    deployment = wait_for(
        lambda: (
            (d := kube.apps.read_namespaced_deployment("llama", NS)).status.ready_replicas == 5
            and d.status.unavailable_replicas == 1
            and d
        ),
        what="the Deployment to count 5 ready and 1 unavailable",
    )
    assert new_pods[0].spec.containers[0].image.endswith("v0.11.0")
    progressing = {c.type: c for c in deployment.status.conditions}["Progressing"]
    assert (progressing.status, progressing.reason) == ("True", "ReplicaSetUpdated")
    # No progress for progressDeadlineSeconds (600 s): the rollout is reported as failed.
    kube.sim.world.clock.advance(600)
    failed = wait_for(
        lambda: (
            (
                c := {c.type: c for c in kube.apps.read_namespaced_deployment("llama", NS).status.conditions}[
                    "Progressing"
                ]
            ).status
            == "False"
            and c
        ),
        what="ProgressDeadlineExceeded",
    )
    assert failed.reason == "ProgressDeadlineExceeded"
    assert (
        failed.message
        == f'ReplicaSet "{new_pods[0].metadata.owner_references[0].name}" has timed out progressing.'
    )


@pytest.mark.parametrize("sim_server", ["scale-down"], indirect=True)
def test_scaling_down_removes_the_pod_with_the_lowest_deletion_cost(kube: Kube) -> None:
    serving = pods(kube, "fleetmend.io/role=serving")
    assert len(serving) == 8
    victim = serving[3].metadata.name
    kube.core.patch_namespaced_pod(
        victim, NS, {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-100"}}}
    )
    kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": 7}})
    deleted = wait_for(
        lambda: [p.metadata.name for p in pods(kube) if p.metadata.deletion_timestamp], what="one pod deleted"
    )
    assert deleted == [victim]
    wait_for(lambda: len(pods(kube)) == 7, what="7 pods left")
