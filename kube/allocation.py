"""GPUs allocated on each node, kept by one watch on every pod, as the scheduler's own cache is.

A recovery's look at its pool needs, for placement (runbook step 7), how many GPUs every
non-terminated pod holds on every node, other tenants' pods included. Listing every pod in
the cluster for each look costs O(pods) per look (2,808 pods, about a second, at 512 nodes),
and several recoveries look every few seconds. ``GpuAllocation`` lists once and then follows
the watch, so its cost grows with pod changes, not with looks; a look reads a copy of a
dict of per-node totals.

The figures may trail the API server by a watch event's latency (milliseconds), as a
scheduler's do. When the watch is broken (the cache could be stale) ``allocated()`` says
``None`` and the caller lists instead; a watch that gave up is started again by the next
``gpu_allocation`` call (``kube.cache.Watched``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.vocabulary import GPU_RESOURCE
from kube.cache import Obj, Watched, watched
from kube.informer import object_key


def gpus_of(pod: Obj) -> int:
    """GPUs a pod's containers ask for (limits, else requests)."""
    total = 0
    for c in pod.get("spec", {}).get("containers") or []:
        res = c.get("resources") or {}
        value = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE)
        if value is not None:
            total += int(value)
    return total


def terminated(pod: Obj) -> bool:
    return pod.get("status", {}).get("phase") in ("Succeeded", "Failed")


def allocation_of(pods: list[Obj]) -> dict[str, int]:
    """node -> GPUs held by the non-terminated pods bound to it (the listing way)."""
    out: dict[str, int] = {}
    for p in pods:
        node = p.get("spec", {}).get("nodeName")
        if node and not terminated(p):
            out[node] = out.get(node, 0) + gpus_of(p)
    return out


class GpuAllocation(Watched):
    """node -> GPUs allocated, from a pod informer running in its own daemon thread (``kube.cache``)."""

    def __init__(self, list_pods: Callable[..., Any]) -> None:
        super().__init__("pods (GPU allocation)", list_pods)
        self._held: dict[str, tuple[str, int]] = {}  # pod key -> (node, GPUs) of pods that hold any
        self._by_node: dict[str, int] = {}

    def allocated(self) -> dict[str, int] | None:
        """A copy of node -> GPUs, or None while the watch is not (or no longer) following the server."""
        if not self.fresh():
            return None
        with self._lock:
            return dict(self._by_node)

    def _on_event(self, kind: str, pod: Obj) -> None:
        key = object_key(pod)
        node = pod.get("spec", {}).get("nodeName")
        gpus = 0 if kind == "DELETED" or not node or terminated(pod) else gpus_of(pod)
        with self._lock:
            before = self._held.pop(key, None)
            if before is not None:
                left = self._by_node[before[0]] - before[1]
                if left:
                    self._by_node[before[0]] = left
                else:
                    del self._by_node[before[0]]
            if gpus and node:
                self._held[key] = (node, gpus)
                self._by_node[node] = self._by_node.get(node, 0) + gpus


def gpu_allocation(key: object, list_pods: Callable[..., Any]) -> GpuAllocation:
    """The process's allocation cache for one cluster (``key`` names it), started if none is running."""
    return watched(key, "gpu-allocation", lambda: GpuAllocation(list_pods))


def device_health(pod: Obj) -> dict[str, str]:
    """The pod's allocated devices and their health as its kubelet reports them (KEP-4680,
    ``containerStatuses[].allocatedResourcesStatus``): resource ID -> Healthy / Unhealthy / Unknown.
    A device plugin's ID is the device's (for NVIDIA's, the GPU UUID); a DRA device's is
    ``<driver>/<pool>/<device>``."""
    out: dict[str, str] = {}
    status = pod.get("status") or {}
    for c in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
        for res in c.get("allocatedResourcesStatus") or []:
            for dev in res.get("resources") or []:
                if dev.get("resourceID"):
                    out[str(dev["resourceID"])] = str(dev.get("health") or "Unknown")
    return out


def gpus_held(pod: Obj) -> int:
    """GPUs a pod holds: its device-plugin request, else the DRA devices its kubelet reports."""
    return gpus_of(pod) or len(device_health(pod))
