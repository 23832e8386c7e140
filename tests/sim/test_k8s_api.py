"""The simulated API through the official ``kubernetes`` client: shapes, errors, patches, auth, action log."""

from __future__ import annotations

import json
import ssl
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
from kubernetes.client import V1DeleteOptions, V1Eviction, V1ObjectMeta
from kubernetes.client.exceptions import ApiException, ConflictException, NotFoundException
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from fleet.vocabulary import GPU_RESOURCE, ROUTER_LABEL, SERVING_READY_CONDITION
from tests.sim.support import K8S_VERSION, Kube, assert_valid_objects, wait_for

NS = "inference"
LWS = ("leaderworkerset.x-k8s.io", "v1", NS, "leaderworkersets")


def _raw(response: Any) -> dict[str, Any]:
    return json.loads(response.data)


def _validate_status(body: dict[str, Any]) -> None:
    """``Status`` has no kind/apiVersion-keyed schema file in kubernetes-validate; use its meta/v1 schema."""
    schema_dir = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
    schema = schema_contents(f"{schema_dir}/status-meta-v1.json", K8S_VERSION)
    definitions = schema_contents(f"{schema_dir}/_definitions.json", K8S_VERSION)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(body)


def serving_pods(kube: Kube, selector: str = "fleetmend.io/role=serving") -> list[Any]:
    return kube.core.list_namespaced_pod(NS, label_selector=selector).items


def test_every_returned_object_validates_against_the_kubernetes_openapi_schemas(kube: Kube) -> None:
    node_name = kube.core.list_node().items[0].metadata.name
    kube.core.patch_node(node_name, {"spec": {"unschedulable": True}})  # adds a taint worth validating
    assert assert_valid_objects(kube) > 20
    scale = _raw(kube.apps.read_namespaced_deployment_scale("llama", NS, _preload_content=False))
    kubernetes_validate.validate(scale, K8S_VERSION, strict=True)
    with pytest.raises(NotFoundException) as missing:
        kube.core.read_namespaced_pod("no-such-pod", NS)
    _validate_status(json.loads(missing.value.body))


def test_label_and_field_selectors(kube: Kube) -> None:
    all_pods = kube.core.list_namespaced_pod(NS).items
    assert len(all_pods) == 6
    assert len(serving_pods(kube)) == 5
    assert len(serving_pods(kube, "fleetmend.io/role in (spare)")) == 1
    assert len(serving_pods(kube, "fleetmend.io/role notin (spare),fleetmend.io/model=llama-70b")) == 5
    assert len(serving_pods(kube, f"!{ROUTER_LABEL}")) == 1
    assert len(serving_pods(kube, f"{ROUTER_LABEL}")) == 5
    assert len(serving_pods(kube, "fleetmend.io/role!=serving")) == 1
    on_node0 = kube.core.list_namespaced_pod(NS, field_selector="spec.nodeName=gpu-node-0").items
    assert on_node0 and all(p.spec.node_name == "gpu-node-0" for p in on_node0)
    everywhere = kube.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-node-0").items
    # Every namespace's: the pool's pods, and one pod of each node-agent DaemonSet.
    assert {p.metadata.name for p in everywhere if p.metadata.namespace == NS} == {
        p.metadata.name for p in on_node0
    }
    agents = [p for p in everywhere if p.metadata.namespace != NS]
    assert len(agents) == 3 and all(p.metadata.owner_references[0].kind == "DaemonSet" for p in agents)
    with pytest.raises(ApiException) as bad:
        kube.core.list_namespaced_pod(NS, field_selector="spec.hostname=x")
    assert bad.value.status == 400 and "field label not supported" in json.loads(bad.value.body)["message"]


def test_requests_without_the_kubeconfig_token_get_401(kube: Kube) -> None:
    api = kube.sim.kube_url
    ca = ssl.create_default_context(cafile=str(kube.sim.ca_cert))
    assert httpx.get(f"{api}/api/v1/namespaces/{NS}/pods", verify=ca).status_code == 401
    wrong = httpx.get(
        f"{api}/apis/apps/v1/namespaces/{NS}/deployments",
        headers={"Authorization": "Bearer nope"},
        verify=ca,
    )
    assert wrong.status_code == 401 and wrong.json()["reason"] == "Unauthorized"
    assert httpx.get(f"{api}/healthz", verify=ca).text == "ok"  # health and version are open
    assert httpx.get(f"{api}/version", verify=ca).json()["gitVersion"].startswith("v1.37.")
    # TLS is verified against the kubeconfig's CA; the Kubernetes API is not served over plain HTTP.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{api}/version")
    assert httpx.get(f"{kube.sim.base_url}/api/v1/namespaces/{NS}/pods").status_code == 404
    assert httpx.get(f"{kube.sim.base_url}/sim/v1/clock").status_code == 200  # the sim's own API is open


def test_stale_resource_version_gets_409_conflict(kube: Kube) -> None:
    pod = serving_pods(kube)[0]
    stale = pod.metadata.resource_version
    kube.core.patch_namespaced_pod(pod.metadata.name, NS, {"metadata": {"annotations": {"touched": "yes"}}})
    pod.metadata.annotations = {"touched": "again"}
    with pytest.raises(ConflictException) as replaced:
        kube.core.replace_namespaced_pod(pod.metadata.name, NS, pod)
    status = json.loads(replaced.value.body)
    assert status["reason"] == "Conflict" and status["details"] == {"name": pod.metadata.name, "kind": "pods"}
    assert "the object has been modified" in status["message"]
    with pytest.raises(ConflictException):
        kube.core.patch_namespaced_pod(
            pod.metadata.name, NS, {"metadata": {"resourceVersion": stale, "labels": {"x": "y"}}}
        )
    deployment = kube.apps.read_namespaced_deployment("llama", NS)
    kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": 6}})
    deployment.metadata.resource_version = "1"
    with pytest.raises(ConflictException) as grouped:
        kube.apps.replace_namespaced_deployment("llama", NS, deployment)
    assert json.loads(grouped.value.body)["details"]["group"] == "apps"
    fresh = kube.core.read_namespaced_pod(pod.metadata.name, NS)
    assert fresh.metadata.annotations["touched"] == "yes" and "x" not in (fresh.metadata.labels or {})


def test_patch_content_types_on_pods(kube: Kube) -> None:
    name = serving_pods(kube)[0].metadata.name
    # default for a dict body: strategic merge; ownerReferences merge by uid, $patch: delete
    kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"team": "a"}}})
    kube.core.patch_namespaced_pod(
        name, NS, {"metadata": {"labels": {"team": "b"}}}, _content_type="application/merge-patch+json"
    )
    kube.core.patch_namespaced_pod(
        name, NS, [{"op": "add", "path": "/metadata/labels/tier", "value": "gold"}]
    )
    labels = kube.core.read_namespaced_pod(name, NS).metadata.labels
    assert labels["team"] == "b" and labels["tier"] == "gold" and labels[ROUTER_LABEL] == "true"
    with pytest.raises(ApiException) as failed_test:
        kube.core.patch_namespaced_pod(
            name, NS, [{"op": "test", "path": "/metadata/labels/tier", "value": "silver"}]
        )
    assert failed_test.value.status == 422
    with pytest.raises(ApiException) as bad_label:
        kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"team": "not valid!"}}})
    assert bad_label.value.status == 422 and json.loads(bad_label.value.body)["reason"] == "Invalid"
    with pytest.raises(ApiException) as immutable:
        kube.core.patch_namespaced_pod(name, NS, {"spec": {"nodeName": "gpu-node-3"}})
    assert immutable.value.status == 422


def test_pod_status_patch_merges_conditions_by_type_and_drives_readiness(kube: Kube) -> None:
    pod = serving_pods(kube)[0]
    name = pod.metadata.name
    before = {c.type for c in pod.status.conditions}
    body = {
        "status": {
            "conditions": [{"type": SERVING_READY_CONDITION, "status": "False", "reason": "KVSaturated"}]
        }
    }
    kube.core.patch_namespaced_pod_status(name, NS, body)
    patched = kube.core.read_namespaced_pod(name, NS)
    conditions = {c.type: c for c in patched.status.conditions}
    assert set(conditions) == before  # merged by type, nothing dropped
    assert conditions[SERVING_READY_CONDITION].status == "False"
    wait_for(
        lambda: (
            {c.type: c for c in kube.core.read_namespaced_pod(name, NS).status.conditions}["Ready"].reason
            == "ReadinessGatesNotReady"
        ),
        what="Ready=False from the readiness gate",
    )
    ready = {c.type: c for c in kube.core.read_namespaced_pod(name, NS).status.conditions}["Ready"]
    assert ready.status == "False" and SERVING_READY_CONDITION in ready.message
    kube.core.patch_namespaced_pod_status(
        name, NS, {"status": {"conditions": [{"type": SERVING_READY_CONDITION, "status": "True"}]}}
    )
    wait_for(
        lambda: (
            {c.type: c.status for c in kube.core.read_namespaced_pod(name, NS).status.conditions}["Ready"]
            == "True"
        ),
        what="Ready=True again",
    )


def test_eviction_honours_the_pdb_with_the_real_429_status(kube: Kube) -> None:
    first, second = (p.metadata.name for p in serving_pods(kube)[:2])
    eviction = lambda name: V1Eviction(  # noqa: E731
        metadata=V1ObjectMeta(name=name, namespace=NS),
        delete_options=V1DeleteOptions(grace_period_seconds=30),
    )
    kube.core.create_namespaced_pod_eviction(first, NS, eviction(first))
    evicted = kube.core.read_namespaced_pod(first, NS)
    assert evicted.metadata.deletion_timestamp is not None
    assert any(
        c.type == "DisruptionTarget" and c.reason == "EvictionByEvictionAPI"
        for c in evicted.status.conditions
    )
    with pytest.raises(ApiException) as blocked:
        kube.core.create_namespaced_pod_eviction(second, NS, eviction(second))
    assert blocked.value.status == 429
    status = json.loads(blocked.value.body)
    assert status == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Cannot evict pod as it would violate the pod's disruption budget.",
        "reason": "TooManyRequests",
        "details": {
            "causes": [
                {
                    "reason": "DisruptionBudget",
                    "message": "The disruption budget llama needs 4 healthy pods and has 4 currently",
                }
            ]
        },
        "code": 429,
    }
    _validate_status(status)
    assert kube.core.read_namespaced_pod(second, NS).metadata.deletion_timestamp is None


def test_graceful_delete_sets_deletion_timestamp_then_the_pod_goes(kube: Kube) -> None:
    name = serving_pods(kube)[0].metadata.name
    deleted = kube.core.delete_namespaced_pod(name, NS, grace_period_seconds=10)
    assert (
        deleted.metadata.deletion_timestamp is not None
        and deleted.metadata.deletion_grace_period_seconds == 10
    )

    def gone() -> bool:
        try:
            kube.core.read_namespaced_pod(name, NS)
        except NotFoundException:
            return True
        return False

    wait_for(gone, timeout=5, what="the pod to finish terminating (10 sim s)")


def test_deployment_scale_subresource_and_status(kube: Kube) -> None:
    scale = kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": 4}})
    assert scale.spec.replicas == 4 and "fleetmend.io/role=serving" in scale.status.selector
    wait_for(
        lambda: kube.apps.read_namespaced_deployment("llama", NS).status.ready_replicas == 4,
        what="4 ready replicas",
    )
    deployment = kube.apps.read_namespaced_deployment("llama", NS)
    assert deployment.status.observed_generation == deployment.metadata.generation == 2
    with pytest.raises(ApiException) as negative:
        kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": -1}})
    assert negative.value.status == 422


def test_cordon_sets_unschedulable_and_the_taint(kube: Kube) -> None:
    kube.core.patch_node("gpu-node-3", {"spec": {"unschedulable": True}})
    node = wait_for(
        lambda: (n := kube.core.read_node("gpu-node-3")).spec.taints and n, what="the unschedulable taint"
    )
    assert node.spec.unschedulable is True
    assert [(t.key, t.effect) for t in node.spec.taints] == [
        ("node.kubernetes.io/unschedulable", "NoSchedule")
    ]
    running_there = kube.core.list_namespaced_pod(NS, field_selector="spec.nodeName=gpu-node-3").items
    assert all(p.metadata.deletion_timestamp is None for p in running_there)
    kube.core.patch_node("gpu-node-3", {"spec": {"unschedulable": False}})
    wait_for(lambda: not kube.core.read_node("gpu-node-3").spec.taints, what="the taint to go")


@pytest.mark.parametrize("sim_server", ["rank-lost"], indirect=True)
def test_leaderworkerset_custom_resource_patches(kube: Kube) -> None:
    lws = kube.custom.get_namespaced_custom_object(*LWS, "llama-405b")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    with pytest.raises(ApiException) as smp:
        kube.custom.patch_namespaced_custom_object(
            *LWS,
            "llama-405b",
            {"spec": {"replicas": 3}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert smp.value.status == 415
    status = json.loads(smp.value.body)
    assert status["reason"] == "UnsupportedMediaType"
    assert (
        "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"
        in status["message"]
    )
    patched = kube.custom.patch_namespaced_custom_object(
        *LWS, "llama-405b", {"metadata": {"labels": {"tier": "gold"}}}
    )
    assert patched["metadata"]["labels"]["tier"] == "gold"
    scale = kube.custom.patch_namespaced_custom_object_scale(*LWS, "llama-405b", {"spec": {"replicas": 3}})
    assert scale["spec"]["replicas"] == 3
    wait_for(
        lambda: (
            len(
                kube.core.list_namespaced_pod(
                    NS, label_selector="leaderworkerset.sigs.k8s.io/group-index=2"
                ).items
            )
            == 2
        ),
        what="group 2's leader and worker",
    )
    lws = kube.custom.get_namespaced_custom_object(*LWS, "llama-405b")
    lws["metadata"].pop("resourceVersion")
    with pytest.raises(ApiException) as no_rv:
        kube.custom.replace_namespaced_custom_object(*LWS, "llama-405b", lws)
    assert no_rv.value.status == 422


def test_action_log_records_every_mutation_with_client_identity(kube: Kube) -> None:
    base = kube.sim.base_url
    start = len(httpx.get(f"{base}/sim/v1/actions").json())
    name = serving_pods(kube)[0].metadata.name
    kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"audit": "1"}}})
    kube.core.read_namespaced_pod(name, NS)  # reads are not actions
    with pytest.raises(NotFoundException):
        kube.core.delete_namespaced_pod("ghost", NS)
    httpx.post(f"{base}/v1/completions", json={"prompt": "hi"})  # inference is not an action on the world
    entries = httpx.get(f"{base}/sim/v1/actions", params={"since_seq": start}).json()
    assert [(e["verb"], e["status"]) for e in entries] == [("PATCH", 200), ("DELETE", 404)]
    patch = entries[0]
    assert patch["path"] == f"/api/v1/namespaces/{NS}/pods/{name}"
    assert patch["client"].startswith("sim-admin/OpenAPI-Generator/")
    assert patch["body_digest"].startswith("sha256:") and patch["seq"] == start + 1


def test_api_fault_knobs_fail_chosen_verbs(kube: Kube) -> None:
    base = kube.sim.base_url
    rules = {
        "rules": [
            {"verbs": ["PATCH"], "path_contains": "/pods/", "error": "500", "count": 1},
            {"verbs": ["POST"], "path_contains": "/eviction", "error": "429", "rate": 1.0},
        ]
    }
    assert httpx.put(f"{base}/sim/v1/api-faults", json=rules).status_code == 200
    name = serving_pods(kube)[0].metadata.name
    with pytest.raises(ApiException) as server_error:
        kube.core.patch_namespaced_pod(name, NS, {"metadata": {"labels": {"a": "b"}}})
    assert server_error.value.status == 500
    kube.core.patch_namespaced_pod(
        name, NS, {"metadata": {"labels": {"a": "b"}}}
    )  # count=1: the retry succeeds
    with pytest.raises(ApiException) as throttled:
        kube.core.create_namespaced_pod_eviction(
            name, NS, V1Eviction(metadata=V1ObjectMeta(name=name, namespace=NS))
        )
    assert throttled.value.status == 429 and throttled.value.headers["Retry-After"] == "1"
    assert kube.core.read_namespaced_pod(name, NS).metadata.deletion_timestamp is None
    assert kube.core.read_node("gpu-node-0").status.allocatable[GPU_RESOURCE] == "8"
