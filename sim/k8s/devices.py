"""GPUs as the cluster hands them out: the device plugin (``nvidia.com/gpu``) or Dynamic Resource Allocation.

Two ways a pod gets GPUs, picked per scenario (``gpu_api``):

* **device plugin** (the default): nodes advertise ``nvidia.com/gpu``; a pod requests a count and the
  plugin's ``Allocate`` hands it GPU indices when it is bound (``GpuLedger.bind``: the lowest free
  indices, healthy ones first, as the plugin skips GPUs it reported unhealthy). A pod keeps its
  indices until it ends (deleted, or Succeeded/Failed); nothing is repacked.
* **DRA** (``resource.k8s.io/v1``, KEP-4381): the simulated NVIDIA DRA driver publishes a DeviceClass
  ``gpu.nvidia.com`` and one ResourceSlice per GPU node (device ``gpu-<i>`` is GPU index ``i``, its
  ``uuid`` attribute the UUID the node's DCGM exporter shows); pods claim devices through
  ResourceClaims (``Allocator``: the scheduler's allocation), and which pod holds GPU ``i`` is read
  from the claims' ``status.allocation`` and ``status.reservedFor``.

``Allocator`` is the scheduler's DRA plugin in miniature: a request is satisfied from one node's
slice devices that are not allocated to another claim, not tainted NoSchedule/NoExecute (a taint
in the slice or a matching DeviceTaintRule) unless the request's ``exactly.tolerations`` tolerate
it, and that match the device class's and the request's CEL selectors. CEL is not interpreted in
general: the simulator understands the forms a user writes to pick devices
(``device.driver == "..."``, ``device.attributes["<domain>"].<name> == "..."`` or ``== <int>``,
joined by ``&&``); any other expression raises ``UnsupportedSelector`` and the pod stays Pending
with a FailedScheduling event saying so.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fleet.vocabulary import DRA_GROUP, DRA_VERSION, GPU_DEVICE_CLASS, GPU_DRIVER, GPU_RESOURCE
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.store import ObjectStore, WatchEvent

Obj = dict[str, Any]
DRA_API_VERSION = f"{DRA_GROUP}/{DRA_VERSION}"
GPU_MEMORY = "80Gi"
# What the resourceclaim controller annotates a claim it generated for a pod with (the pod's claim name).
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
UNSCHEDULABLE_REASON = "cannot allocate all claims"
DeviceKey = tuple[str, str, str]  # (driver, pool, device)


# ---------------------------------------------------------------------------------- the driver
def gpu_uuid(node: str, index: int) -> str:
    """The UUID of GPU ``index`` of ``node``: the same one DCGM telemetry reports (``sim.serving.telemetry``)."""
    digest = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def device_name(index: int) -> str:
    return f"gpu-{index}"


def device_index(name: str) -> int | None:
    match = re.fullmatch(r"gpu-(\d+)", name)
    return int(match.group(1)) if match else None


def device_class() -> Obj:
    """The DeviceClass NVIDIA's DRA driver chart installs for whole GPUs."""
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": GPU_DEVICE_CLASS},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]},
    }


def slice_name(node: str) -> str:
    """``<node>-<driver>-<5 chars>``, the generateName the kubelet plugin helper uses."""
    return f"{node}-{GPU_DRIVER}-{o.stable_hash(['resourceslice', node], 5)}"


def resource_slice(node: str, count: int, product: str) -> Obj:
    """The driver's one ResourceSlice for a node: its GPUs as devices ``gpu-0`` .. ``gpu-<count-1>``."""
    devices = [
        {
            "name": device_name(i),
            "attributes": {
                "uuid": {"string": gpu_uuid(node, i)},
                "index": {"int": i},
                "productName": {"string": product},
                "type": {"string": "gpu"},
            },
            "capacity": {"memory": {"value": GPU_MEMORY}},
        }
        for i in range(count)
    ]
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node)},
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def gpu_claim_template(name: str, namespace: str, count: int, labels: dict[str, str] | None = None) -> Obj:
    """A ResourceClaimTemplate asking for ``count`` whole GPUs (request ``gpus``)."""
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace, **({"labels": dict(labels)} if labels else {})},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpus",
                            "exactly": {
                                "deviceClassName": GPU_DEVICE_CLASS,
                                "allocationMode": "ExactCount",
                                "count": count,
                            },
                        }
                    ]
                }
            }
        },
    }


def node_slices(store: ObjectStore, node: str, driver: str = GPU_DRIVER) -> list[Obj]:
    """The ResourceSlices ``driver`` publishes for ``node`` (READ-ONLY views)."""
    return [
        s
        for s in store.list_view("resourceslices", field_selector=f"spec.nodeName={node}")
        if (s.get("spec") or {}).get("driver") == driver
    ]


# ---------------------------------------------------------------------------------- devices, taints
@dataclass(frozen=True)
class Device:
    driver: str
    pool: str
    name: str
    node: str | None
    attributes: dict[str, Any]
    taints: tuple[Obj, ...] = ()

    @property
    def key(self) -> DeviceKey:
        return (self.driver, self.pool, self.name)

    def attribute(self, domain: str, name: str) -> Any:
        """``device.attributes["<domain>"].<name>``: unqualified names belong to the driver's domain."""
        for key in (f"{domain}/{name}",) + ((name,) if domain == self.driver else ()):
            if key in self.attributes:
                return self.attributes[key]
        return None


def _attribute_value(attribute: Obj) -> Any:
    for kind in ("string", "int", "bool", "version"):
        if kind in attribute:
            return attribute[kind]
    return None


def slice_devices(slices: Iterable[Obj]) -> list[Device]:
    out: list[Device] = []
    for s in slices:
        spec = s.get("spec") or {}
        driver, pool = spec.get("driver", ""), (spec.get("pool") or {}).get("name", "")
        for d in spec.get("devices") or []:
            out.append(
                Device(
                    driver=driver,
                    pool=pool,
                    name=d.get("name", ""),
                    node=spec.get("nodeName"),
                    attributes={k: _attribute_value(v) for k, v in (d.get("attributes") or {}).items()},
                    taints=tuple(d.get("taints") or ()),
                )
            )
    return out


def rule_selects(rule: Obj, device: Device) -> bool:
    """A DeviceTaintRule's ``spec.deviceSelector`` (driver, pool, device; each optional) matches ``device``."""
    selector = (rule.get("spec") or {}).get("deviceSelector") or {}
    return all(
        not selector.get(name) or selector[name] == value
        for name, value in (("driver", device.driver), ("pool", device.pool), ("device", device.name))
    )


def device_taints(device: Device, rules: Iterable[Obj]) -> list[Obj]:
    """Every taint on ``device``: those in its slice and those of the DeviceTaintRules selecting it."""
    taints = list(device.taints)
    for rule in rules:
        taint = (rule.get("spec") or {}).get("taint")
        if taint and rule_selects(rule, device):
            taints.append(taint)
    return taints


def untolerated(taints: Iterable[Obj], tolerations: list[Obj], effects: tuple[str, ...]) -> list[Obj]:
    return [t for t in taints if t.get("effect") in effects and o.tolerates(tolerations, t) is None]


# ---------------------------------------------------------------------------------- CEL (a subset)
class UnsupportedSelector(Exception):
    """A CEL selector expression outside the subset the simulator evaluates."""

    def __init__(self, expression: str) -> None:
        super().__init__(
            f"CEL expression {expression!r} is not supported by the simulator (it evaluates "
            '`device.driver == "<driver>"`, `device.attributes["<domain>"].<name> == "<string>"` and '
            '`device.attributes["<domain>"].<name> == <int>`, joined by `&&`)'
        )
        self.expression = expression


_DRIVER_TERM = re.compile(r'^device\.driver\s*==\s*"([^"]*)"$')
_ATTRIBUTE_TERM = re.compile(
    r'^device\.attributes\[\s*"([^"]+)"\s*\]\.([A-Za-z_][A-Za-z0-9_]*)\s*==\s*(?:"([^"]*)"|(-?\d+))$'
)


def compile_selector(expression: str) -> Callable[[Device], bool]:
    """The predicate of a CEL selector in the supported subset; raises ``UnsupportedSelector`` otherwise."""
    checks: list[Callable[[Device], bool]] = []
    for raw in expression.split("&&"):
        term = raw.strip()
        while term.startswith("(") and term.endswith(")"):
            term = term[1:-1].strip()
        if match := _DRIVER_TERM.match(term):

            def same_driver(d: Device, driver: str = match.group(1)) -> bool:
                return d.driver == driver

            checks.append(same_driver)
        elif match := _ATTRIBUTE_TERM.match(term):
            domain, name, text, number = match.groups()
            want: Any = text if text is not None else int(number)

            def check(d: Device, domain: str = domain, name: str = name, want: Any = want) -> bool:
                have = d.attribute(domain, name)
                return have is not None and type(have) is type(want) and have == want

            checks.append(check)
        else:
            raise UnsupportedSelector(expression)
    return lambda d: all(c(d) for c in checks)


def _selectors(selectors: Iterable[Obj]) -> list[Callable[[Device], bool]]:
    out = []
    for selector in selectors:
        expression = (selector.get("cel") or {}).get("expression")
        if expression is None:
            raise UnsupportedSelector(str(selector))
        out.append(compile_selector(expression))
    return out


# ---------------------------------------------------------------------------------- claims of a pod
def pod_uses_claims(pod: Obj) -> bool:
    return bool((pod.get("spec") or {}).get("resourceClaims"))


def pod_claim_names(pod: Obj) -> dict[str, str | None]:
    """The pod's claims by their name in the pod: the ResourceClaim each is (None: not generated yet)."""
    statuses = {
        s.get("name"): s.get("resourceClaimName")
        for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
    }
    out: dict[str, str | None] = {}
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        name = entry.get("name", "")
        out[name] = entry.get("resourceClaimName") or statuses.get(name)
    return out


def allocation_node(claim: Obj) -> str | None:
    """The node a claim's allocation is pinned to (its ``nodeSelector``'s ``metadata.name``)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for expr in (term.get("matchFields") or []) + (term.get("matchExpressions") or []):
            if expr.get("key") in ("metadata.name", "kubernetes.io/hostname") and expr.get("values"):
                return str(expr["values"][0])
    return None


def allocated_results(claim: Obj) -> list[Obj]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return list((allocation.get("devices") or {}).get("results") or [])


def node_selector_for(node: str) -> Obj:
    return {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    }


@dataclass
class Fit:
    """Where a pod's unallocated claims would get their devices on one node."""

    results: dict[str, list[Obj]] = field(default_factory=dict)  # claim name -> allocation results
    devices: set[DeviceKey] = field(default_factory=set)


class Allocator:
    """The scheduler's DRA allocation over one snapshot of slices, classes, taint rules and claims."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.by_node: dict[str, list[Device]] = {}
        for device in slice_devices(store.list_view("resourceslices")):
            if device.node:
                self.by_node.setdefault(device.node, []).append(device)
        self.classes = {o.name_of(c): c for c in store.list_view("deviceclasses")}
        self.rules = list(store.list_view("devicetaintrules"))
        self.allocated: set[DeviceKey] = set()
        for claim in store.list_view("resourceclaims"):
            for r in allocated_results(claim):
                self.allocated.add((r.get("driver", ""), r.get("pool", ""), r.get("device", "")))

    def claims(self, pod: Obj) -> list[Obj] | str:
        """The pod's ResourceClaims, or why they cannot be had yet."""
        out = []
        namespace = o.namespace_of(pod)
        for pod_claim, claim_name in pod_claim_names(pod).items():
            if claim_name is None:
                return f'waiting for resource claim "{pod_claim}" to be created'
            claim = self.store.view("resourceclaims", namespace, claim_name)
            if claim is None:
                return f'resourceclaim "{claim_name}" not found'
            if o.is_terminating(claim):
                return f'resourceclaim "{claim_name}" is being deleted'
            out.append(claim)
        return out

    def free_count(self, node: str) -> int:
        """Devices of ``node`` a claim could get right now (unallocated, untainted)."""
        return sum(
            1
            for d in self.by_node.get(node, [])
            if d.key not in self.allocated
            and not untolerated(device_taints(d, self.rules), [], BLOCKING_EFFECTS)
        )

    def fit(self, claims: list[Obj], node: str, taken: set[DeviceKey] | None = None) -> Fit | str:
        """Devices on ``node`` for every request of the unallocated ``claims``; a str says why not.

        Raises ``UnsupportedSelector`` for a CEL expression outside the simulator's subset."""
        busy = self.allocated | (taken or set())
        fit = Fit()
        for claim in claims:
            if (claim.get("status") or {}).get("allocation"):
                if allocation_node(claim) != node:
                    return "resourceclaim not available on the node"
                continue
            results: list[Obj] = []
            for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
                exact = request.get("exactly")
                if exact is None:
                    sub = [s.get("name") for s in request.get("firstAvailable") or []]
                    raise UnsupportedSelector(f"firstAvailable {sub} (prioritized alternatives)")
                class_name = exact.get("deviceClassName", "")
                device_class_obj = self.classes.get(class_name)
                if device_class_obj is None:
                    return f'device class "{class_name}" does not exist'
                checks = _selectors((device_class_obj.get("spec") or {}).get("selectors") or [])
                checks += _selectors(exact.get("selectors") or [])
                tolerations = list(exact.get("tolerations") or [])
                matching = [d for d in self.by_node.get(node, []) if all(c(d) for c in checks)]
                usable = [
                    d
                    for d in matching
                    if d.key not in busy
                    and not untolerated(device_taints(d, self.rules), tolerations, BLOCKING_EFFECTS)
                ]
                if exact.get("allocationMode", "ExactCount") == "All":
                    if not matching or len(usable) != len(matching):
                        return UNSCHEDULABLE_REASON
                    picked = usable
                else:
                    count = int(exact.get("count", 1))
                    if len(usable) < count:
                        return UNSCHEDULABLE_REASON
                    picked = usable[:count]
                for d in picked:
                    busy.add(d.key)
                    fit.devices.add(d.key)
                    result: Obj = {
                        "request": request.get("name", ""),
                        "driver": d.driver,
                        "pool": d.pool,
                        "device": d.name,
                    }
                    if tolerations:
                        result["tolerations"] = tolerations
                    results.append(result)
            fit.results[o.name_of(claim)] = results
        return fit

    def commit(self, pod: Obj, node: str, claims: list[Obj], fit: Fit) -> None:
        """Write the allocations to the claims' status and reserve every claim for ``pod``."""
        consumer = {"resource": "pods", "name": o.name_of(pod), "uid": o.uid_of(pod)}
        for claim in claims:
            results = fit.results.get(o.name_of(claim))

            def change(obj: Obj, results: list[Obj] | None = results) -> None:
                status = obj.setdefault("status", {})
                if results is not None and not status.get("allocation"):
                    status["allocation"] = {
                        "devices": {"results": results},
                        "nodeSelector": node_selector_for(node),
                    }
                reserved = status.setdefault("reservedFor", [])
                if not any(r.get("uid") == consumer["uid"] for r in reserved):
                    reserved.append(dict(consumer))

            self.store.mutate("resourceclaims", o.namespace_of(claim), o.name_of(claim), change)
        self.allocated |= fit.devices


# ---------------------------------------------------------------------------------- who holds which GPU
class GpuLedger:
    """Which GPU index of a node each pod holds: recorded at binding (device plugin) or claimed (DRA).

    ``broken(node, index)`` is the world's hook (the serving layer's telemetry): a broken GPU is
    skipped when a device-plugin pod's indices are picked, and shows ``Unhealthy`` in pod status.
    ``health_epoch`` moves whenever a GPU's health changes, so the kubelets re-sync pod status."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, tuple[int, ...]]] = {}  # node -> pod uid -> indices
        self._node_of: dict[str, str] = {}
        self._released: collections.deque[str] = collections.deque()
        self.broken: Callable[[str, int], bool] = lambda node, index: False
        self.health_epoch = 0
        store.watch(self._on_event)

    def health_changed(self) -> None:
        self.health_epoch += 1

    def _on_event(self, event: WatchEvent) -> None:
        # Called under the store's lock: only queue (taking our lock here could deadlock a reader).
        if event.resource == "pods" and (event.type == "DELETED" or o.is_pod_terminal(event.object)):
            self._released.append(str(event.object["metadata"].get("uid", "")))

    def _drain(self) -> None:
        while self._released:
            uid = self._released.popleft()
            node = self._node_of.pop(uid, None)
            if node is not None:
                self._held.get(node, {}).pop(uid, None)

    def bind(self, pod: Obj, node: str, capacity: int) -> tuple[int, ...]:
        """The device plugin's Allocate: the lowest free indices, healthy GPUs first."""
        count = o.pod_gpus(pod)
        if count <= 0:
            return ()
        uid = o.uid_of(pod)
        with self._lock:
            self._drain()
            held = self._held.setdefault(node, {})
            if uid in held:
                return held[uid]
            used = {i for indices in held.values() for i in indices}
            free = [i for i in range(capacity) if i not in used]
            healthy = [i for i in free if not self.broken(node, i)]
            picked = tuple(sorted((healthy + [i for i in free if i not in healthy])[:count]))
            held[uid] = picked
            self._node_of[uid] = node
            return picked

    def claimed(self, node: str) -> dict[str, list[int]]:
        """GPU indices of ``node`` each pod (uid) holds through allocated ResourceClaims."""
        out: dict[str, list[int]] = {}
        for claim in self.store.list_view("resourceclaims"):
            indices = [
                index
                for r in allocated_results(claim)
                if r.get("driver") == GPU_DRIVER
                and r.get("pool") == node
                and (index := device_index(str(r.get("device", "")))) is not None
            ]
            if not indices:
                continue
            for ref in (claim.get("status") or {}).get("reservedFor") or []:
                if ref.get("resource") == "pods":
                    out.setdefault(str(ref.get("uid")), []).extend(indices)
        return out

    def assignment(self, node: str, pods: Iterable[Obj], capacity: int) -> dict[int, Obj]:
        """Which pod holds each GPU index of ``node`` (running or terminating pods; ended pods hold none)."""
        live = sorted(
            (p for p in pods if (p.get("spec") or {}).get("nodeName") == node and not o.is_pod_terminal(p)),
            key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]),
        )
        claimed = self.claimed(node) if any(pod_uses_claims(p) for p in live) else {}
        out: dict[int, Obj] = {}
        with self._lock:
            self._drain()
            held = self._held.get(node, {})
            uids = {o.uid_of(p) for p in live}
            for gone in [u for u in held if u not in uids]:
                held.pop(gone, None)
                self._node_of.pop(gone, None)
        for pod in live:
            if pod_uses_claims(pod):
                indices: Iterable[int] = claimed.get(o.uid_of(pod), [])
            else:
                indices = self.bind(pod, node, capacity)
            for index in indices:
                out[index] = pod
        return out

    def pod_indices(self, pod: Obj) -> list[int]:
        """The GPU indices ``pod`` holds on its node (claims for a DRA pod, the plugin's for others)."""
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            return []
        if pod_uses_claims(pod):
            return sorted(self.claimed(node).get(o.uid_of(pod), []))
        if o.is_pod_terminal(pod):
            return []
        node_obj = self.store.view("nodes", "", node)
        capacity = int(((node_obj or {}).get("status") or {}).get("capacity", {}).get(GPU_RESOURCE, 0) or 0)
        return list(self.bind(pod, node, capacity))

    # ---- pod status: allocatedResourcesStatus (KEP-4680) -------------------------------------------
    def resource_statuses(self, pod: Obj, container: Obj) -> list[Obj]:
        """``containerStatuses[].allocatedResourcesStatus`` of ``container``: its devices and their health."""
        node = (pod.get("spec") or {}).get("nodeName") or ""
        health = lambda index: "Unhealthy" if self.broken(node, index) else "Healthy"  # noqa: E731
        resources = container.get("resources") or {}
        out: list[Obj] = []
        if pod_uses_claims(pod):
            claim_names = pod_claim_names(pod)
            for ref in resources.get("claims") or []:
                claim_name = claim_names.get(ref.get("name", ""))
                claim = (
                    self.store.view("resourceclaims", o.namespace_of(pod), claim_name) if claim_name else None
                )
                if claim is None:
                    continue
                by_request: dict[str, list[Obj]] = {}
                for r in allocated_results(claim):
                    if ref.get("request") and r.get("request") != ref["request"]:
                        continue
                    index = device_index(str(r.get("device", ""))) if r.get("driver") == GPU_DRIVER else None
                    entry: Obj = {"resourceID": f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}"}
                    entry["health"] = (
                        health(index) if index is not None and r.get("pool") == node else "Unknown"
                    )
                    by_request.setdefault(str(r.get("request", "")), []).append(entry)
                for request, entries in by_request.items():
                    out.append({"name": f"claim:{ref.get('name')}/{request}", "resources": entries})
            return out
        wants = (resources.get("limits") or {}).get(GPU_RESOURCE) or (resources.get("requests") or {}).get(
            GPU_RESOURCE
        )
        if not wants:
            return out
        indices = self.pod_indices(pod)
        if indices:
            out.append(
                {
                    "name": GPU_RESOURCE,
                    "resources": [{"resourceID": gpu_uuid(node, i), "health": health(i)} for i in indices],
                }
            )
        return out
