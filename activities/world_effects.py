"""The external actions fleetmend takes, as ledger effects: apply, probe, and the action's signature.

Each effect sends a body that is a pure function of its parameters, so the
ledger can store up front what the world's action log will show
(``ActionSignature``: verb, path, sha256 of the exact bytes) and reconciliation
can prove every action happened once. Probes look at the target's state, so an
attempt that crashed after applying is resolved by looking, never by repeating.

Bodies are serialised the way the official client does (``json.dumps``). The gateway
effects are policy revisions in fleetmend's xDS control plane; their record is Envoy's ACK.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from activities import kube_reads as kr
from activities.gateway import Gateway
from fleet.gateway import Admission, GatewayPolicy, RetryPolicy
from fleet.incident import PoolRef
from kube.client import LWS_GROUP, LWS_PLURAL, LWS_VERSION, KubeApis
from ledger.effect import ActionSignature, Attempt, Effect
from ledger.errors import PermanentEffectError


def request_digest(body: Any) -> str:
    """The ledger's digest of a request body sent to the API server (``sha256:`` of its JSON)."""
    raw = b"" if body is None else json.dumps(body).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def api_server_world(k: KubeApis) -> str:
    """The ``world`` an effect on the API server is recorded under: its host:port."""
    return urlsplit(k.core.api_client.configuration.host).netloc


def permanent_if_client_error(exc: ApiException, what: str) -> None:
    """A 4xx other than 409/429 will not change on retry: raise it as permanent, naming ``what``."""
    if exc.status is not None and 400 <= exc.status < 500 and exc.status not in (409, 429):
        raise PermanentEffectError(
            f"{what}: Kubernetes answered {exc.status} {exc.reason}: {exc.body}"
        ) from exc


class PodMetadataPatch(Effect):
    """Set/remove labels and annotations of one pod (strategic merge patch)."""

    def __init__(
        self,
        k: KubeApis,
        namespace: str,
        pod: str,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str | None] | None = None,
    ) -> None:
        self.k, self.ns, self.pod = k, namespace, pod
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        self.body = {"metadata": meta}

    @property
    def only_removes(self) -> bool:
        """Every change removes a key: a pod that no longer exists already has the outcome asked for
        (a deleted pod carries no router label), so its 404 is the effect done, not refused."""
        changes = [*(self.body["metadata"].get("labels") or {}).values()]
        changes += (self.body["metadata"].get("annotations") or {}).values()
        return bool(changes) and all(value is None for value in changes)

    def _gone(self) -> dict[str, Any]:
        return {"patched": f"{self.ns}/{self.pod}", "metadata": self.body["metadata"], "pod_gone": True}

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.core.patch_namespaced_pod(self.pod, self.ns, self.body, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                if self.only_removes:
                    return self._gone()
                raise PermanentEffectError(f"pod {self.ns}/{self.pod} no longer exists") from exc
            permanent_if_client_error(exc, f"patch pod {self.ns}/{self.pod}")
            raise
        return {"patched": f"{self.ns}/{self.pod}", "metadata": self.body["metadata"]}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        pod = kr.get_pod(self.k, self.ns, self.pod)
        if pod is None:
            return self._gone() if self.only_removes else None
        meta = pod["metadata"]
        for field in ("labels", "annotations"):
            want = self.body["metadata"].get(field) or {}
            have = meta.get(field) or {}
            for key, value in want.items():
                if (value is None and key in have) or (value is not None and have.get(key) != value):
                    return None
        return {"patched": f"{self.ns}/{self.pod}", "metadata": self.body["metadata"], "found_by_probe": True}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="PATCH",
            path=f"/api/v1/namespaces/{self.ns}/pods/{self.pod}",
            body_digest=request_digest(self.body),
        )


class ScaleWorkload(Effect):
    """Set a workload's replica count through its ``scale`` subresource (absolute, never +1)."""

    def __init__(self, k: KubeApis, kind: str, namespace: str, name: str, replicas: int) -> None:
        self.k, self.kind, self.ns, self.name, self.replicas = k, kind, namespace, name, replicas
        self.body = {"spec": {"replicas": replicas}}

    def _path(self) -> str:
        if self.kind == "LeaderWorkerSet":
            return f"/apis/{LWS_GROUP}/{LWS_VERSION}/namespaces/{self.ns}/{LWS_PLURAL}/{self.name}/scale"
        return f"/apis/apps/v1/namespaces/{self.ns}/deployments/{self.name}/scale"

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            if self.kind == "LeaderWorkerSet":
                self.k.custom.patch_namespaced_custom_object_scale(
                    LWS_GROUP, LWS_VERSION, self.ns, LWS_PLURAL, self.name, self.body
                )
            elif self.kind == "Deployment":
                self.k.apps.patch_namespaced_deployment_scale(
                    self.name, self.ns, self.body, _preload_content=False
                )
            else:
                raise PermanentEffectError(f"fleetmend does not scale {self.kind} workloads")
        except ApiException as exc:
            permanent_if_client_error(exc, f"scale {self.kind} {self.ns}/{self.name}")
            raise
        return {"workload": f"{self.kind}/{self.ns}/{self.name}", "replicas": self.replicas}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        obj: Any
        if self.kind == "LeaderWorkerSet":
            obj = self.k.custom.get_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, self.ns, LWS_PLURAL, self.name
            )
        else:
            resp: Any = self.k.apps.read_namespaced_deployment(self.name, self.ns, _preload_content=False)
            obj = json.loads(resp.data)
        if obj.get("spec", {}).get("replicas") == self.replicas:
            return {
                "workload": f"{self.kind}/{self.ns}/{self.name}",
                "replicas": self.replicas,
                "found_by_probe": True,
            }
        return None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="PATCH",
            path=self._path(),
            body_digest=request_digest(self.body),
        )


class NodePatch(Effect):
    """Cordon a node and mark it (labels, annotations): strategic merge on the Node."""

    def __init__(
        self,
        k: KubeApis,
        node: str,
        *,
        unschedulable: bool | None = None,
        labels: dict[str, str | None] | None = None,
        annotations: dict[str, str | None] | None = None,
    ) -> None:
        self.k, self.node = k, node
        body: dict[str, Any] = {}
        if unschedulable is not None:
            body["spec"] = {"unschedulable": unschedulable}
        meta: dict[str, Any] = {}
        if labels:
            meta["labels"] = labels
        if annotations:
            meta["annotations"] = annotations
        if meta:
            body["metadata"] = meta
        self.body = body

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.core.patch_node(self.node, self.body, _preload_content=False)
        except ApiException as exc:
            permanent_if_client_error(exc, f"patch node {self.node}")
            raise
        return {"node": self.node, "patch": self.body}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        obj = kr.get_node(self.k, self.node)
        spec = self.body.get("spec", {})
        if (
            "unschedulable" in spec
            and bool(obj.get("spec", {}).get("unschedulable")) != spec["unschedulable"]
        ):
            return None
        meta = obj["metadata"]
        for field in ("labels", "annotations"):
            for key, value in (self.body.get("metadata", {}).get(field) or {}).items():
                have = meta.get(field) or {}
                if (value is None and key in have) or (value is not None and have.get(key) != value):
                    return None
        return {"node": self.node, "patch": self.body, "found_by_probe": True}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="PATCH",
            path=f"/api/v1/nodes/{self.node}",
            body_digest=request_digest(self.body),
        )


class NodeTaintAdd(Effect):
    """Add one taint with a JSON patch (a fixed body: the add itself, never a read-modify-write)."""

    def __init__(self, k: KubeApis, node: str, key: str, value: str, effect: str = "NoSchedule") -> None:
        self.k, self.node = k, node
        self.taint = {"key": key, "value": value, "effect": effect}
        self.body = [{"op": "add", "path": "/spec/taints/-", "value": self.taint}]

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        obj = kr.get_node(self.k, self.node)
        if not obj.get("spec", {}).get("taints"):
            # An empty list must exist before "-" can append to it; this creates it with our taint.
            raise PermanentEffectError(
                f"node {self.node} has no taints list to append to; cordon it first (cordon adds "
                "node.kubernetes.io/unschedulable)"
            )
        try:
            self.k.core.patch_node(self.node, self.body, _preload_content=False)
        except ApiException as exc:
            permanent_if_client_error(exc, f"taint node {self.node}")
            raise
        return {"node": self.node, "taint": self.taint}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        obj = kr.get_node(self.k, self.node)
        for t in obj.get("spec", {}).get("taints") or []:
            if t.get("key") == self.taint["key"] and t.get("effect") == self.taint["effect"]:
                return {"node": self.node, "taint": self.taint, "found_by_probe": True}
        return None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="PATCH",
            path=f"/api/v1/nodes/{self.node}",
            body_digest=request_digest(self.body),
        )


class DeletePod(Effect):
    """Delete a pod with an explicit grace period (force-delete = 0, only after an operator approved)."""

    def __init__(self, k: KubeApis, namespace: str, pod: str, grace_period_s: int) -> None:
        self.k, self.ns, self.pod, self.grace = k, namespace, pod, grace_period_s
        self.body = {"gracePeriodSeconds": grace_period_s}

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.core.delete_namespaced_pod(
                self.pod,
                self.ns,
                body=client.V1DeleteOptions(grace_period_seconds=self.grace),
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status == 404:
                return {"deleted": f"{self.ns}/{self.pod}", "already_gone": True}
            permanent_if_client_error(exc, f"delete pod {self.ns}/{self.pod}")
            raise
        return {"deleted": f"{self.ns}/{self.pod}", "grace_period_s": self.grace}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        pod = kr.get_pod(self.k, self.ns, self.pod)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return {"deleted": f"{self.ns}/{self.pod}", "found_by_probe": True}
        return None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="DELETE",
            path=f"/api/v1/namespaces/{self.ns}/pods/{self.pod}",
            body_digest=request_digest(self.body),
        )


class _GatewayEffect(Effect):
    """One part of a pool's gateway policy, set absolutely through the gateway port.

    At apply time the rest of the policy is read back and kept, so re-applying the same value is
    harmless; the probe asks the gateway whether exactly that value is running (activities.gateway).
    """

    what = ""

    def __init__(self, gateway: Gateway, pool: PoolRef) -> None:
        self.gateway, self.pool = gateway, pool

    def desired(self, current: GatewayPolicy) -> GatewayPolicy:
        raise NotImplementedError

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        return self.gateway.apply(self.pool, self.desired(self.gateway.policy(self.pool)))

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        current = self.gateway.policy(self.pool)
        if self.desired(current) != current:
            return None
        return self.gateway.applied(self.pool, current)

    def action_signature(self, attempt: Attempt) -> ActionSignature | None:
        return self.gateway.action_signature(self.pool, self.what)


class SetAdmission(_GatewayEffect):
    what = "admission"

    def __init__(self, gateway: Gateway, pool: PoolRef, admission: Admission) -> None:
        super().__init__(gateway, pool)
        self.admission = admission

    def desired(self, current: GatewayPolicy) -> GatewayPolicy:
        return current.model_copy(update={"admission": self.admission})


class SetRetryPolicy(_GatewayEffect):
    what = "retry-policy"

    def __init__(self, gateway: Gateway, pool: PoolRef, retry: RetryPolicy) -> None:
        super().__init__(gateway, pool)
        self.retry = retry

    def desired(self, current: GatewayPolicy) -> GatewayPolicy:
        return current.model_copy(update={"retry": self.retry})


class SetWeights(_GatewayEffect):
    what = "weights"

    def __init__(self, gateway: Gateway, pool: PoolRef, weights: dict[str, float]) -> None:
        super().__init__(gateway, pool)
        self.weights = weights

    def desired(self, current: GatewayPolicy) -> GatewayPolicy:
        return current.model_copy(update={"weights": dict(self.weights)})
