"""The simulated API server's authentication and RBAC (``sim.k8s.rbac``), through the official client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from sim.k8s.rbac import Attributes, rule_allows
from sim.runner import RunningSim, start_sim, write_kubeconfig
from sim.scenario import shipped_scenarios

NS = "inference"


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[RunningSim]:
    running = start_sim(
        shipped_scenarios()["gpu-node-loss"], 1.0, serving=False, kubeconfig=tmp_path / "kubeconfig"
    )
    try:
        yield running
    finally:
        running.stop()


def _admin(sim: RunningSim) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(sim.kubeconfig))


def _as_account(sim: RunningSim, tmp_path: Path, namespace: str, name: str) -> client.ApiClient:
    """An ApiClient with the ServiceAccount's token from the TokenRequest API."""
    token = client.CoreV1Api(_admin(sim)).create_namespaced_service_account_token(
        name, namespace, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
    )
    assert token.status is not None
    path = tmp_path / f"kubeconfig-{name}"
    ca = sim.ca_cert.read_bytes() if sim.ca_cert else None
    write_kubeconfig(path, sim.kube_url, token.status.token, NS, ca)
    return config.new_client_from_config(config_file=str(path))


def _reader(sim: RunningSim, namespace: str) -> None:
    """ServiceAccount ``reader`` in ``inference``, allowed to get and list pods in ``namespace``."""
    admin = _admin(sim)
    core, rbac = client.CoreV1Api(admin), client.RbacAuthorizationV1Api(admin)
    core.create_namespaced_service_account(NS, {"metadata": {"name": "reader"}})
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "pod-reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": NS}],
        },
    )


def test_a_role_binding_grants_its_namespace_only_and_a_deleted_accounts_token_is_refused(
    sim: RunningSim, tmp_path: Path
) -> None:
    _reader(sim, NS)
    reader = client.CoreV1Api(_as_account(sim, tmp_path, NS, "reader"))
    assert reader.list_namespaced_pod(NS).items
    with pytest.raises(ApiException) as refused:
        reader.list_namespaced_pod("default")
    assert refused.value.status == 403
    assert json.loads(str(refused.value.body))["message"] == (
        'pods is forbidden: User "system:serviceaccount:inference:reader" cannot list resource "pods" '
        'in API group "" in the namespace "default"'
    )
    with pytest.raises(ApiException) as no_patch:
        reader.patch_namespaced_pod_status("any", NS, {"status": {}})
    assert json.loads(str(no_patch.value.body))["message"].endswith(
        'cannot patch resource "pods/status" in API group "" in the namespace "inference"'
    )
    client.CoreV1Api(_admin(sim)).delete_namespaced_service_account("reader", NS)
    with pytest.raises(ApiException) as gone:
        reader.list_namespaced_pod(NS)
    assert gone.value.status == 401


def test_access_reviews_answer_for_the_caller_and_a_service_account_cannot_mint_tokens(
    sim: RunningSim, tmp_path: Path
) -> None:
    _reader(sim, NS)
    api = _as_account(sim, tmp_path, NS, "reader")
    review = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"verb": "get", "resource": "pods", "namespace": NS}}}
    )
    assert review.status.allowed is True
    assert review.status.reason == (
        'RBAC: allowed by RoleBinding "reader/inference" of Role "pod-reader" to ServiceAccount "reader/inference"'
    )
    denied = client.AuthorizationV1Api(api).create_self_subject_access_review(
        {"spec": {"resourceAttributes": {"verb": "delete", "resource": "pods", "namespace": NS}}}
    )
    assert denied.status.allowed is False
    rules = client.AuthorizationV1Api(api).create_self_subject_rules_review({"spec": {"namespace": NS}})
    assert {"verbs": ["get", "list"], "api_groups": [""], "resources": ["pods"]} in [
        {"verbs": r.verbs, "api_groups": r.api_groups, "resources": r.resources}
        for r in rules.status.resource_rules
    ]
    with pytest.raises(ApiException) as minted:
        client.CoreV1Api(api).create_namespaced_service_account_token(
            "reader", NS, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
        )
    assert minted.value.status == 403


def test_rules_match_as_the_rbac_authorizer_matches_them() -> None:
    patch_status = Attributes(verb="patch", namespace=NS, resource="pods", subresource="status", name="p")
    assert rule_allows({"verbs": ["patch"], "apiGroups": [""], "resources": ["pods/status"]}, patch_status)
    assert not rule_allows({"verbs": ["patch"], "apiGroups": [""], "resources": ["pods"]}, patch_status)
    assert rule_allows({"verbs": ["*"], "apiGroups": [""], "resources": ["*/status"]}, patch_status)
    assert not rule_allows(
        {"verbs": ["patch"], "apiGroups": ["apps"], "resources": ["pods/status"]}, patch_status
    )
    named = {"verbs": ["get", "list"], "apiGroups": [""], "resources": ["pods"], "resourceNames": ["p"]}
    assert rule_allows(named, Attributes(verb="get", namespace=NS, resource="pods", name="p"))
    assert not rule_allows(named, Attributes(verb="list", namespace=NS, resource="pods"))
    discovery = {"verbs": ["get"], "nonResourceURLs": ["/apis/*"]}
    assert rule_allows(discovery, Attributes(verb="get", path="/apis/apps/v1"))
    assert not rule_allows(discovery, Attributes(verb="get", path="/metrics"))
