"""Patch semantics and selectors of the simulated apiserver (pure functions, plus the client round trip)."""

from __future__ import annotations

from typing import Any

import pytest

from sim.k8s.errors import ApiError
from sim.k8s.patch import (
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    apply_patch,
    json_merge_patch,
    strategic_merge_patch,
)
from sim.k8s.selectors import matches_label_selector_object, parse_field_selector, parse_label_selector
from tests.sim.support import Kube, wait_for

NS = "inference"


def test_strategic_merge_merges_lists_by_their_merge_key_and_honours_directives() -> None:
    pod: dict[str, Any] = {
        "metadata": {
            "ownerReferences": [{"uid": "a", "name": "rs-a"}, {"uid": "b", "name": "rs-b"}],
            "finalizers": ["x"],
        },
        "spec": {
            "containers": [{"name": "vllm", "image": "v1"}, {"name": "sidecar", "image": "s1"}],
            "tolerations": [{"key": "t1"}],
        },
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Gate", "status": "True"}]},
    }
    patched = strategic_merge_patch(
        pod,
        {
            "metadata": {"ownerReferences": [{"$patch": "delete", "uid": "a"}], "finalizers": ["y"]},
            "spec": {"containers": [{"name": "vllm", "image": "v2"}], "tolerations": [{"key": "t2"}]},
            "status": {"conditions": [{"type": "Gate", "status": "False"}]},
        },
    )
    assert patched["metadata"]["ownerReferences"] == [{"uid": "b", "name": "rs-b"}]
    assert patched["metadata"]["finalizers"] == ["x", "y"]
    assert patched["spec"]["containers"] == [
        {"name": "vllm", "image": "v2"},
        {"name": "sidecar", "image": "s1"},
    ]
    assert patched["spec"]["tolerations"] == [{"key": "t2"}]  # no merge key: replaced
    assert [c["status"] for c in patched["status"]["conditions"]] == ["True", "False"]
    replaced = strategic_merge_patch(
        pod, {"spec": {"containers": [{"name": "only", "image": "z"}, {"$patch": "replace"}]}}
    )
    assert replaced["spec"]["containers"] == [{"name": "only", "image": "z"}]


def test_json_merge_patch_replaces_lists_and_null_deletes() -> None:
    target = {"a": {"b": 1, "c": 2}, "l": [1, 2]}
    assert json_merge_patch(target, {"a": {"b": None}, "l": [3]}) == {"a": {"c": 2}, "l": [3]}
    assert target == {"a": {"b": 1, "c": 2}, "l": [1, 2]}  # input untouched


def test_patch_content_types_are_checked() -> None:
    with pytest.raises(ApiError) as smp_on_crd:
        apply_patch({}, {"spec": {}}, STRATEGIC_MERGE_PATCH, custom_resource=True)
    assert smp_on_crd.value.code == 415
    with pytest.raises(ApiError) as unknown:
        apply_patch({}, {}, "text/plain", custom_resource=False)
    assert unknown.value.code == 415
    with pytest.raises(ApiError) as list_as_merge:
        apply_patch({}, [{"op": "add"}], MERGE_PATCH, custom_resource=False)
    assert list_as_merge.value.code == 400


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("app=llama", True),
        ("app==llama,role!=spare", True),
        ("role in (serving, spare)", True),
        ("role notin (serving)", False),
        ("gpu", True),
        ("!gpu", False),
        ("app=llama,tier in (gold)", False),
        ("", True),
    ],
)
def test_label_selector_syntax(selector: str, matches: bool) -> None:
    labels = {"app": "llama", "role": "serving", "gpu": "h100"}
    assert parse_label_selector(selector)(labels) is matches


def test_label_selector_objects_and_field_selectors() -> None:
    expressions = {
        "matchLabels": {"app": "llama"},
        "matchExpressions": [{"key": "role", "operator": "In", "values": ["serving"]}],
    }
    assert matches_label_selector_object(expressions, {"app": "llama", "role": "serving"})
    assert not matches_label_selector_object(expressions, {"app": "llama", "role": "spare"})
    assert not matches_label_selector_object(None, {"app": "llama"})  # a null selector matches nothing
    by_node = parse_field_selector(
        "spec.nodeName=n1,status.phase!=Failed", frozenset({"spec.nodeName", "status.phase"})
    )
    assert by_node({"spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    assert not by_node({"spec": {"nodeName": "n2"}, "status": {"phase": "Running"}})
    with pytest.raises(ApiError):
        parse_label_selector("role in serving")


def test_the_release_patch_orphans_a_pod_and_the_replicaset_adopts_it_back(kube: Kube) -> None:
    """The RS controller's own ``$patch: delete`` ownerReference patch, sent through the client."""
    pod = kube.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=serving").items[0]
    owner = pod.metadata.owner_references[0]
    body = {
        "metadata": {"ownerReferences": [{"$patch": "delete", "uid": owner.uid}], "uid": pod.metadata.uid}
    }
    released = kube.core.patch_namespaced_pod(pod.metadata.name, NS, body)
    assert released.metadata.owner_references is None or released.metadata.owner_references == []
    # Still matching the selector and not terminating: the ReplicaSet adopts it again (no replacement).
    adopted = wait_for(
        lambda: (p := kube.core.read_namespaced_pod(pod.metadata.name, NS)).metadata.owner_references and p,
        what="adoption",
    )
    assert adopted.metadata.owner_references[0].uid == owner.uid
    assert len(kube.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=serving").items) == 5
