"""Deployment and ReplicaSet controllers.

ReplicaSet: keeps ``spec.replicas`` active pods that match its selector. A pod
it owns whose labels stop matching is *released* (its ownerReference removed —
it keeps running and keeps its GPUs) and a replacement is created at once; an
un-owned matching pod is adopted. Surplus pods are deleted in the real
preference order (unscheduled, pending, not ready, lower deletion cost, more
restarts, newest first).

Deployment: one ReplicaSet per pod-template hash; rolling updates honour
``maxSurge``/``maxUnavailable``; ``Recreate`` scales the old set to zero first.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleet.vocabulary import POD_DELETION_COST_ANNOTATION
from sim.clock import parse_timestamp
from sim.k8s import objects as o
from sim.k8s.selectors import matches_label_selector_object, selector_object_to_string
from sim.k8s.store import json_copy

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
TEMPLATE_HASH_LABEL = "pod-template-hash"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"


def _int_or_percent(value: Any, total: int, round_up: bool) -> int:
    if value is None:
        return 0
    if isinstance(value, str) and value.endswith("%"):
        share = float(value[:-1]) / 100 * total
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


def rolling_parameters(deployment: Obj) -> tuple[int, int]:
    desired = int(deployment["spec"].get("replicas", 1))
    rolling = (deployment["spec"].get("strategy") or {}).get("rollingUpdate") or {}
    surge = _int_or_percent(rolling.get("maxSurge", "25%"), desired, round_up=True)
    unavailable = _int_or_percent(rolling.get("maxUnavailable", "25%"), desired, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


# ------------------------------------------------------------------ Deployment
def reconcile_deployments(cp: ControlPlane) -> None:
    for deployment in cp.store.list_view("deployments"):
        if o.is_terminating(deployment):
            continue
        _sync_deployment(cp, deployment)


def _owned(cp: ControlPlane, plural: str, owner: Obj) -> list[Obj]:
    uid, namespace = o.uid_of(owner), o.namespace_of(owner)
    return [
        obj
        for obj in cp.store.owned_by(plural, uid)
        if o.namespace_of(obj) == namespace
        and (ref := o.controller_ref(obj)) is not None
        and ref.get("uid") == uid
    ]


def pods_for_selector(cp: ControlPlane, namespace: str, selector: Obj | None) -> list[Obj]:
    """The pods a LabelSelector object can match, from the store's label index when it has only
    ``matchLabels`` (the caller still checks the selector); every pod of the namespace otherwise."""
    if selector is not None and selector.get("matchLabels") and not selector.get("matchExpressions"):
        return cp.store.select("pods", namespace, selector["matchLabels"])
    return cp.store.list_view("pods", namespace)


def _sync_deployment(cp: ControlPlane, deployment: Obj) -> None:
    spec = deployment["spec"]
    namespace, name = o.namespace_of(deployment), o.name_of(deployment)
    template = json_copy(spec["template"])
    template_hash = o.stable_hash(template)
    replica_sets = _owned(cp, "replicasets", deployment)
    new_rs = next((rs for rs in replica_sets if o.labels(rs).get(TEMPLATE_HASH_LABEL) == template_hash), None)
    old = [rs for rs in replica_sets if rs is not new_rs]
    desired = int(spec.get("replicas", 1))
    if new_rs is None and not spec.get("paused"):
        revision = 1 + max(
            (int(rs["metadata"].get("annotations", {}).get(REVISION_ANNOTATION, 0)) for rs in old), default=0
        )
        template.setdefault("metadata", {}).setdefault("labels", {})[TEMPLATE_HASH_LABEL] = template_hash
        selector = copy.deepcopy(spec["selector"])
        selector.setdefault("matchLabels", {})[TEMPLATE_HASH_LABEL] = template_hash
        new_rs = cp.ensure_exists(
            "replicasets",
            {
                "metadata": {
                    "name": f"{name}-{template_hash}",
                    "namespace": namespace,
                    "labels": dict(template["metadata"]["labels"]),
                    "annotations": {
                        REVISION_ANNOTATION: str(revision),
                        "deployment.kubernetes.io/desired-replicas": str(desired),
                    },
                    "ownerReferences": [o.owner_reference(deployment)],
                },
                "spec": {
                    "replicas": 0,
                    "selector": selector,
                    "template": template,
                    "minReadySeconds": spec.get("minReadySeconds", 0),
                },
                "status": {"replicas": 0},
            },
        )
        cp.events.record(
            deployment,
            "ScalingReplicaSet",
            f"Scaled up replica set {o.name_of(new_rs)} from 0 to {min(desired, 1)}",
            component="deployment-controller",
        )
    if new_rs is None:
        return
    if not spec.get("paused"):
        targets = _rollout_targets(deployment, new_rs, old)
        for rs in [new_rs, *old]:
            target = targets.get(o.name_of(rs))
            if target is not None and target != int(rs["spec"].get("replicas", 0)):
                before = int(rs["spec"].get("replicas", 0))
                cp.store.mutate("replicasets", namespace, o.name_of(rs), _replicas_setter(target))
                verb = "up" if target > before else "down"
                cp.events.record(
                    deployment,
                    "ScalingReplicaSet",
                    f"Scaled {verb} replica set {o.name_of(rs)} from {before} to {target}",
                    component="deployment-controller",
                )
    _deployment_status(cp, deployment, new_rs, old)


def _replicas_setter(replicas: int) -> Callable[[Obj], None]:
    def change(obj: Obj) -> None:
        obj["spec"]["replicas"] = replicas

    return change


def _rollout_targets(deployment: Obj, new_rs: Obj, old: list[Obj]) -> dict[str, int]:
    desired = int(deployment["spec"].get("replicas", 1))
    strategy = (deployment["spec"].get("strategy") or {}).get("type", "RollingUpdate")
    new_name = o.name_of(new_rs)
    active_old = [rs for rs in old if int(rs["spec"].get("replicas", 0)) > 0]
    if not active_old:
        return {new_name: desired}
    targets: dict[str, int] = {}
    if strategy == "Recreate":
        targets = {o.name_of(rs): 0 for rs in old}
        old_pods = sum(int(rs.get("status", {}).get("replicas", 0)) for rs in old)
        targets[new_name] = desired if old_pods == 0 else 0
        return targets
    surge, max_unavailable = rolling_parameters(deployment)
    new_replicas = int(new_rs["spec"].get("replicas", 0))
    total = new_replicas + sum(int(rs["spec"].get("replicas", 0)) for rs in old)
    if new_replicas < desired:
        room = desired + surge - total
        if room > 0:
            new_replicas = min(desired, new_replicas + room)
    elif new_replicas > desired:
        new_replicas = desired
    targets[new_name] = new_replicas
    ready = lambda rs: int(rs.get("status", {}).get("readyReplicas", 0))  # noqa: E731
    min_available = desired - max_unavailable
    new_unavailable = new_replicas - ready(new_rs)
    total = new_replicas + sum(int(rs["spec"].get("replicas", 0)) for rs in old)
    budget = max(0, total - min_available - new_unavailable)
    # First drop old pods that are not ready anyway, then ready ones while availability allows.
    sizes = {o.name_of(rs): int(rs["spec"].get("replicas", 0)) for rs in old}
    for rs in sorted(old, key=lambda r: r["metadata"]["creationTimestamp"]):
        unhealthy = max(0, sizes[o.name_of(rs)] - ready(rs))
        cut = min(budget, unhealthy)
        sizes[o.name_of(rs)] -= cut
        budget -= cut
    available = ready(new_rs) + sum(min(ready(rs), sizes[o.name_of(rs)]) for rs in old)
    budget = max(0, available - min_available)
    for rs in sorted(old, key=lambda r: r["metadata"]["creationTimestamp"]):
        cut = min(budget, sizes[o.name_of(rs)])
        sizes[o.name_of(rs)] -= cut
        budget -= cut
    targets.update(sizes)
    return targets


def _deployment_status(cp: ControlPlane, deployment: Obj, new_rs: Obj, old: list[Obj]) -> None:
    all_rs = [new_rs, *old]
    current = {
        o.name_of(rs): cp.store.find("replicasets", o.namespace_of(rs), o.name_of(rs)) or rs for rs in all_rs
    }
    statuses = [rs.get("status", {}) for rs in current.values()]
    desired = int(deployment["spec"].get("replicas", 1))
    _, max_unavailable = rolling_parameters(deployment)
    replicas = sum(int(s.get("replicas", 0)) for s in statuses)
    ready = sum(int(s.get("readyReplicas", 0)) for s in statuses)
    available = sum(int(s.get("availableReplicas", 0)) for s in statuses)
    updated = int(current[o.name_of(new_rs)].get("status", {}).get("replicas", 0))
    new_name = o.name_of(new_rs)
    stamp = cp.clock.timestamp()

    def change(obj: Obj) -> None:
        status = obj.setdefault("status", {})
        before = tuple(
            int(status.get(k, 0)) for k in ("updatedReplicas", "readyReplicas", "availableReplicas")
        )
        progressed = before != (updated, ready, available)
        status["observedGeneration"] = obj["metadata"].get("generation", 1)
        status["replicas"] = replicas
        status["updatedReplicas"] = updated
        status["readyReplicas"] = ready
        status["availableReplicas"] = available
        unavailable = max(0, desired - available)
        if unavailable:
            status["unavailableReplicas"] = unavailable
        else:
            status.pop("unavailableReplicas", None)
        for key in ("readyReplicas", "availableReplicas", "updatedReplicas", "replicas"):
            if status[key] == 0:
                status.pop(key)
        if available >= desired - max_unavailable:
            o.set_condition(
                obj,
                "Available",
                "True",
                stamp,
                "MinimumReplicasAvailable",
                "Deployment has minimum availability.",
                style="deployment",
            )
        else:
            o.set_condition(
                obj,
                "Available",
                "False",
                stamp,
                "MinimumReplicasUnavailable",
                "Deployment does not have minimum availability.",
                style="deployment",
            )
        complete = updated == desired and replicas == desired and available >= desired
        if complete:
            o.set_condition(
                obj,
                "Progressing",
                "True",
                stamp,
                "NewReplicaSetAvailable",
                f'ReplicaSet "{new_name}" has successfully progressed.',
                style="deployment",
            )
        else:
            _progress_condition(cp, obj, new_name, progressed, stamp)

    cp.store.mutate("deployments", o.namespace_of(deployment), o.name_of(deployment), change)


def _progress_condition(cp: ControlPlane, obj: Obj, new_name: str, progressed: bool, stamp: str) -> None:
    """``Progressing`` during a rollout: ``lastUpdateTime`` moves with progress; without any for
    ``progressDeadlineSeconds`` the condition turns False with reason ``ProgressDeadlineExceeded``."""
    current = o.condition(obj, "Progressing")
    deadline = float(obj["spec"].get("progressDeadlineSeconds", 600))
    if current is None or progressed or current.get("reason") == "NewReplicaSetAvailable":
        o.set_condition(
            obj,
            "Progressing",
            "True",
            stamp,
            "ReplicaSetUpdated",
            f'ReplicaSet "{new_name}" is progressing.',
            style="deployment",
        )
        for cond in obj["status"]["conditions"]:
            if cond["type"] == "Progressing":
                cond["lastUpdateTime"] = stamp
        cp.wake_at(parse_timestamp(stamp) + deadline + 1e-3)
        return
    if current.get("reason") == "ProgressDeadlineExceeded":
        return
    expires = parse_timestamp(current.get("lastUpdateTime", stamp)) + deadline
    if cp.now() <= expires:
        cp.wake_at(expires + 1e-3)
    else:
        o.set_condition(
            obj,
            "Progressing",
            "False",
            stamp,
            "ProgressDeadlineExceeded",
            f'ReplicaSet "{new_name}" has timed out progressing.',
            style="deployment",
        )


# ------------------------------------------------------------------ ReplicaSet
def reconcile_replicasets(cp: ControlPlane) -> None:
    for rs in cp.store.list_view("replicasets"):
        _sync_replicaset(cp, rs)


def _deletion_rank(pod: Obj) -> tuple[int, int, int, int, int, str]:
    """Lower sorts first = deleted first (ActivePodsWithRanks, simplified)."""
    assigned = 1 if pod.get("spec", {}).get("nodeName") else 0
    phase_rank = {"Pending": 0, "Unknown": 1, "Running": 2}.get(o.pod_phase(pod), 1)
    ready = 1 if o.is_pod_ready(pod) else 0
    cost = int((pod["metadata"].get("annotations") or {}).get(POD_DELETION_COST_ANNOTATION, 0))
    restarts = -o.restart_count(pod)
    newest_first = "".join(chr(0x10FFFF - ord(c)) for c in pod["metadata"]["creationTimestamp"])
    return assigned, phase_rank, ready, cost, restarts, newest_first


def _sync_replicaset(cp: ControlPlane, rs: Obj) -> None:
    namespace, rs_uid = o.namespace_of(rs), o.uid_of(rs)
    selector = rs["spec"].get("selector")
    rs_deleting = o.is_terminating(rs)
    owned: list[Obj] = []
    # The pods it owns, and the pods its selector matches (to adopt or release): not the whole namespace.
    candidates = {o.uid_of(p): p for p in pods_for_selector(cp, namespace, selector)}
    candidates.update((o.uid_of(p), p) for p in cp.store.owned_by("pods", rs_uid))
    for pod in sorted(candidates.values(), key=o.name_of):
        if o.namespace_of(pod) != namespace:
            continue
        ref = o.controller_ref(pod)
        matches = matches_label_selector_object(selector, o.labels(pod))
        if ref is not None and ref.get("uid") == rs_uid:
            if matches or rs_deleting:
                owned.append(pod)
            else:
                _release(cp, pod, rs_uid)
        elif ref is None and matches and not o.is_terminating(pod) and not rs_deleting:
            _adopt(cp, pod, rs)
            owned.append(pod)
    active = [p for p in owned if o.is_pod_active(p)]
    desired = int(rs["spec"].get("replicas", 1))
    if not rs_deleting:
        if len(active) < desired:
            for _ in range(desired - len(active)):
                pod = _pod_from_template(cp, rs)
                created = cp.create_pod(pod)
                active.append(created)
                cp.events.record(
                    rs,
                    "SuccessfulCreate",
                    f"Created pod: {o.name_of(created)}",
                    component="replicaset-controller",
                )
        elif len(active) > desired:
            for pod in sorted(active, key=_deletion_rank)[: len(active) - desired]:
                cp.delete("pods", namespace, o.name_of(pod))
                active.remove(pod)
                cp.events.record(
                    rs,
                    "SuccessfulDelete",
                    f"Deleted pod: {o.name_of(pod)}",
                    component="replicaset-controller",
                )
    ready = [p for p in active if o.is_pod_ready(p)]

    def change(obj: Obj) -> None:
        status: Obj = {"replicas": len(active), "observedGeneration": obj["metadata"].get("generation", 1)}
        template_labels = (obj["spec"].get("template", {}).get("metadata") or {}).get("labels") or {}
        fully = sum(1 for p in active if all(o.labels(p).get(k) == v for k, v in template_labels.items()))
        if fully:
            status["fullyLabeledReplicas"] = fully
        if ready:
            status["readyReplicas"] = len(ready)
            status["availableReplicas"] = len(ready)
        obj["status"] = status

    cp.store.mutate("replicasets", namespace, o.name_of(rs), change)


def _release(cp: ControlPlane, pod: Obj, owner_uid: str) -> None:
    # The real controller's deleteOwnerRefStrategicMergePatch: remove our ownerReference only.
    def change(obj: Obj) -> None:
        refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid]
        if refs:
            obj["metadata"]["ownerReferences"] = refs
        else:
            obj["metadata"].pop("ownerReferences", None)

    cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), change)


def _adopt(cp: ControlPlane, pod: Obj, owner: Obj) -> None:
    def change(obj: Obj) -> None:
        obj["metadata"].setdefault("ownerReferences", []).append(o.owner_reference(owner))

    cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), change)


def _pod_from_template(cp: ControlPlane, rs: Obj) -> Obj:
    template = copy.deepcopy(rs["spec"]["template"])
    meta = template.get("metadata") or {}
    return {
        "metadata": {
            "name": f"{o.name_of(rs)}-{o.random_suffix(cp.rng)}",
            "generateName": f"{o.name_of(rs)}-",
            "namespace": o.namespace_of(rs),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [o.owner_reference(rs)],
        },
        "spec": template.get("spec") or {},
    }


def selector_string(obj: Obj) -> str:
    return selector_object_to_string(obj["spec"].get("selector") or {})
