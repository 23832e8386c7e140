"""Dynamic Resource Allocation controllers: the NVIDIA driver's slices, the resourceclaim controller and the
device taint eviction controller.

**ResourceSlices** (``publish_driver_slices``): in a DRA world every GPU node (GPU feature discovery's
``nvidia.com/gpu.present``/``gpu.count`` labels) has the driver's slice; a deleted node's slice goes.

**ResourceClaims for pods** (kube-controller-manager's resourceclaim controller): for each pod entry
``spec.resourceClaims[]`` naming a ``resourceClaimTemplateName``, a ResourceClaim
``<pod>-<claim>-<5 chars>`` is created from the template's ``spec.spec`` (owned by the pod, annotated
``resource.kubernetes.io/pod-claim-name: <claim>``) and recorded in the pod's
``status.resourceClaimStatuses``. A claim's ``status.reservedFor`` loses pods that are gone or ended,
and a claim reserved for nobody is deallocated; a generated claim goes with its pod.

**DeviceTaintRules** (``spec.deviceSelector`` {driver, pool, device}, ``spec.taint``): effect
``NoSchedule`` keeps new allocations off the selected devices (``sim.k8s.devices.Allocator``);
``NoExecute`` also evicts (deletes, with a ``DisruptionTarget`` condition, as the taint eviction
controller does) every pod whose allocated claim holds a selected device and whose request does not
tolerate the taint (a toleration with ``tolerationSeconds`` delays it). A device taint with effect
NoExecute in a ResourceSlice evicts the same way. ``status.conditions`` carries
``EvictionInProgress``: True while pods remain to be evicted, else False, the message counting pods
pending and evicted. For ``effect: None`` the condition is set once per spec change (its
``observedGeneration``) with status False and a message naming what NoExecute would evict:
``"2 pods would be evicted: ns/a, ns/b"`` (``"0 pods would be evicted"`` when none). The messages and
reasons (``PodsPendingEviction``, ``NoPodsPendingEviction``, ``EffectNone``, ``EffectNoSchedule``) are the
simulator's own wording; the API only says the message counts pending and evicted pods. Deleting a
rule removes its effect at once (allocation reads the current rules).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from sim.clock import parse_timestamp
from sim.k8s import devices as dv
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
CLAIM_COMPONENT = "resource_claim"
EVICTION_COMPONENT = "device-taint-eviction-controller"
_MAX_BASE_LEN = 57  # generateName base: leaves room for 5 random characters in 63


def _claim_generate_name(pod: str, claim: str) -> str:
    """The generateName the resourceclaim controller uses: both parts cut in proportion when long."""
    base = f"{pod}-{claim}-"
    if len(base) > _MAX_BASE_LEN:
        base = f"{pod[: len(pod) * _MAX_BASE_LEN // len(base)]}-{claim[: len(claim) * _MAX_BASE_LEN // len(base)]}-"
    return base


def publish_driver_slices(cp: ControlPlane) -> None:
    """NVIDIA's DRA driver (a world with the DeviceClass ``gpu.nvidia.com``): every GPU node has its
    ResourceSlice; a slice whose node is gone is removed (the node's plugin went with it)."""
    store = cp.store
    inputs = (
        store.written_at("nodes"),
        store.written_at("resourceslices"),
        store.written_at("deviceclasses"),
    )
    if cp.dra_slice_inputs == inputs:
        return
    cp.dra_slice_inputs = inputs
    if store.view("deviceclasses", "", dv.GPU_DEVICE_CLASS) is None:
        return
    nodes = {o.name_of(n): n for n in store.list_view("nodes")}
    published: set[str] = set()
    for found in list(store.list_view("resourceslices")):
        spec = found.get("spec") or {}
        if spec.get("driver") != dv.GPU_DRIVER or not spec.get("nodeName"):
            continue
        if spec["nodeName"] not in nodes:
            cp.delete("resourceslices", "", o.name_of(found))
        else:
            published.add(spec["nodeName"])
    for name, node in nodes.items():
        labels = o.labels(node)
        try:
            count = int(labels.get("nvidia.com/gpu.count", "0"))
        except ValueError:
            count = 0
        if name in published or labels.get("nvidia.com/gpu.present") != "true" or count <= 0:
            continue
        product = labels.get("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3").replace("-", " ")
        cp.ensure_exists("resourceslices", dv.resource_slice(name, count, product))


def reconcile_resource_claims(cp: ControlPlane) -> None:
    store = cp.store
    if not store.list_view("resourceclaimtemplates") and not store.list_view("resourceclaims"):
        return
    pods = {o.uid_of(p): p for p in store.list_view("pods")}
    for pod in pods.values():
        if dv.pod_uses_claims(pod) and not o.is_terminating(pod) and not o.is_pod_terminal(pod):
            _ensure_claims(cp, pod)
    for claim in list(store.list_view("resourceclaims")):
        _release(cp, claim, pods)


def _ensure_claims(cp: ControlPlane, pod: Obj) -> None:
    store = cp.store
    namespace, name, uid = o.namespace_of(pod), o.name_of(pod), o.uid_of(pod)
    statuses = {s.get("name"): s for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []}
    wanted: list[Obj] = []
    for entry in pod["spec"].get("resourceClaims") or []:
        pod_claim, template_name = entry.get("name", ""), entry.get("resourceClaimTemplateName")
        if not template_name:
            continue
        if pod_claim in statuses:
            wanted.append(statuses[pod_claim])
            continue
        owned = next(
            (
                c
                for c in store.owned_by("resourceclaims", uid)
                if (c["metadata"].get("annotations") or {}).get(dv.POD_CLAIM_NAME_ANNOTATION) == pod_claim
            ),
            None,
        )
        if owned is None:
            template = store.view("resourceclaimtemplates", namespace, template_name)
            if template is None:
                message = (
                    f"PodResourceClaim {pod_claim}: resource claim template {template_name!r}: "
                    f'resourceclaimtemplate.resource.k8s.io "{template_name}" not found'
                )
                memory = cp.scheduler_memory.get(f"claim/{uid}")
                if memory is None or memory[0] != message:
                    cp.scheduler_memory[f"claim/{uid}"] = (message, cp.now())
                    cp.events.record(
                        pod,
                        "FailedResourceClaimCreation",
                        message,
                        event_type="Warning",
                        component=CLAIM_COMPONENT,
                    )
                continue
            meta = template.get("metadata") or {}
            claim: Obj = {
                "apiVersion": dv.DRA_API_VERSION,
                "kind": "ResourceClaim",
                "metadata": {
                    "name": _claim_generate_name(name, pod_claim) + o.random_suffix(cp.rng),
                    "namespace": namespace,
                    "labels": dict(meta.get("labels") or {}),
                    "annotations": {
                        **(meta.get("annotations") or {}),
                        dv.POD_CLAIM_NAME_ANNOTATION: pod_claim,
                    },
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": name,
                            "uid": uid,
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": copy.deepcopy((template.get("spec") or {}).get("spec") or {}),
            }
            if not claim["metadata"]["labels"]:
                del claim["metadata"]["labels"]
            owned = store.create("resourceclaims", claim)
        wanted.append({"name": pod_claim, "resourceClaimName": o.name_of(owned)})
    current = (pod.get("status") or {}).get("resourceClaimStatuses") or []
    if wanted and wanted != current:

        def change(obj: Obj) -> None:
            obj.setdefault("status", {})["resourceClaimStatuses"] = wanted

        store.mutate("pods", namespace, name, change)


def _release(cp: ControlPlane, claim: Obj, pods: dict[str, Obj]) -> None:
    """Drop ended pods from ``reservedFor``; deallocate a claim nobody holds; delete a generated claim
    whose pod is gone."""
    namespace, name = o.namespace_of(claim), o.name_of(claim)
    owner = o.controller_ref(claim)
    if owner is not None and owner.get("kind") == "Pod" and owner.get("uid") not in pods:
        if not o.is_terminating(claim):
            cp.delete("resourceclaims", namespace, name)
        return
    status = claim.get("status") or {}
    reserved = status.get("reservedFor") or []
    keep = [
        r
        for r in reserved
        if r.get("resource") != "pods"
        or ((pod := pods.get(str(r.get("uid")))) is not None and not o.is_pod_terminal(pod))
    ]
    if keep == reserved and (keep or not status.get("allocation")):
        return

    def change(obj: Obj) -> None:
        st = obj.setdefault("status", {})
        if keep:
            st["reservedFor"] = keep
        else:
            st.pop("reservedFor", None)
            st.pop("allocation", None)
            st.pop("devices", None)

    if reserved or status.get("allocation"):
        cp.store.mutate("resourceclaims", namespace, name, change)


# ---------------------------------------------------------------------------------- taint eviction
def reconcile_device_taint_rules(cp: ControlPlane) -> None:
    store = cp.store
    rules = list(store.list_view("devicetaintrules"))
    slices = store.list_view("resourceslices")
    slice_taints = any(
        t.get("effect") == "NoExecute"
        for s in slices
        for d in (s.get("spec") or {}).get("devices") or []
        for t in d.get("taints") or []
    )
    if not rules and not slice_taints:
        return
    now = cp.now()
    devices = {d.key: d for d in dv.slice_devices(slices)}
    pods = {o.uid_of(p): p for p in store.list_view("pods")}
    # Who holds each allocated device: (pod, the tolerations its request carried).
    holders: dict[dv.DeviceKey, list[tuple[Obj, list[Obj]]]] = {}
    for claim in store.list_view("resourceclaims"):
        reserved = [
            pods[str(r.get("uid"))]
            for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods" and str(r.get("uid")) in pods
        ]
        requests = {
            r.get("name"): list((r.get("exactly") or {}).get("tolerations") or [])
            for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []
        }
        for result in dv.allocated_results(claim):
            key = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
            tolerations = list(result.get("tolerations") or requests.get(result.get("request"), []))
            for pod in reserved:
                holders.setdefault(key, []).append((pod, tolerations))
    # Slice taints with effect NoExecute evict like a rule's (no status to write).
    for key, device in devices.items():
        for taint in device.taints:
            if taint.get("effect") == "NoExecute":
                _evict(cp, [key], holders, taint, now)
    for rule in rules:
        _reconcile_rule(cp, rule, devices, holders, now)


def _affected(
    keys: list[dv.DeviceKey], holders: dict[dv.DeviceKey, list[tuple[Obj, list[Obj]]]], taint: Obj
) -> list[tuple[Obj, Obj | None]]:
    """(pod, the toleration that tolerates ``taint`` or None) for each pod holding one of ``keys``."""
    seen: dict[str, tuple[Obj, Obj | None]] = {}
    for key in keys:
        for pod, tolerations in holders.get(key, []):
            toleration = o.tolerates(tolerations, {**taint, "effect": "NoExecute"})
            uid = o.uid_of(pod)
            if uid not in seen or toleration is None:
                seen[uid] = (pod, toleration)
    return sorted(seen.values(), key=lambda item: (o.namespace_of(item[0]), o.name_of(item[0])))


def _evict(
    cp: ControlPlane,
    keys: list[dv.DeviceKey],
    holders: dict[dv.DeviceKey, list[tuple[Obj, list[Obj]]]],
    taint: Obj,
    now: float,
) -> tuple[int, int]:
    """Evict the pods holding ``keys`` that do not tolerate ``taint`` (NoExecute); (pending, evicted now)."""
    pending = evicted = 0
    for pod, toleration in _affected(keys, holders, taint):
        if o.is_pod_terminal(pod):
            continue
        if o.is_terminating(pod):
            pending += 1
            continue
        if toleration is not None:
            seconds = toleration.get("tolerationSeconds")
            if seconds is None:
                continue
            added = parse_timestamp(taint["timeAdded"]) if taint.get("timeAdded") else now
            due = added + max(0, int(seconds))
            if due > now:
                cp.wake_at(due)
                pending += 1
                continue
        _taint_delete(cp, pod, taint)
        evicted += 1
        pending += 1  # still terminating until its kubelet confirms
    return pending, evicted


def _taint_delete(cp: ControlPlane, pod: Obj, taint: Obj) -> None:
    stamp = cp.clock.timestamp()

    def mark(obj: Obj) -> None:
        o.set_condition(
            obj,
            "DisruptionTarget",
            "True",
            stamp,
            "DeletionByDeviceTaintManager",
            f"Device Taint manager: deleting due to NoExecute taint {taint.get('key')}={taint.get('value', '')}",
        )

    cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), mark)
    cp.events.record(
        pod,
        "DeviceTaintManagerEviction",
        f"Marking for deletion Pod {o.namespace_of(pod)}/{o.name_of(pod)}",
        component=EVICTION_COMPONENT,
    )
    cp.delete("pods", o.namespace_of(pod), o.name_of(pod))


def _reconcile_rule(
    cp: ControlPlane,
    rule: Obj,
    devices: dict[dv.DeviceKey, dv.Device],
    holders: dict[dv.DeviceKey, list[tuple[Obj, list[Obj]]]],
    now: float,
) -> None:
    taint = (rule.get("spec") or {}).get("taint") or {}
    effect = taint.get("effect", "")
    keys = [key for key, device in devices.items() if dv.rule_selects(rule, device)]
    generation = rule["metadata"].get("generation", 1)
    current = o.condition(rule, "EvictionInProgress")
    uid = o.uid_of(rule)
    if effect == "NoExecute":
        pending, evicted = _evict(cp, keys, holders, taint, now)
        total = cp.dra_evicted.get(uid, 0) + evicted
        cp.dra_evicted[uid] = total
        status, reason = ("True", "PodsPendingEviction") if pending else ("False", "NoPodsPendingEviction")
        message = f"{pending} pods pending eviction, {total} pods evicted"
    else:
        if current is not None and current.get("observedGeneration") == generation:
            return
        if effect == "None":
            would = [
                f"{o.namespace_of(pod)}/{o.name_of(pod)}"
                for pod, toleration in _affected(keys, holders, taint)
                if toleration is None and not o.is_pod_terminal(pod)
            ]
            message = f"{len(would)} pods would be evicted" + (f": {', '.join(would)}" if would else "")
            status, reason = "False", "EffectNone"
        else:
            message = f"effect {effect} evicts no pods; it keeps new allocations off {len(keys)} device(s)"
            status, reason = "False", f"Effect{effect}"
    if (
        current is not None
        and current.get("status") == status
        and current.get("message") == message
        and current.get("reason") == reason
        and current.get("observedGeneration") == generation
    ):
        return
    stamp = cp.clock.timestamp()

    def change(obj: Obj) -> None:
        o.set_condition(obj, "EvictionInProgress", status, stamp, reason, message, style="meta")
        for cond in obj["status"]["conditions"]:
            if cond.get("type") == "EvictionInProgress":
                cond["observedGeneration"] = generation

    cp.store.mutate("devicetaintrules", "", o.name_of(rule), change)
