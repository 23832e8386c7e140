"""The scheduler: binds pending pods to nodes with room for their ``nvidia.com/gpu`` request.

Filters as kube-scheduler reports them: ``spec.unschedulable``, untolerated
NoSchedule/NoExecute taints, ``nodeSelector``, insufficient GPUs, and for
LeaderWorkerSet groups with the exclusive-topology annotation, one topology
domain per group. Scoring is LeastAllocated (most free GPUs first, then name),
or, when the scenario asks for it (``scheduler.scoring``), MostAllocated: the fewest free GPUs
that fit first, a node already in use before an empty one, and at most ``SPREAD_SKEW`` pods of one
ReplicaSet per node while another node fits (a soft spread over hosts); placements are deterministic. A pod that fits nowhere stays Pending with
``PodScheduled=False/Unschedulable`` and a ``FailedScheduling`` event such as
``0/4 nodes are available: 4 Insufficient nvidia.com/gpu. ...`` — even when the
cluster has enough free GPUs in total (fragmentation).

Pods with ``spec.resourceClaims`` (Dynamic Resource Allocation) are placed as the scheduler's
DynamicResources plugin places them: a node fits when every unallocated claim of the pod can get its
devices there (``sim.k8s.devices.Allocator``: free, untainted or tolerated, matching the CEL
selectors), else the node counts as ``cannot allocate all claims``; an already allocated claim pins
the pod to its node. The allocation is written to the claims' status (results, nodeSelector,
reservedFor) before the pod is bound; their free devices score nodes as free GPUs do. A device-plugin
pod's GPU indices are recorded when it is bound (``GpuLedger.bind``), as the plugin's Allocate does.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from fleet.vocabulary import GPU_RESOURCE, LWS_GROUP_KEY_LABEL
from sim.k8s import devices as dv
from sim.k8s import objects as o
from sim.k8s.controllers.lws import EXCLUSIVE_TOPOLOGY_ANNOTATION

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
COMPONENT = "default-scheduler"
# MostAllocated keeps a ReplicaSet's pods at most this many per node while another busy node fits
# them (a soft spread over hosts, kube-scheduler's default PodTopologySpread in spirit).
SPREAD_SKEW = 2


def _free_gpus(cp: ControlPlane, nodes: list[Obj]) -> dict[str, int]:
    free = {o.name_of(n): o.node_gpus(n) for n in nodes}
    for pod in cp.store.list_view("pods"):
        node = pod.get("spec", {}).get("nodeName")
        if node in free and not o.is_pod_terminal(pod):
            free[node] -= o.pod_gpus(pod)
    return free


def _filter_reason(pod: Obj, node: Obj, free: int) -> str | None:
    spec = pod.get("spec", {})
    tolerations = spec.get("tolerations") or []
    for taint in node.get("spec", {}).get("taints") or []:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if o.tolerates(tolerations, taint) is None:
            if taint.get("key") == "node.kubernetes.io/unschedulable":
                return "node(s) were unschedulable"
            return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value', '')}}}"
    if node.get("spec", {}).get("unschedulable") and not any(
        t.get("key") == "node.kubernetes.io/unschedulable" for t in tolerations
    ):
        return "node(s) were unschedulable"
    node_labels = o.labels(node)
    for key, value in (spec.get("nodeSelector") or {}).items():
        if node_labels.get(key) != value:
            return "node(s) didn't match Pod's node affinity/selector"
    if not _required_affinity_matches(spec, node):
        return "node(s) didn't match Pod's node affinity/selector"
    if o.pod_gpus(pod) > free:
        return f"Insufficient {GPU_RESOURCE}"
    return None


def _expression_matches(expr: Obj, values_of: dict[str, str]) -> bool:
    key, op, values = expr.get("key", ""), expr.get("operator", ""), list(expr.get("values") or [])
    present = key in values_of
    if op == "In":
        return present and values_of[key] in values
    if op == "NotIn":
        return not present or values_of[key] not in values
    if op == "Exists":
        return present
    if op == "DoesNotExist":
        return not present
    if op in ("Gt", "Lt") and present and values:
        try:
            have, want = int(values_of[key]), int(values[0])
        except ValueError:
            return False
        return have > want if op == "Gt" else have < want
    return False


def _required_affinity_matches(spec: Obj, node: Obj) -> bool:
    """``requiredDuringSchedulingIgnoredDuringExecution``: any term matches (its expressions all do)."""
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if not required:
        return True
    labels = o.labels(node)
    fields = {"metadata.name": o.name_of(node)}
    for term in required.get("nodeSelectorTerms") or []:
        exprs = term.get("matchExpressions") or []
        field_exprs = term.get("matchFields") or []
        if not exprs and not field_exprs:
            continue  # an empty term matches no objects
        if all(_expression_matches(e, labels) for e in exprs) and all(
            _expression_matches(e, fields) for e in field_exprs
        ):
            return True
    return False


def _failure_message(total: int, reasons: Counter[str]) -> str:
    parts = sorted(f"{count} {reason}" for reason, count in reasons.items())
    insufficient = sum(c for r, c in reasons.items() if r.startswith("Insufficient"))
    preemption = []
    if insufficient:
        preemption.append(f"{insufficient} No preemption victims found for incoming pod")
    if total - insufficient:
        preemption.append(f"{total - insufficient} Preemption is not helpful for scheduling")
    return (
        f"0/{total} nodes are available: {', '.join(parts)}. "
        f"preemption: 0/{total} nodes are available: {', '.join(sorted(preemption))}."
    )


def schedule_pending_pods(cp: ControlPlane) -> None:
    pending = [
        p
        for p in cp.store.list_view("pods")
        if not p.get("spec", {}).get("nodeName")
        and not o.is_terminating(p)
        and p.get("spec", {}).get("schedulerName", COMPONENT) == COMPONENT
    ]
    if not pending:
        return
    nodes = cp.store.list_view("nodes")
    free = _free_gpus(cp, nodes)
    alloc = dv.Allocator(cp.store) if any(dv.pod_uses_claims(p) for p in pending) else None
    siblings = _owners_by_node(cp) if cp.scoring == "MostAllocated" else None
    pending.sort(key=lambda p: cp.store.creation_order(o.uid_of(p)))
    handled: set[str] = set()
    for pod in pending:
        uid = o.uid_of(pod)
        if uid in handled:
            continue
        key = o.labels(pod).get(LWS_GROUP_KEY_LABEL)
        topology = (pod["metadata"].get("annotations") or {}).get(EXCLUSIVE_TOPOLOGY_ANNOTATION)
        if key and topology:
            gang = [
                p
                for p in pending
                if o.labels(p).get(LWS_GROUP_KEY_LABEL) == key and o.namespace_of(p) == o.namespace_of(pod)
            ]
            handled.update(o.uid_of(p) for p in gang)
            _schedule_gang(cp, gang, nodes, free, topology, alloc)
        else:
            handled.add(uid)
            _schedule_one(cp, pod, nodes, free, siblings, alloc)


def _owner(pod: Obj) -> str | None:
    refs = pod["metadata"].get("ownerReferences") or []
    return refs[0].get("uid") if refs else None


def _owners_by_node(cp: ControlPlane) -> dict[str, Counter[str]]:
    """Pods per owner on every node (the spread MostAllocated keeps among a ReplicaSet's pods)."""
    out: dict[str, Counter[str]] = {}
    for pod in cp.store.list_view("pods"):
        node, owner = pod.get("spec", {}).get("nodeName"), _owner(pod)
        if node and owner and not o.is_pod_terminal(pod):
            out.setdefault(node, Counter())[owner] += 1
    return out


def _bind(
    cp: ControlPlane,
    pod: Obj,
    node_name: str,
    free: dict[str, int],
    siblings: dict[str, Counter[str]] | None = None,
) -> None:
    free[node_name] -= o.pod_gpus(pod)
    owner = _owner(pod)
    if siblings is not None and owner:
        siblings.setdefault(node_name, Counter())[owner] += 1
    stamp = cp.clock.timestamp()

    def change(obj: Obj) -> None:
        obj["spec"]["nodeName"] = node_name
        o.set_condition(obj, "PodScheduled", "True", stamp)

    cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), change)
    if o.pod_gpus(pod):  # the device plugin's Allocate: the GPU indices the pod keeps
        node = cp.store.view("nodes", "", node_name) or {}
        capacity = int(((node.get("status") or {}).get("capacity") or {}).get(GPU_RESOURCE, 0) or 0)
        cp.devices.bind(pod, node_name, capacity)
    cp.scheduler_memory.pop(o.uid_of(pod), None)
    cp.events.record(
        pod,
        "Scheduled",
        f"Successfully assigned {o.namespace_of(pod)}/{o.name_of(pod)} to {node_name}",
        component=COMPONENT,
    )


def _unschedulable(cp: ControlPlane, pod: Obj, message: str) -> None:
    now = cp.now()
    uid = o.uid_of(pod)
    last = cp.scheduler_memory.get(uid)
    if last is not None and last[0] == message and now - last[1] < cp.timings.scheduler_retry_s:
        cp.wake_at(last[1] + cp.timings.scheduler_retry_s)
        return
    cp.scheduler_memory[uid] = (message, now)
    cp.wake_at(now + cp.timings.scheduler_retry_s)
    stamp = cp.clock.timestamp()
    cp.store.mutate(
        "pods",
        o.namespace_of(pod),
        o.name_of(pod),
        lambda obj: o.set_condition(obj, "PodScheduled", "False", stamp, "Unschedulable", message),
    )
    cp.events.record(pod, "FailedScheduling", message, event_type="Warning", component=COMPONENT)


def _prefilter_failure(total: int, reason: str) -> str:
    return (
        f"0/{total} nodes are available: {reason}. "
        f"preemption: 0/{total} nodes are available: {total} Preemption is not helpful for scheduling."
    )


def _claims_of(cp: ControlPlane, pod: Obj, alloc: dv.Allocator | None, total: int) -> list[Obj] | bool | None:
    """The pod's ResourceClaims (None: the pod claims nothing); False after marking it unschedulable."""
    if alloc is None or not dv.pod_uses_claims(pod):
        return None
    claims = alloc.claims(pod)
    if isinstance(claims, str):
        _unschedulable(cp, pod, _prefilter_failure(total, claims))
        return False
    return claims


def _schedule_one(
    cp: ControlPlane,
    pod: Obj,
    nodes: list[Obj],
    free: dict[str, int],
    siblings: dict[str, Counter[str]] | None = None,
    alloc: dv.Allocator | None = None,
) -> None:
    claims = _claims_of(cp, pod, alloc, len(nodes))
    if claims is False:
        return
    reasons: Counter[str] = Counter()
    candidates: list[Obj] = []
    fits: dict[str, dv.Fit] = {}
    for node in nodes:
        reason = _filter_reason(pod, node, free[o.name_of(node)])
        if reason is None and alloc is not None and isinstance(claims, list):
            try:
                fit = alloc.fit(claims, o.name_of(node))
            except dv.UnsupportedSelector as exc:
                _unschedulable(cp, pod, _prefilter_failure(len(nodes), str(exc)))
                return
            if isinstance(fit, str):
                reason = fit
            else:
                fits[o.name_of(node)] = fit
        if reason is None:
            candidates.append(node)
        else:
            reasons[reason] += 1
    if not candidates:
        _unschedulable(cp, pod, _failure_message(len(nodes), reasons))
        return

    def room(n: Obj) -> int:
        return (
            alloc.free_count(o.name_of(n))
            if alloc is not None and isinstance(claims, list)
            else free[o.name_of(n)]
        )

    def size(n: Obj) -> int:
        if alloc is not None and isinstance(claims, list):
            return len(alloc.by_node.get(o.name_of(n), []))
        return o.node_gpus(n)

    def need(n: Obj) -> int:
        fit = fits.get(o.name_of(n))
        return len(fit.devices) if fit is not None else o.pod_gpus(pod)

    if siblings is None:  # LeastAllocated
        best = min(candidates, key=lambda n: (-(room(n) - need(n)), o.name_of(n)))
    else:  # MostAllocated: at most SPREAD_SKEW siblings per node while others fit, busy nodes before empty ones
        owner = _owner(pod) or ""
        best = min(
            candidates,
            key=lambda n: (
                room(n) == size(n),
                siblings.get(o.name_of(n), Counter())[owner] >= SPREAD_SKEW,
                room(n) - need(n),
                o.name_of(n),
            ),
        )
    if alloc is not None and isinstance(claims, list):
        alloc.commit(pod, o.name_of(best), claims, fits[o.name_of(best)])
    _bind(cp, pod, o.name_of(best), free, siblings)


def _schedule_gang(
    cp: ControlPlane,
    gang: list[Obj],
    nodes: list[Obj],
    free: dict[str, int],
    topology: str,
    alloc: dv.Allocator | None = None,
) -> None:
    """Place all pending pods of one LWS group inside one topology domain held by no other group."""
    claims_of: dict[str, list[Obj] | None] = {}
    for member in gang:
        claims = _claims_of(cp, member, alloc, len(nodes))
        if claims is False:
            for other in gang:
                if other is not member:
                    _unschedulable(
                        cp, other, _prefilter_failure(len(nodes), "waiting for the group's claims")
                    )
            return
        claims_of[o.uid_of(member)] = claims if isinstance(claims, list) else None
    sample = gang[0]
    key = o.labels(sample)[LWS_GROUP_KEY_LABEL]
    namespace = o.namespace_of(sample)
    node_by_name = {o.name_of(n): n for n in nodes}
    domain_of = {o.name_of(n): o.labels(n).get(topology) for n in nodes}
    group_pods = cp.store.list_view("pods", namespace, f"{LWS_GROUP_KEY_LABEL}={key}")
    bound_domains = {
        domain_of.get(p["spec"].get("nodeName")) for p in group_pods if p.get("spec", {}).get("nodeName")
    }
    taken: set[str | None] = set()
    for pod in cp.store.list_view("pods"):
        node = pod.get("spec", {}).get("nodeName")
        other_key = o.labels(pod).get(LWS_GROUP_KEY_LABEL)
        if (
            node
            and other_key
            and other_key != key
            and (pod["metadata"].get("annotations") or {}).get(EXCLUSIVE_TOPOLOGY_ANNOTATION) == topology
        ):
            taken.add(domain_of.get(node))
    domains = sorted({d for d in domain_of.values() if d is not None})
    if bound_domains:
        domains = [d for d in domains if d in bound_domains]
    reasons: Counter[str] = Counter()
    for domain in sorted(domains, key=lambda d: (-sum(free[n] for n, dd in domain_of.items() if dd == d), d)):
        if domain in taken:
            continue
        trial = dict(free)
        in_use: set[dv.DeviceKey] = set()
        placement: list[tuple[Obj, str, dv.Fit | None]] = []
        for pod in sorted(
            gang, key=lambda p: int(o.labels(p).get("leaderworkerset.sigs.k8s.io/worker-index", 0))
        ):
            claims = claims_of[o.uid_of(pod)]
            fits: list[tuple[Obj, dv.Fit | None]] = []
            for n, d in domain_of.items():
                if d != domain or _filter_reason(pod, node_by_name[n], trial[n]) is not None:
                    continue
                fit: dv.Fit | str | None = None
                if alloc is not None and claims is not None:
                    try:
                        fit = alloc.fit(claims, n, in_use)
                    except dv.UnsupportedSelector as exc:
                        for member in gang:
                            _unschedulable(cp, member, _prefilter_failure(len(nodes), str(exc)))
                        return
                    if isinstance(fit, str):
                        continue
                fits.append((node_by_name[n], fit if isinstance(fit, dv.Fit) else None))
            if not fits:
                break

            def room(item: tuple[Obj, dv.Fit | None], trial: dict[str, int] = trial, pod: Obj = pod) -> int:
                if item[1] is not None and alloc is not None:
                    return alloc.free_count(o.name_of(item[0])) - len(item[1].devices)
                return trial[o.name_of(item[0])] - o.pod_gpus(pod)

            best, best_fit = min(fits, key=lambda item: (-room(item), o.name_of(item[0])))
            trial[o.name_of(best)] -= o.pod_gpus(pod)
            if best_fit is not None:
                in_use |= best_fit.devices
            placement.append((pod, o.name_of(best), best_fit))
        if len(placement) == len(gang):
            for pod, node_name, placed in placement:
                claims = claims_of[o.uid_of(pod)]
                if alloc is not None and claims is not None and placed is not None:
                    alloc.commit(pod, node_name, claims, placed)
                _bind(cp, pod, node_name, free)
            return
    for node in nodes:
        name = o.name_of(node)
        reason = _filter_reason(sample, node, free[name])
        if reason is None and (
            domain_of.get(name) is None or domain_of.get(name) in taken or domain_of.get(name) not in domains
        ):
            reason = (
                "node(s) didn't match pod anti-affinity rules"
                if domain_of.get(name) in taken
                else "node(s) didn't match pod affinity rules"
            )
        if reason is None:
            reason = (
                dv.UNSCHEDULABLE_REASON if claims_of.get(o.uid_of(sample)) else f"Insufficient {GPU_RESOURCE}"
            )
        reasons[reason] += 1
    message = _failure_message(len(nodes), reasons)
    for pod in gang:
        _unschedulable(cp, pod, message)
