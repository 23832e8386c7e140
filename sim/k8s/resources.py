"""The API resources the simulator serves, keyed the way the REST paths name them."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.vocabulary import DRA_GROUP, DRA_VERSION

LWS_GROUP = "leaderworkerset.x-k8s.io"
# What a real 1.37 apiserver's discovery lists for these resources.
ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
NO_COLLECTION_DELETE = ("create", "delete", "get", "list", "patch", "update", "watch")


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
    categories: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ALL_VERBS

    @property
    def singular(self) -> str:
        return self.kind.lower()

    def subresource_kind(self, sub: str) -> tuple[str, str, str]:
        """(group, version, kind) a subresource is served in (``pods/eviction`` is policy/v1 Eviction)."""
        if sub == "eviction":
            return "policy", "v1", "Eviction"
        if sub == "scale":
            return "autoscaling", "v1", "Scale"
        if sub == "log":
            return "", "v1", "Pod"
        return self.group, self.version, self.kind

    def subresource_verbs(self, sub: str) -> tuple[str, ...]:
        if sub == "log":
            return ("get",)
        return ("create",) if sub == "eviction" else ("get", "patch", "update")

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


# The field selectors the apiserver supports per resource (pkg/registry/*/strategy.go ToSelectableFields).
_POD_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    }
)
_EVENT_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
_NODE_FIELDS = frozenset({"metadata.name", "spec.unschedulable"})
_NAMESPACE_FIELDS = frozenset({"metadata.name", "status.phase"})
_REPLICASET_FIELDS = frozenset({"metadata.name", "metadata.namespace", "status.replicas"})
# pkg/registry/resource/resourceslice/strategy.go: a node's slices are found by these.
_RESOURCESLICE_FIELDS = frozenset({"metadata.name", "spec.nodeName", "spec.driver"})

RESOURCES: dict[str, Resource] = {
    r.plural: r
    for r in (
        Resource(
            "namespaces",
            "Namespace",
            "",
            "v1",
            namespaced=False,
            subresources=("status",),
            field_selectors=_NAMESPACE_FIELDS,
            short_names=("ns",),
            verbs=NO_COLLECTION_DELETE,
        ),
        Resource(
            "pods",
            "Pod",
            "",
            "v1",
            subresources=("status", "eviction", "log"),
            field_selectors=_POD_FIELDS,
            short_names=("po",),
            categories=("all",),
        ),
        Resource(
            "nodes",
            "Node",
            "",
            "v1",
            namespaced=False,
            subresources=("status",),
            field_selectors=_NODE_FIELDS,
            short_names=("no",),
        ),
        Resource(
            "services",
            "Service",
            "",
            "v1",
            subresources=("status",),
            short_names=("svc",),
            categories=("all",),
        ),
        Resource("events", "Event", "", "v1", field_selectors=_EVENT_FIELDS, short_names=("ev",)),
        Resource("configmaps", "ConfigMap", "", "v1", short_names=("cm",)),
        Resource("endpointslices", "EndpointSlice", "discovery.k8s.io", "v1"),
        Resource("leases", "Lease", "coordination.k8s.io", "v1"),
        Resource(
            "deployments",
            "Deployment",
            "apps",
            "v1",
            subresources=("status", "scale"),
            short_names=("deploy",),
            categories=("all",),
        ),
        Resource(
            "replicasets",
            "ReplicaSet",
            "apps",
            "v1",
            subresources=("status", "scale"),
            field_selectors=_REPLICASET_FIELDS,
            short_names=("rs",),
            categories=("all",),
        ),
        Resource(
            "statefulsets",
            "StatefulSet",
            "apps",
            "v1",
            subresources=("status", "scale"),
            short_names=("sts",),
            categories=("all",),
        ),
        Resource(
            "daemonsets",
            "DaemonSet",
            "apps",
            "v1",
            subresources=("status",),
            short_names=("ds",),
            categories=("all",),
        ),
        Resource(
            "jobs",
            "Job",
            "batch",
            "v1",
            subresources=("status",),
            categories=("all",),
        ),
        Resource(
            "poddisruptionbudgets",
            "PodDisruptionBudget",
            "policy",
            "v1",
            subresources=("status",),
            short_names=("pdb",),
        ),
        # Stored and served, not enforced: the sim's API server authorizes by its own token, and
        # these kinds are here so fleetmend's manifests (deploy/k8s) can be applied to it.
        Resource("serviceaccounts", "ServiceAccount", "", "v1", short_names=("sa",)),
        Resource("networkpolicies", "NetworkPolicy", "networking.k8s.io", "v1", short_names=("netpol",)),
        Resource("roles", "Role", "rbac.authorization.k8s.io", "v1"),
        Resource("rolebindings", "RoleBinding", "rbac.authorization.k8s.io", "v1"),
        Resource("clusterroles", "ClusterRole", "rbac.authorization.k8s.io", "v1", namespaced=False),
        Resource(
            "clusterrolebindings", "ClusterRoleBinding", "rbac.authorization.k8s.io", "v1", namespaced=False
        ),
        # Dynamic Resource Allocation (KEP-4381): GPUs claimed per device, with the NVIDIA DRA driver.
        Resource("deviceclasses", "DeviceClass", DRA_GROUP, DRA_VERSION, namespaced=False),
        Resource(
            "resourceslices",
            "ResourceSlice",
            DRA_GROUP,
            DRA_VERSION,
            namespaced=False,
            field_selectors=_RESOURCESLICE_FIELDS,
        ),
        Resource("resourceclaims", "ResourceClaim", DRA_GROUP, DRA_VERSION, subresources=("status",)),
        Resource("resourceclaimtemplates", "ResourceClaimTemplate", DRA_GROUP, DRA_VERSION),
        Resource(
            "devicetaintrules",
            "DeviceTaintRule",
            DRA_GROUP,
            DRA_VERSION,
            namespaced=False,
            subresources=("status",),
        ),
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
