"""LeaderWorkerSet controller (kubernetes-sigs/lws semantics for the parts fleetmend touches).

``spec.replicas`` groups of ``leaderWorkerTemplate.size`` pods: leader
``<lws>-<g>`` (worker-index 0) and workers ``<lws>-<g>-<w>``, with the real
labels and annotations. Under the default ``RecreateGroupOnPodRestart`` policy
any pod of a group that restarts (restartCount > 0), fails or is being deleted
makes the controller delete the whole group (event ``RecreateGroup``); the
group comes back once the old pods are gone (StatefulSet semantics: a pod name
is reused only after the old pod disappeared). The StatefulSets are real objects
as with the real controller: ``<lws>`` owns the leaders (selector ``name`` +
``worker-index=0``) and ``<lws>-<g>``, owned by leader pod ``<lws>-<g>``, owns
that group's workers. Scaling adds or removes whole
groups from the top index. A headless Service ``<lws>`` with
``publishNotReadyAddresses: true`` is created as the real controller does.
With the ``leaderworkerset.sigs.k8s.io/exclusive-topology`` annotation the
scheduler places each group inside one topology domain, one group per domain.
"""

from __future__ import annotations

import copy
import hashlib
from typing import TYPE_CHECKING, Any

from fleet.vocabulary import (
    LWS_GROUP_INDEX_LABEL,
    LWS_GROUP_KEY_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
)
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
COMPONENT = "lws-controller"
TEMPLATE_HASH_LABEL = "leaderworkerset.sigs.k8s.io/template-revision-hash"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"
RECREATING_POLICIES = ("RecreateGroupOnPodRestart", "RecreateGroupAfterStart")


def group_key(namespace: str, leader_name: str) -> str:
    return hashlib.sha1(f"{namespace}/{leader_name}".encode()).hexdigest()


def reconcile_leaderworkersets(cp: ControlPlane) -> None:
    for lws in cp.store.list_view("leaderworkersets"):
        if o.is_terminating(lws):
            continue
        _ensure_headless_service(cp, lws)
        _sync(cp, lws)
    _delete_pods_of_missing_sets(cp)


def _ensure_headless_service(cp: ControlPlane, lws: Obj) -> None:
    name = o.name_of(lws)
    cp.ensure_exists(
        "services",
        {
            "metadata": {
                "name": name,
                "namespace": o.namespace_of(lws),
                "ownerReferences": [o.owner_reference(lws)],
            },
            "spec": {
                "clusterIP": "None",
                "clusterIPs": ["None"],
                "selector": {LWS_NAME_LABEL: name},
                "publishNotReadyAddresses": True,
                "type": "ClusterIP",
                "sessionAffinity": "None",
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "internalTrafficPolicy": "Cluster",
            },
            "status": {"loadBalancer": {}},
        },
    )


def _template(lws: Obj, leader: bool) -> Obj:
    lwt = lws["spec"].get("leaderWorkerTemplate") or {}
    if leader and lwt.get("leaderTemplate"):
        return copy.deepcopy(lwt["leaderTemplate"])
    return copy.deepcopy(lwt.get("workerTemplate") or {})


def _group_failed(pods: list[Obj], size: int) -> Obj | str | None:
    """The pod (or the name of the deleted pod) that makes the group restart, if any."""
    for pod in pods:
        if o.is_terminating(pod) or o.restart_count(pod) > 0 or o.pod_phase(pod) == "Failed":
            return pod
    # A group is created whole in one pass, so a live leader with a missing worker means
    # that worker was deleted outright (e.g. force-deleted): the group restarts too.
    names = {o.name_of(p) for p in pods}
    leaders = [p for p in pods if o.labels(p).get(LWS_WORKER_INDEX_LABEL) == "0"]
    if leaders and len(pods) < size:
        leader = o.name_of(leaders[0])
        return next(f"{leader}-{w}" for w in range(1, size) if f"{leader}-{w}" not in names)
    return None


def _sync(cp: ControlPlane, lws: Obj) -> None:
    namespace, name = o.namespace_of(lws), o.name_of(lws)
    spec = lws["spec"]
    lwt = spec.get("leaderWorkerTemplate") or {}
    size = int(lwt.get("size", 1))
    replicas = int(spec.get("replicas", 1))
    policy = lwt.get("restartPolicy", "RecreateGroupOnPodRestart")
    template_hash = o.stable_hash(lwt)
    pods = cp.store.list_view("pods", namespace, f"{LWS_NAME_LABEL}={name}")
    by_group: dict[int, list[Obj]] = {}
    for pod in pods:
        by_group.setdefault(int(o.labels(pod).get(LWS_GROUP_INDEX_LABEL, -1)), []).append(pod)
    for index, group_pods in by_group.items():
        if index >= replicas or index < 0:
            for pod in group_pods:
                if not o.is_terminating(pod):
                    cp.delete("pods", namespace, o.name_of(pod))
    ready_groups = 0
    leader_set = _ensure_leader_statefulset(cp, lws, replicas)
    for index in range(replicas):
        group_pods = by_group.get(index, [])
        leader_name = f"{name}-{index}"
        failed = _group_failed(group_pods, size) if policy in RECREATING_POLICIES else None
        if (
            failed is not None
            and policy == "RecreateGroupAfterStart"
            and any(o.pod_phase(p) == "Pending" for p in group_pods)
        ):
            failed = None
        if failed is not None:
            alive = [p for p in group_pods if not o.is_terminating(p)]
            if alive:
                cp.events.record(
                    lws,
                    "RecreateGroup",
                    f"Worker pod {failed if isinstance(failed, str) else o.name_of(failed)} failed, "
                    f"deleted leader pod {leader_name} to recreate group {index}",
                    component=COMPONENT,
                )
                for pod in alive:
                    cp.delete("pods", namespace, o.name_of(pod))
            continue
        existing = {o.name_of(p) for p in group_pods}
        leader = next((p for p in group_pods if o.name_of(p) == leader_name), None)
        if leader is None and cp.store.find("pods", namespace, leader_name) is None:
            leader = cp.create_pod(
                _group_pod(lws, index, 0, size, template_hash, o.owner_reference(leader_set))
            )
        if leader is None or size == 1:
            pass
        else:
            worker_set = _ensure_worker_statefulset(cp, lws, leader, index, size)
            for worker in range(1, size):
                pod_name = f"{leader_name}-{worker}"
                if (
                    worker_set is None
                    or pod_name in existing
                    or cp.store.find("pods", namespace, pod_name) is not None
                ):
                    continue
                cp.create_pod(
                    _group_pod(lws, index, worker, size, template_hash, o.owner_reference(worker_set))
                )
        if len(group_pods) == size and all(o.is_pod_ready(p) for p in group_pods):
            ready_groups += 1
    _status(cp, lws, replicas, ready_groups, len([g for g in by_group if 0 <= g < replicas]))
    _statefulset_status(
        cp,
        namespace,
        name,
        [p for g in by_group.values() for p in g if o.labels(p).get(LWS_WORKER_INDEX_LABEL) == "0"],
    )
    for index, group_pods in by_group.items():
        workers = [p for p in group_pods if o.labels(p).get(LWS_WORKER_INDEX_LABEL) != "0"]
        _statefulset_status(cp, namespace, f"{name}-{index}", workers)


def _statefulset(
    name: str,
    namespace: str,
    owner: Obj,
    replicas: int,
    selector: dict[str, str],
    template: Obj,
    service: str,
) -> Obj:
    template = copy.deepcopy(template)
    template.setdefault("metadata", {}).setdefault("labels", {}).update(selector)
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(selector),
            "ownerReferences": [o.owner_reference(owner)],
        },
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(selector)},
            "serviceName": service,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "revisionHistoryLimit": 10,
            "template": template,
        },
        "status": {"replicas": 0, "availableReplicas": 0},
    }


def _ensure_leader_statefulset(cp: ControlPlane, lws: Obj, replicas: int) -> Obj:
    namespace, name = o.namespace_of(lws), o.name_of(lws)
    selector = {LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: "0"}
    stored = cp.ensure_exists(
        "statefulsets",
        _statefulset(name, namespace, lws, replicas, selector, _template(lws, leader=True), name),
    )
    if int(stored["spec"].get("replicas", 0)) != replicas:
        stored = (
            cp.store.mutate(
                "statefulsets", namespace, name, lambda obj: obj["spec"].__setitem__("replicas", replicas)
            )
            or stored
        )
    return stored


def _ensure_worker_statefulset(cp: ControlPlane, lws: Obj, leader: Obj, index: int, size: int) -> Obj | None:
    """The group's worker StatefulSet, owned by its leader pod; None while a previous group's one is going."""
    namespace, name = o.namespace_of(lws), o.name_of(lws)
    set_name = f"{name}-{index}"
    existing = cp.store.find("statefulsets", namespace, set_name)
    if existing is not None:
        ref = o.controller_ref(existing)
        if ref is not None and ref.get("uid") != o.uid_of(leader):
            cp.delete("statefulsets", namespace, set_name)  # it belonged to the previous incarnation
            return None
        return existing
    selector = {
        LWS_NAME_LABEL: name,
        LWS_GROUP_INDEX_LABEL: str(index),
        LWS_GROUP_KEY_LABEL: group_key(namespace, set_name),
    }
    return cp.store.create(
        "statefulsets",
        _statefulset(set_name, namespace, leader, size - 1, selector, _template(lws, leader=False), name),
    )


def _statefulset_status(cp: ControlPlane, namespace: str, name: str, pods: list[Obj]) -> None:
    live = [p for p in pods if not o.is_terminating(p)]
    ready = sum(1 for p in live if o.is_pod_ready(p))

    def change(obj: Obj) -> None:
        revision = f"{name}-{o.stable_hash(obj['spec']['template'], 10)}"
        obj["status"] = {
            "observedGeneration": obj["metadata"].get("generation", 1),
            "replicas": len(live),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": len(live),
            "updatedReplicas": len(live),
            "currentRevision": revision,
            "updateRevision": revision,
            "collisionCount": 0,
        }

    cp.store.mutate("statefulsets", namespace, name, change)


def _group_pod(lws: Obj, index: int, worker: int, size: int, template_hash: str, owner: Obj) -> Obj:
    namespace, name = o.namespace_of(lws), o.name_of(lws)
    leader_name = f"{name}-{index}"
    pod_name = leader_name if worker == 0 else f"{leader_name}-{worker}"
    template = _template(lws, leader=worker == 0)
    meta = template.get("metadata") or {}
    pod_labels = dict(meta.get("labels") or {})
    pod_labels.update(
        {
            LWS_NAME_LABEL: name,
            LWS_GROUP_INDEX_LABEL: str(index),
            LWS_WORKER_INDEX_LABEL: str(worker),
            LWS_GROUP_KEY_LABEL: group_key(namespace, leader_name),
            TEMPLATE_HASH_LABEL: template_hash,
            "apps.kubernetes.io/pod-index": str(index if worker == 0 else worker),
            "statefulset.kubernetes.io/pod-name": pod_name,
        }
    )
    annotations = dict(meta.get("annotations") or {})
    annotations[SIZE_ANNOTATION] = str(size)
    if worker:
        annotations[LEADER_NAME_ANNOTATION] = leader_name
    exclusive = (lws["metadata"].get("annotations") or {}).get(EXCLUSIVE_TOPOLOGY_ANNOTATION)
    if exclusive:
        annotations[EXCLUSIVE_TOPOLOGY_ANNOTATION] = exclusive
    spec = template.get("spec") or {}
    spec["hostname"] = pod_name
    spec["subdomain"] = name
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{leader_name}.{name}.{namespace}"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for container in spec.get("containers") or []:
        container["env"] = [
            e for e in container.get("env") or [] if e["name"] not in {x["name"] for x in env}
        ] + env
    return {
        "metadata": {
            "name": pod_name,
            "namespace": namespace,
            "labels": pod_labels,
            "annotations": annotations,
            "ownerReferences": [owner],
        },
        "spec": spec,
    }


def _status(cp: ControlPlane, lws: Obj, replicas: int, ready_groups: int, existing_groups: int) -> None:
    name = o.name_of(lws)
    stamp = cp.clock.timestamp()

    def change(obj: Obj) -> None:
        status = obj.setdefault("status", {})
        status["replicas"] = existing_groups
        status["readyReplicas"] = ready_groups
        status["updatedReplicas"] = existing_groups
        status["observedGeneration"] = obj["metadata"].get("generation", 1)
        status["hpaPodSelector"] = f"{LWS_NAME_LABEL}={name},{LWS_WORKER_INDEX_LABEL}=0"
        if ready_groups >= replicas:
            o.set_condition(
                obj, "Available", "True", stamp, "AllGroupsReady", "All replicas are ready", style="meta"
            )
            o.set_condition(obj, "Progressing", "False", stamp, "Ready", "Replicas are ready", style="meta")
        else:
            o.set_condition(
                obj,
                "Available",
                "False",
                stamp,
                "AllGroupsReady",
                f"{ready_groups} of {replicas} groups ready",
                style="meta",
            )
            o.set_condition(
                obj,
                "Progressing",
                "True",
                stamp,
                "GroupsProgressing",
                "Replicas are progressing",
                style="meta",
            )

    cp.store.mutate("leaderworkersets", o.namespace_of(lws), name, change)


def _delete_pods_of_missing_sets(cp: ControlPlane) -> None:
    live = {(o.namespace_of(lws), o.name_of(lws)) for lws in cp.store.list_view("leaderworkersets")}
    for pod in cp.store.list_view("pods", label_selector=LWS_NAME_LABEL):
        if (o.namespace_of(pod), o.labels(pod)[LWS_NAME_LABEL]) not in live and not o.is_terminating(pod):
            cp.delete("pods", o.namespace_of(pod), o.name_of(pod))
