"""DaemonSet controller: one daemon pod on every node the DaemonSet's pod template fits.

A node fits when it matches the template's ``nodeSelector`` and every ``NoSchedule``/``NoExecute``
taint on it is tolerated. As the real controller does, each daemon pod gets the DaemonSet's
default tolerations (``not-ready``/``unreachable`` NoExecute without a time limit; the
``unschedulable``, ``disk-pressure``, ``memory-pressure`` and ``pid-pressure`` NoSchedule taints), so a
cordoned or drained node keeps its daemon pods and a lost node's daemon pods stay where they are
(nobody evicts them; pod GC removes them with the Node object). The pod is bound to its node
(``spec.nodeName``, plus the ``matchFields metadata.name`` node affinity the real controller writes),
so the scheduler never moves it: a daemon pod deleted by hand is recreated on the same node, never
elsewhere. A changed template replaces outdated pods one node at a time (RollingUpdate,
maxUnavailable 1).

Daemon pods are plain containers (no ``fleetmend.io/model`` label: no engine, no GPU request;
the kubelet starts them after the default image pull).

At fleet size this costs nothing per tick while nothing changes: the controller is event-driven.
A store watcher marks it dirty on a DaemonSet change, a node added or removed or whose labels,
taints or unschedulable flag changed, and a change to a pod a DaemonSet owns; a reconcile pass
with nothing dirty returns at once.
"""

from __future__ import annotations

import copy
import random
from typing import TYPE_CHECKING, Any

from sim.k8s import objects as o
from sim.k8s.selectors import matches_label_selector_object
from sim.k8s.store import WatchEvent

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
KIND = "DaemonSet"
TEMPLATE_GENERATION_LABEL = "pod-template-generation"
REVISION_HASH_LABEL = "controller-revision-hash"
# What daemon.AddOrUpdateDaemonPodTolerations adds to every daemon pod.
DEFAULT_TOLERATIONS: list[Obj] = [
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/disk-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/memory-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/pid-pressure", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"},
]


def _node_placement(node: Obj) -> tuple[Any, ...]:
    """What decides whether a daemon pod belongs on a node (a change here wakes the controller)."""
    spec = node.get("spec") or {}
    return (o.labels(node), spec.get("taints"), spec.get("unschedulable"))


def _is_daemon_pod(pod: Obj) -> bool:
    ref = o.controller_ref(pod)
    return ref is not None and ref.get("kind") == KIND


class DaemonSetController:
    """Keeps one pod per fitting node for every DaemonSet; idle unless something it reads changed."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.dirty = True
        # Its own names, so daemon pods never shift the names other controllers draw from cp.rng.
        self.rng = random.Random(0)
        cp.store.watch(self._on_change)

    # -------------------------------------------------------------- wake-ups
    def _on_change(self, event: WatchEvent) -> None:
        if self.dirty:
            return
        if event.resource == "daemonsets":
            self.dirty = True
        elif event.resource == "nodes":
            if event.type != "MODIFIED" or event.old is None:
                self.dirty = True
            elif _node_placement(event.old) != _node_placement(event.object):
                self.dirty = True
        elif event.resource == "pods" and _is_daemon_pod(event.object):
            self.dirty = True

    # -------------------------------------------------------------- reconcile
    def reconcile(self, cp: ControlPlane) -> None:
        if not self.dirty:
            return
        self.dirty = False
        daemonsets = cp.store.list_view("daemonsets")
        if not daemonsets:
            return
        nodes = cp.store.list_view("nodes")
        for ds in daemonsets:
            if not o.is_terminating(ds):
                self._sync(cp, ds, nodes)

    def _sync(self, cp: ControlPlane, ds: Obj, nodes: list[Obj]) -> None:
        namespace, uid = o.namespace_of(ds), o.uid_of(ds)
        spec = ds.get("spec") or {}
        template = spec.get("template") or {}
        generation = int(ds["metadata"].get("generation", 1))
        owned = [
            p
            for p in cp.store.owned_by("pods", uid)
            if o.namespace_of(p) == namespace
            and (ref := o.controller_ref(p)) is not None
            and ref.get("uid") == uid
        ]
        by_node: dict[str, list[Obj]] = {}
        for pod in owned:
            by_node.setdefault(pod.get("spec", {}).get("nodeName") or "", []).append(pod)
        # NodeShouldRunDaemonPod: a new pod needs every NoSchedule/NoExecute taint tolerated; a running
        # one stays unless a NoExecute taint is not (a lost node's unreachable:NoSchedule keeps it).
        wanted = {o.name_of(n) for n in nodes if _fits(template, n, ("NoSchedule", "NoExecute"))}
        keep = {o.name_of(n) for n in nodes if _fits(template, n, ("NoExecute",))}
        for node in sorted(wanted):
            if not [p for p in by_node.get(node, []) if not o.is_terminating(p)]:
                cp.create_pod(self._daemon_pod(ds, template, node, generation))
        # Pods on nodes that no longer fit (or vanished: pod GC has those) go.
        for node, pods in by_node.items():
            if node not in keep:
                for pod in pods:
                    if not o.is_terminating(pod):
                        cp.delete("pods", namespace, o.name_of(pod))
        self._roll(cp, ds, by_node, wanted, generation)
        self._write_status(cp, ds, by_node, wanted, generation)

    def _roll(
        self, cp: ControlPlane, ds: Obj, by_node: dict[str, list[Obj]], wanted: set[str], generation: int
    ) -> None:
        """RollingUpdate with maxUnavailable 1: replace one outdated pod while every other is ready."""
        if ((ds.get("spec") or {}).get("updateStrategy") or {}).get("type") == "OnDelete":
            return
        current = [p for node in wanted for p in by_node.get(node, []) if not o.is_terminating(p)]
        if len(current) < len(wanted) or not all(o.is_pod_ready(p) for p in current):
            return
        outdated = [p for p in current if _pod_generation(p) != generation]
        if outdated:
            victim = min(outdated, key=lambda p: p.get("spec", {}).get("nodeName", ""))
            cp.delete("pods", o.namespace_of(victim), o.name_of(victim))

    def _daemon_pod(self, ds: Obj, template: Obj, node: str, generation: int) -> Obj:
        meta = template.get("metadata") or {}
        pod_spec = copy.deepcopy(template.get("spec") or {})
        pod_spec["nodeName"] = node
        pod_spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
            }
        }
        tolerations: list[Obj] = pod_spec.setdefault("tolerations", [])
        for default in DEFAULT_TOLERATIONS:
            if not any(
                t.get("key") == default["key"] and t.get("effect") == default["effect"] for t in tolerations
            ):
                tolerations.append(dict(default))
        name = o.name_of(ds)
        labels = dict(meta.get("labels") or {})
        labels[REVISION_HASH_LABEL] = o.stable_hash(template)
        labels[TEMPLATE_GENERATION_LABEL] = str(generation)
        return {
            "metadata": {
                "name": f"{name}-{o.random_suffix(self.rng)}",
                "generateName": f"{name}-",
                "namespace": o.namespace_of(ds),
                "labels": labels,
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [o.owner_reference(ds)],
            },
            "spec": pod_spec,
        }

    def _write_status(
        self, cp: ControlPlane, ds: Obj, by_node: dict[str, list[Obj]], wanted: set[str], generation: int
    ) -> None:
        # Re-read: pods created or deleted above count from the next pass (their events re-dirty us).
        namespace, uid = o.namespace_of(ds), o.uid_of(ds)
        live: dict[str, list[Obj]] = {}
        for pod in cp.store.list_view("pods", namespace):
            ref = o.controller_ref(pod)
            if ref is not None and ref.get("uid") == uid and not o.is_terminating(pod):
                live.setdefault(pod.get("spec", {}).get("nodeName") or "", []).append(pod)
        scheduled = [node for node in live if node in wanted]
        ready = [node for node in scheduled if any(o.is_pod_ready(p) for p in live[node])]
        updated = [node for node in scheduled if any(_pod_generation(p) == generation for p in live[node])]
        status: Obj = {
            "currentNumberScheduled": len(scheduled),
            "numberMisscheduled": len([node for node in live if node not in wanted]),
            "desiredNumberScheduled": len(wanted),
            "numberReady": len(ready),
            "observedGeneration": generation,
            "updatedNumberScheduled": len(updated),
            "numberAvailable": len(ready),
        }
        if len(wanted) - len(ready) > 0:
            status["numberUnavailable"] = len(wanted) - len(ready)

        def write(obj: Obj) -> None:
            obj["status"] = status

        cp.store.mutate("daemonsets", namespace, o.name_of(ds), write)


def _pod_generation(pod: Obj) -> int:
    try:
        return int(o.labels(pod).get(TEMPLATE_GENERATION_LABEL, "0"))
    except ValueError:
        return 0


def _fits(template: Obj, node: Obj, effects: tuple[str, ...]) -> bool:
    pod_spec = template.get("spec") or {}
    labels = o.labels(node)
    for key, value in (pod_spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return False
    affinity = ((pod_spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if affinity and not _matches_node_selector_terms(affinity.get("nodeSelectorTerms") or [], node):
        return False
    tolerations = [*(pod_spec.get("tolerations") or []), *DEFAULT_TOLERATIONS]
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in effects and o.tolerates(tolerations, taint) is None:
            return False
    return True


def _matches_node_selector_terms(terms: list[Obj], node: Obj) -> bool:
    """Terms are ORed; a term's matchExpressions (same operators as label selectors) are ANDed."""
    for term in terms:
        expressions = term.get("matchExpressions") or []
        if matches_label_selector_object({"matchExpressions": expressions}, o.labels(node)):
            return True
    return not terms
