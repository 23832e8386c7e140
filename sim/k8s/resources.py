"""The API resources the simulator serves, keyed the way the REST paths name them."""

from __future__ import annotations

from dataclasses import dataclass

LWS_GROUP = "leaderworkerset.x-k8s.io"


@dataclass(frozen=True)
class Resource:
    """One served resource type (``plural`` is the path segment and the store key)."""

    plural: str
    kind: str
    group: str
    version: str
    namespaced: bool = True
    custom: bool = False
    subresources: tuple[str, ...] = ()
    field_selectors: frozenset[str] = frozenset({"metadata.name", "metadata.namespace"})
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


_POD_FIELDS = frozenset(
    {"metadata.name", "metadata.namespace", "spec.nodeName", "status.phase", "spec.schedulerName"}
)
_EVENT_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.name",
        "involvedObject.namespace",
        "involvedObject.uid",
        "reason",
        "type",
        "source",
    }
)

RESOURCES: dict[str, Resource] = {
    r.plural: r
    for r in (
        Resource("namespaces", "Namespace", "", "v1", namespaced=False),
        Resource("pods", "Pod", "", "v1", subresources=("status", "eviction"), field_selectors=_POD_FIELDS),
        Resource("nodes", "Node", "", "v1", namespaced=False, subresources=("status",)),
        Resource("services", "Service", "", "v1", subresources=("status",)),
        Resource("events", "Event", "", "v1", field_selectors=_EVENT_FIELDS),
        Resource("endpointslices", "EndpointSlice", "discovery.k8s.io", "v1"),
        Resource("deployments", "Deployment", "apps", "v1", subresources=("status", "scale")),
        Resource("replicasets", "ReplicaSet", "apps", "v1", subresources=("status", "scale")),
        Resource(
            "statefulsets",
            "StatefulSet",
            "apps",
            "v1",
            subresources=("status", "scale"),
            short_names=("sts",),
        ),
        Resource("poddisruptionbudgets", "PodDisruptionBudget", "policy", "v1", subresources=("status",)),
        Resource(
            "leaderworkersets",
            "LeaderWorkerSet",
            LWS_GROUP,
            "v1",
            custom=True,
            subresources=("status", "scale"),
            short_names=("lws",),
        ),
    )
}


def resource_for(group: str, version: str, plural: str) -> Resource | None:
    resource = RESOURCES.get(plural)
    if resource is None or resource.group != group or resource.version != version:
        return None
    return resource


def resource_by_kind(kind: str) -> Resource | None:
    return next((r for r in RESOURCES.values() if r.kind == kind), None)
