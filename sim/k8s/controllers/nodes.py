"""Node lifecycle controller, taint-eviction controller and garbage collector.

A lost node (its kubelet stopped posting status) goes ``Ready=Unknown`` after
the node-monitor grace period, gets the ``node.kubernetes.io/unreachable``
NoExecute and NoSchedule taints, and its pods are marked not Ready at once
(``MarkPodsNotReady``). The taint-eviction controller deletes each pod when its
toleration runs out (300 s by default, added at admission); with no kubelet to
confirm, those pods stay Terminating with reason ``NodeLost`` until the node
returns, the pod is force-deleted, or the node gets the out-of-service taint.
A cordoned node (``spec.unschedulable``) gets the unschedulable NoSchedule taint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim.clock import micro_timestamp, parse_timestamp
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
COMPONENT = "node-controller"
NODE_LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40  # the kubelet's --node-lease-duration-seconds default
LEASE_RENEW_S = 10.0  # the kubelet renews at a quarter of the duration
_NODE_CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
)


def _desired_taints(cp: ControlPlane, node: Obj, unreachable: bool) -> list[Obj]:
    from sim.k8s.controlplane import UNREACHABLE_TAINT, UNSCHEDULABLE_TAINT

    managed = {UNREACHABLE_TAINT, UNSCHEDULABLE_TAINT}
    current: list[Obj] = list(node.get("spec", {}).get("taints") or [])
    kept = [t for t in current if t.get("key") not in managed]
    wanted: list[Obj] = []
    if node.get("spec", {}).get("unschedulable"):
        wanted.append({"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"})
    if unreachable:
        wanted.append({"key": UNREACHABLE_TAINT, "effect": "NoSchedule"})
        wanted.append({"key": UNREACHABLE_TAINT, "effect": "NoExecute"})
    result = list(kept)
    for taint in wanted:
        existing = next(
            (t for t in current if t.get("key") == taint["key"] and t.get("effect") == taint["effect"]), None
        )
        if existing is not None:
            result.append(existing)
        else:
            if taint["effect"] == "NoExecute":
                taint["timeAdded"] = cp.clock.timestamp()
            result.append(taint)
    return result


def reconcile_nodes(cp: ControlPlane) -> None:
    now = cp.now()
    for node in cp.store.list_view("nodes"):
        name = o.name_of(node)
        lost_at = cp.lost_nodes.get(name)
        unreachable = lost_at is not None and now - lost_at >= cp.timings.node_monitor_grace_s
        if lost_at is not None and not unreachable:
            cp.wake_at(lost_at + cp.timings.node_monitor_grace_s)
        was_unknown = o.condition_status(node, "Ready") == "Unknown"
        inputs = (node["metadata"].get("resourceVersion"), lost_at, unreachable)
        if cp.node_sync.get(name) == inputs:
            continue  # written from the same node and the same facts: the write would change nothing

        def change(obj: Obj, lost_at: float | None = lost_at, unreachable: bool = unreachable) -> None:
            stamp = cp.clock.timestamp()
            for cond_type, status, reason, message in _NODE_CONDITIONS:
                if unreachable:
                    o.set_condition(
                        obj,
                        cond_type,
                        "Unknown",
                        stamp,
                        "NodeStatusUnknown",
                        "Kubelet stopped posting node status.",
                        style="node",
                    )
                elif lost_at is None:
                    o.set_condition(obj, cond_type, status, stamp, reason, message, style="node")
            taints = _desired_taints(cp, obj, unreachable)
            if taints:
                obj["spec"]["taints"] = taints
            else:
                obj["spec"].pop("taints", None)

        stored = cp.store.mutate("nodes", "", name, change)
        if stored is not None:
            cp.node_sync[name] = (stored["metadata"].get("resourceVersion"), lost_at, unreachable)
        if unreachable and not was_unknown:
            _mark_pods_not_ready(cp, name)


def _mark_pods_not_ready(cp: ControlPlane, node_name: str) -> None:
    stamp = cp.clock.timestamp()
    for pod in cp.store.list_view("pods", field_selector=f"spec.nodeName={node_name}"):

        def change(obj: Obj) -> None:
            if o.condition(obj, "Ready") is not None:
                o.set_condition(obj, "Ready", "False", stamp)

        cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), change)


def evict_tainted_pods(cp: ControlPlane) -> None:
    """Taint-eviction controller: delete pods that do not (or no longer) tolerate NoExecute taints."""
    now = cp.now()
    for node in cp.store.list_view("nodes"):
        taints = [t for t in node.get("spec", {}).get("taints") or [] if t.get("effect") == "NoExecute"]
        if not taints:
            continue
        node_name = o.name_of(node)
        for pod in cp.store.list_view("pods", field_selector=f"spec.nodeName={node_name}"):
            if o.is_terminating(pod):
                continue
            tolerations = pod.get("spec", {}).get("tolerations") or []
            due = float("inf")
            for taint in taints:
                toleration = o.tolerates(tolerations, taint)
                if toleration is None:
                    due = now
                    break
                seconds = toleration.get("tolerationSeconds")
                if seconds is None:
                    continue
                added = parse_timestamp(taint["timeAdded"]) if taint.get("timeAdded") else now
                due = min(due, added + max(0, int(seconds)))
            if due > now:
                if due != float("inf"):
                    cp.wake_at(due)
                continue
            _taint_delete(cp, pod, node_name)


def _taint_delete(cp: ControlPlane, pod: Obj, node_name: str) -> None:
    stamp = cp.clock.timestamp()
    lost = cp.is_node_lost(node_name)

    def mark(obj: Obj) -> None:
        o.set_condition(
            obj,
            "DisruptionTarget",
            "True",
            stamp,
            "DeletionByTaintManager",
            "Taint manager: deleting due to NoExecute taint",
        )
        if lost:
            obj["status"]["reason"] = "NodeLost"
            obj["status"]["message"] = (
                f"Node {node_name} which was running pod {o.name_of(obj)} is unresponsive"
            )

    cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), mark)
    cp.events.record(
        pod,
        "TaintManagerEviction",
        f"Marking for deletion Pod {o.namespace_of(pod)}/{o.name_of(pod)}",
        component="taint-eviction-controller",
    )
    cp.delete("pods", o.namespace_of(pod), o.name_of(pod))


def collect_garbage(cp: ControlPlane) -> None:
    """Pod GC (pods on vanished or out-of-service nodes) and owner-reference garbage collection."""
    from sim.k8s.controlplane import OUT_OF_SERVICE_TAINT

    nodes = {o.name_of(n): n for n in cp.store.list_view("nodes")}
    out_of_service_nodes = any(
        t.get("key") == OUT_OF_SERVICE_TAINT
        for n in nodes.values()
        for t in n.get("spec", {}).get("taints") or []
    )
    store = cp.store
    # What the collection follows: objects created or removed, owners changed, nodes written, and pods
    # written while a node is out of service. None of it changed since the last run: nothing to collect.
    inputs = (
        store.created_or_removed,
        store.owners_changed,
        store.written_at("nodes"),
        store.written_at("pods") if out_of_service_nodes else 0,
    )
    if cp.gc_inputs == inputs:
        return
    cp.gc_inputs = inputs
    for pod in cp.store.list_view("pods"):
        node_name = pod.get("spec", {}).get("nodeName")
        if not node_name:
            continue
        node = nodes.get(node_name)
        out_of_service = node is not None and any(
            t.get("key") == OUT_OF_SERVICE_TAINT for t in node.get("spec", {}).get("taints") or []
        )
        if node is None or (out_of_service and o.is_terminating(pod)):
            cp.delete("pods", o.namespace_of(pod), o.name_of(pod), grace_seconds=0)
    # ownerReference GC for the kinds the sim stores (background propagation).
    owner_plurals = {
        "Deployment": "deployments",
        "ReplicaSet": "replicasets",
        "StatefulSet": "statefulsets",
        "LeaderWorkerSet": "leaderworkersets",
        "Service": "services",
        "Pod": "pods",
        "Job": "jobs",
        "DaemonSet": "daemonsets",
    }
    live_uids = {o.uid_of(obj) for plural in owner_plurals.values() for obj in cp.store.list_view(plural)}
    for plural in ("replicasets", "statefulsets", "pods", "endpointslices", "services"):
        for obj in cp.store.list_view(plural):
            refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("kind") in owner_plurals]
            if refs and all(r.get("uid") not in live_uids for r in refs) and not o.is_terminating(obj):
                cp.delete(plural, o.namespace_of(obj), o.name_of(obj))


def renew_node_leases(cp: ControlPlane) -> None:
    """Each reachable node's kubelet renews its Lease in ``kube-node-lease`` every 10 s (heartbeat).

    A lost node's lease stops being renewed, so ``kubectl describe node`` shows its last RenewTime.
    """
    now = cp.now()
    for node in cp.store.list_view("nodes"):
        name = o.name_of(node)
        if cp.is_node_lost(name):
            continue
        lease = cp.store.view("leases", NODE_LEASE_NAMESPACE, name)
        if lease is not None:
            renewed = lease.get("spec", {}).get("renewTime")
            if renewed and now - parse_timestamp(renewed) < LEASE_RENEW_S:
                cp.wake_at(parse_timestamp(renewed) + LEASE_RENEW_S)
                continue

            def renew(obj: Obj) -> None:
                obj["spec"]["renewTime"] = micro_timestamp(now)

            cp.store.mutate("leases", NODE_LEASE_NAMESPACE, name, renew)
            cp.wake_at(now + LEASE_RENEW_S)
            continue
        cp.store.create(
            "leases",
            {
                "metadata": {
                    "name": name,
                    "namespace": NODE_LEASE_NAMESPACE,
                    "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": name, "uid": o.uid_of(node)}
                    ],
                },
                "spec": {
                    "holderIdentity": name,
                    "leaseDurationSeconds": LEASE_DURATION_S,
                    "renewTime": micro_timestamp(now),
                },
            },
        )
        cp.wake_at(now + LEASE_RENEW_S)
