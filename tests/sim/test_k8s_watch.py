"""Watches, list paging, dry runs and the audit log, through the official Python client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes import client, config, watch
from kubernetes.client import V1ConfigMap, V1DeleteOptions, V1Eviction, V1ObjectMeta
from kubernetes.client.exceptions import ApiException

from sim.k8s.audit import rbac_rules, read_events
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.sim.support import TEST_SPEED, Kube

NS = "inference"
SPARE = "fleetmend.io/role=spare"


@pytest.fixture
def short_history() -> Iterator[tuple[RunningSim, client.CoreV1Api]]:
    """A sim whose watch history keeps only 20 events per resource (so a watch can fall behind)."""
    running = start_sim(
        shipped_scenarios()["gpu-node-loss"], speed=TEST_SPEED, serving=False, watch_history=20
    )
    api = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    try:
        yield running, client.CoreV1Api(api)
    finally:
        api.close()
        running.stop()


def _spare(core: client.CoreV1Api) -> str:
    return str(core.list_namespaced_pod(NS, label_selector=SPARE).items[0].metadata.name)


def test_watch_sees_every_change_in_order_from_a_listed_resource_version(kube: Kube) -> None:
    listed = kube.core.list_namespaced_pod(NS)
    spare = _spare(kube.core)
    for step in range(1, 6):
        kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"step": str(step)}}})
    w = watch.Watch()
    steps: list[str] = []
    versions: list[int] = []
    for event in w.stream(
        kube.core.list_namespaced_pod, NS, resource_version=listed.metadata.resource_version
    ):
        pod = event["object"]
        if pod.metadata.name != spare:
            continue
        assert event["type"] == "MODIFIED"
        steps.append(pod.metadata.labels["step"])
        versions.append(int(pod.metadata.resource_version))
        if len(steps) == 5:
            w.stop()
    assert steps == ["1", "2", "3", "4", "5"]
    assert versions == sorted(versions) and len(set(versions)) == 5
    assert w.resource_version == str(versions[-1])


def test_watch_recovers_from_410_gone_by_relisting(
    short_history: tuple[RunningSim, client.CoreV1Api],
) -> None:
    _, core = short_history
    spare = _spare(core)
    stale = core.list_namespaced_pod(NS).metadata.resource_version
    for step in range(30):  # more changes than the history keeps
        core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"step": str(step)}}})
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(core.list_namespaced_pod, NS, resource_version=stale):
            pass
    assert gone.value.status == 410 and "too old resource version" in str(gone.value.reason)
    # The informer's answer: list again, then watch from the fresh resourceVersion.
    fresh = core.list_namespaced_pod(NS)
    assert next(p for p in fresh.items if p.metadata.name == spare).metadata.labels["step"] == "29"
    core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"step": "after"}}})
    w = watch.Watch()
    for event in w.stream(core.list_namespaced_pod, NS, resource_version=fresh.metadata.resource_version):
        assert (event["type"], event["object"].metadata.labels["step"]) == ("MODIFIED", "after")
        w.stop()


def test_watch_list_initial_events_end_with_a_bookmark_and_selectors_filter(kube: Kube) -> None:
    names = sorted(p.metadata.name for p in kube.core.list_namespaced_pod(NS).items)
    w = watch.Watch()
    added: list[str] = []
    for event in w.stream(
        kube.core.list_namespaced_pod,
        NS,
        allow_watch_bookmarks=True,
        send_initial_events=True,
        resource_version_match="NotOlderThan",
        timeout_seconds=30,
    ):
        if event["type"] == "BOOKMARK":
            bookmark = event["raw_object"]
            assert bookmark["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
            assert int(bookmark["metadata"]["resourceVersion"]) > 0
            w.stop()
            break
        assert event["type"] == "ADDED"
        added.append(event["object"].metadata.name)
    assert sorted(added) == names
    # A change that makes an object stop matching the selector reaches the watch as DELETED.
    spare = _spare(kube.core)
    rv = kube.core.list_namespaced_pod(NS).metadata.resource_version
    kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"shard": "a"}}})
    kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"shard": "b"}}})
    w = watch.Watch()
    seen = []
    for event in w.stream(kube.core.list_namespaced_pod, NS, label_selector="shard=a", resource_version=rv):
        seen.append((event["type"], event["object"].metadata.labels.get("shard")))
        if len(seen) == 2:
            w.stop()
    assert seen == [("ADDED", "a"), ("DELETED", "b")]


def test_list_pages_with_continue_tokens_a_real_server_would_accept(kube: Kube) -> None:
    every = sorted(p.metadata.name for p in kube.core.list_namespaced_pod(NS).items)
    names: list[str] = []
    token = None
    pages = 0
    while True:
        page = kube.core.list_namespaced_pod(NS, limit=4, _continue=token)
        pages += 1
        names += [p.metadata.name for p in page.items]
        token = page.metadata._continue
        if not token:
            break
        assert page.metadata.remaining_item_count == len(every) - len(names)
    assert names == every and pages == 2
    with pytest.raises(ApiException) as bad:
        kube.core.list_namespaced_pod(NS, limit=4, _continue="not-a-token")
    assert bad.value.status == 400 and "continue key is not valid" in json.loads(bad.value.body)["message"]
    with pytest.raises(ApiException) as too_new:
        kube.core.list_namespaced_pod(NS, resource_version="999999999", resource_version_match="NotOlderThan")
    assert (
        too_new.value.status == 504
        and "Too large resource version" in json.loads(too_new.value.body)["message"]
    )


def test_dry_run_all_validates_answers_and_stores_nothing(kube: Kube) -> None:
    made = kube.core.create_namespaced_config_map(
        NS, V1ConfigMap(metadata=V1ObjectMeta(name="dry"), data={"a": "1"}), dry_run="All"
    )
    assert made.metadata.uid and made.metadata.creation_timestamp and not made.metadata.resource_version
    with pytest.raises(ApiException) as gone:
        kube.core.read_namespaced_config_map("dry", NS)
    assert gone.value.status == 404
    spare = _spare(kube.core)
    before = kube.core.read_namespaced_pod(spare, NS)
    patched = kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"x": "y"}}}, dry_run="All")
    assert (
        patched.metadata.labels["x"] == "y"
        and patched.metadata.resource_version == before.metadata.resource_version
    )
    deleted = kube.core.delete_namespaced_pod(spare, NS, dry_run="All")
    assert deleted.metadata.deletion_timestamp is not None  # what a graceful delete answers
    kube.core.create_namespaced_pod_eviction(
        spare,
        NS,
        V1Eviction(metadata=V1ObjectMeta(name=spare), delete_options=V1DeleteOptions(dry_run=["All"])),
    )
    after = kube.core.read_namespaced_pod(spare, NS)
    assert after.metadata.resource_version == before.metadata.resource_version
    assert after.metadata.deletion_timestamp is None and "x" not in after.metadata.labels
    with pytest.raises(ApiException) as bad:
        kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"x": "y"}}}, dry_run="Some")
    assert bad.value.status == 400


def test_every_request_is_an_audit_event_with_user_verb_and_object(kube: Kube) -> None:
    spare = _spare(kube.core)
    kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"audited": "yes"}}})
    kube.core.patch_namespaced_pod(spare, NS, {"metadata": {"labels": {"dry": "run"}}}, dry_run="All")
    kube.apps.patch_namespaced_deployment_scale("llama", NS, {"spec": {"replicas": 4}})
    with pytest.raises(ApiException):
        kube.core.read_namespaced_pod("ghost", NS)
    kube.core.create_namespaced_pod_eviction(spare, NS, V1Eviction(metadata=V1ObjectMeta(name=spare)))
    assert kube.sim.audit_log is not None
    events = list(read_events(kube.sim.audit_log))
    assert all(e["apiVersion"] == "audit.k8s.io/v1" and e["stage"] == "ResponseComplete" for e in events)
    mine = [e for e in events if e["userAgent"].startswith("OpenAPI-Generator/")]
    assert {e["user"]["username"] for e in mine} == {"sim-admin"}
    label = next(
        e
        for e in mine
        if e["verb"] == "patch"
        and e.get("requestObject", {}).get("metadata", {}).get("labels") == {"audited": "yes"}
    )
    assert label["objectRef"] == {"resource": "pods", "namespace": NS, "name": spare, "apiVersion": "v1"}
    assert label["level"] == "Request" and label["responseStatus"]["code"] == 200
    assert any("dryRun=All" in e["requestURI"] for e in mine if e["verb"] == "patch")
    scale = next(e for e in mine if e["objectRef"].get("subresource") == "scale")
    assert scale["objectRef"]["apiGroup"] == "apps" and scale["verb"] == "patch"
    missing = next(e for e in mine if e["objectRef"].get("name") == "ghost")
    assert (missing["verb"], missing["level"], missing["responseStatus"]["code"]) == ("get", "Metadata", 404)
    assert missing["responseStatus"]["reason"] == "NotFound" and "requestObject" not in missing
    evict = next(e for e in mine if e["objectRef"].get("subresource") == "eviction")
    assert (evict["verb"], evict["responseStatus"]["code"]) == ("create", 201)
    rules = rbac_rules(mine, "sim-admin")
    assert {"namespace": NS, "apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]} in rules
    assert {
        "namespace": NS,
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "verbs": ["patch"],
    } in rules
