"""Each fleetmend process talks to the simulated cluster as its own ServiceAccount, under deploy/k8s's RBAC.

On a cluster the worker, the webhook and the gateway control plane run as ``fleetmend-worker``,
``fleetmend-webhook`` and ``fleetmend-gateway`` (the fast path runs in the worker), each bound to the
Roles shipped in ``deploy/k8s``. The dev stack and the test rig do the same against the simulator,
which enforces RBAC (``sim.k8s.rbac``): ``grant_components`` creates the shipped Namespace,
ServiceAccounts, Roles, ClusterRoles and bindings through the admin kubeconfig, asks the TokenRequest
API for each component's token (as ``kubectl create token`` does) and writes one kubeconfig per
component beside the admin's (``kubeconfig-worker``, ...). A call outside the shipped Roles is then a
403 in whichever process made it; the admin kubeconfig (tests, the operator's kubectl) stays
unrestricted.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from sim.runner import write_kubeconfig

Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
# The files of the base that make fleetmend's identities and their permissions.
RBAC_FILES = (
    "namespace.yaml",
    "serviceaccounts.yaml",
    "rbac-worker.yaml",
    "rbac-webhook.yaml",
    "rbac-gateway.yaml",
)
RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
# Where the test rig copies fleetmend's audit events of each run (tests/deploy/rbac_audit.py sets it).
AUDIT_DIR_ENV = "FLEETMEND_RBAC_AUDIT_DIR"
FLEETMEND_NAMESPACE = "fleetmend"
# Which ServiceAccount each process runs as (deploy/k8s/base: worker.yaml, webhook.yaml, gateway.yaml).
COMPONENTS = {
    "worker": ("fleetmend", "fleetmend-worker"),
    "webhook": ("fleetmend", "fleetmend-webhook"),
    "gateway": ("fleetmend", "fleetmend-gateway"),
}


def shipped_rbac_objects() -> list[Obj]:
    """The base's identities and RBAC as written in deploy/k8s/base (what every overlay renders for
    them, less kustomize's common labels). Tests that render an overlay pass its objects instead."""
    objects: list[Obj] = []
    for name in RBAC_FILES:
        objects.extend(doc for doc in yaml.safe_load_all((BASE / name).read_text()) if doc)
    return rbac_only(objects)


def rbac_only(objects: Iterable[Obj]) -> list[Obj]:
    """The Namespaces, ServiceAccounts, Roles and bindings among ``objects``, in creation order."""
    chosen = [o for o in objects if o.get("kind") in RBAC_KINDS]
    return sorted(chosen, key=lambda o: RBAC_KINDS.index(o["kind"]))


def _apply(api: kclient.ApiClient, obj: Obj) -> None:
    """Create ``obj``, or replace it when it exists (a dev stack restarted on the same cluster)."""
    core, rbac = kclient.CoreV1Api(api), kclient.RbacAuthorizationV1Api(api)
    kind, name, namespace = obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace")
    calls: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "Namespace": (core.create_namespace, core.replace_namespace),
        "ServiceAccount": (core.create_namespaced_service_account, core.replace_namespaced_service_account),
        "ClusterRole": (rbac.create_cluster_role, rbac.replace_cluster_role),
        "Role": (rbac.create_namespaced_role, rbac.replace_namespaced_role),
        "ClusterRoleBinding": (rbac.create_cluster_role_binding, rbac.replace_cluster_role_binding),
        "RoleBinding": (rbac.create_namespaced_role_binding, rbac.replace_namespaced_role_binding),
    }
    create, replace = calls[kind]
    where = (namespace,) if namespace else ()
    try:
        create(*where, obj)
    except ApiException as exc:
        if exc.status != 409:
            raise
        replace(name, *where, obj)


def _token(api: kclient.ApiClient, namespace: str, name: str) -> str:
    request = kclient.AuthenticationV1TokenRequest(spec=kclient.V1TokenRequestSpec(audiences=[]))
    answer = kclient.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
    assert answer.status is not None, "the TokenRequest was answered without a token"
    return str(answer.status.token)


def for_pool_namespaces(objects: Iterable[Obj], pool_namespaces: Iterable[str]) -> list[Obj]:
    """``objects`` with the per-pool RoleBindings (those outside fleetmend's own namespace: the base
    binds ``inference``) made once in each of ``pool_namespaces``, as an overlay adds its own."""
    pools = sorted(set(pool_namespaces))
    out: list[Obj] = []
    seen: set[tuple[str, str]] = set()
    for obj in objects:
        namespace = obj.get("metadata", {}).get("namespace")
        if obj.get("kind") != "RoleBinding" or namespace == FLEETMEND_NAMESPACE:
            out.append(obj)
            continue
        for pool in pools:
            key = (pool, obj["metadata"]["name"])
            if key not in seen:
                seen.add(key)
                bound = copy.deepcopy(obj)
                bound["metadata"]["namespace"] = pool
                out.append(bound)
    return out


def grant_components(
    admin_kubeconfig: Path, objects: Iterable[Obj] | None = None, pool_namespaces: Iterable[str] | None = None
) -> dict[str, Path]:
    """Load ``objects`` (default: the shipped RBAC) into the cluster and write a kubeconfig per
    component (``kubeconfig-<component>`` beside ``admin_kubeconfig``); returns them by component.

    ``pool_namespaces``: where the worker's per-pool RoleBindings go (default: the namespace of the
    admin kubeconfig's context, the scenario's); ``objects`` are loaded as given when it is empty."""
    loaded = kconfig.kube_config.KubeConfigLoader(yaml.safe_load(admin_kubeconfig.read_text()))
    cfg = kclient.Configuration()
    loaded.load_and_set(cfg)
    document = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = document["clusters"][0]["cluster"]
    context = document["contexts"][0]["context"]
    pools = list(pool_namespaces) if pool_namespaces is not None else [context.get("namespace", "default")]
    chosen = rbac_only(copy.deepcopy(list(objects)) if objects is not None else shipped_rbac_objects())
    if pools:
        chosen = for_pool_namespaces(chosen, pools)
    written: dict[str, Path] = {}
    with kclient.ApiClient(cfg) as api:
        for obj in chosen:
            _apply(api, obj)
        for component, (namespace, account) in COMPONENTS.items():
            path = admin_kubeconfig.parent / f"kubeconfig-{component}"
            ca = cluster.get("certificate-authority-data")
            write_kubeconfig(
                path,
                cluster["server"],
                _token(api, namespace, account),
                context.get("namespace", "default"),
                base64.b64decode(ca) if ca else None,
            )
            written[component] = path
    return written


def component_settings(kubeconfigs: dict[str, Path]) -> dict[str, Any]:
    """The worker's settings that follow from running as its ServiceAccount: its kubeconfig, and its
    fast path's Lease in fleetmend's namespace (deploy/k8s/base/config.yaml; the Role grants it there)."""
    return {
        "kubeconfig": kubeconfigs["worker"],
        "kube_context": None,
        "fastpath_lease_namespace": FLEETMEND_NAMESPACE,
    }
