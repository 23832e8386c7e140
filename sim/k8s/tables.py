"""Server-side printing: the ``meta.k8s.io/v1`` Table a client gets with ``Accept: ...;as=Table``.

kubectl asks every server for tables (``kubectl get``) and prints the cells it is given, so the
columns, their priorities (priority 1 = only with ``-o wide``) and the cell text follow the
apiserver's printers (``pkg/printers/internalversion/printers.go``): READY/STATUS/RESTARTS/AGE/
IP/NODE for pods, STATUS/ROLES/AGE/VERSION/INTERNAL-IP for nodes, DESIRED/CURRENT/READY/UP-TO-DATE/
AVAILABLE/NODE SELECTOR for DaemonSets, and so on. Resources without a
printer (the LeaderWorkerSet custom resource) get a custom resource's default table: Name and Age.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.clock import parse_timestamp

Obj = dict[str, Any]
Column = tuple[str, str, str, int]  # name, type, description, priority
Printer = Callable[[Obj, float], list[Any]]

TABLE_MIME_PARAM = "as=table"


def wants_table(accept: str | None) -> bool:
    """True when the Accept header asks for a ``meta.k8s.io/v1`` Table (v1beta1 is not served)."""
    for part in (accept or "").split(","):
        params = {p.strip().lower() for p in part.split(";")[1:]}
        if TABLE_MIME_PARAM in params and "g=meta.k8s.io" in params and "v=v1" in params:
            return True
    return False


def human_duration(seconds: float) -> str:
    """``k8s.io/apimachinery/pkg/util/duration.HumanDuration``: 5s, 3m20s, 4h10m, 6d2h, 400d."""
    if seconds < -1:
        return "<invalid>"
    s = int(max(0, seconds))
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        rest = s % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        rest_m = (s % 3600) // 60
        return f"{hours}h{rest_m}m" if rest_m else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        rest_h = hours % 24
        return f"{hours // 24}d{rest_h}h" if rest_h else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    years = hours // (24 * 365)
    if years < 8:
        return f"{years}y{(hours // 24) % 365}d"
    return f"{years}y"


def _age(stamp: str | None, now: float) -> str:
    if not stamp:
        return "<unknown>"
    return human_duration(now - parse_timestamp(stamp))


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _none(value: Any) -> Any:
    return "<none>" if value in (None, "", []) else value


# --------------------------------------------------------------------------- printers
_NAME: Column = (
    "Name",
    "string",
    "Name must be unique within a namespace. Is required when creating resources, although some "
    "resources may allow a client to request the generation of an appropriate name automatically.",
    0,
)
_AGE: Column = (
    "Age",
    "string",
    "CreationTimestamp is a timestamp representing the server time when this object was created.",
    0,
)


def _pod_status(pod: Obj) -> str:
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Unknown"
    initializing = False
    for cs in status.get("initContainerStatuses") or []:
        state = cs.get("state") or {}
        if (state.get("terminated") or {}).get("exitCode") == 0:
            continue
        initializing = True
        waiting = (state.get("waiting") or {}).get("reason")
        reason = f"Init:{waiting}" if waiting and waiting != "PodInitializing" else "Init:0"
        break
    if not initializing:
        running = False
        for cs in reversed(status.get("containerStatuses") or []):
            state = cs.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif state.get("terminated"):
                term = state["terminated"]
                reason = term.get("reason") or (
                    f"Signal:{term['signal']}"
                    if term.get("signal")
                    else f"ExitCode:{term.get('exitCode', 0)}"
                )
            elif "running" in state and cs.get("ready"):
                running = True
        if reason == "Completed" and running:
            reason = "Running"
        if running and reason not in ("Running",) and status.get("phase") == "Running":
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            reason = "Running" if ready else "NotReady"
    meta = _meta(pod)
    if meta.get("deletionTimestamp"):
        reason = "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return str(reason)


def _pod_restarts(pod: Obj, now: float) -> str:
    restarts = 0
    last: float | None = None
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        restarts += int(cs.get("restartCount") or 0)
        finished = ((cs.get("lastState") or {}).get("terminated") or {}).get("finishedAt")
        if finished:
            at = parse_timestamp(finished)
            last = at if last is None else max(last, at)
    if restarts and last is not None:
        return f"{restarts} ({human_duration(now - last)} ago)"
    return str(restarts)


def _pod_row(pod: Obj, now: float) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    containers = spec.get("containers") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    gates = spec.get("readinessGates") or []
    if gates:
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
        met = sum(1 for g in gates if conditions.get(g.get("conditionType")) == "True")
        gate_cell = f"{met}/{len(gates)}"
    else:
        gate_cell = "<none>"
    return [
        _meta(pod).get("name", ""),
        f"{ready}/{len(containers)}",
        _pod_status(pod),
        _pod_restarts(pod, now),
        _age(_meta(pod).get("creationTimestamp"), now),
        _none(status.get("podIP")),
        _none(spec.get("nodeName")),
        _none(status.get("nominatedNodeName")),
        gate_cell,
    ]


_POD_COLUMNS: list[Column] = [
    _NAME,
    ("Ready", "string", "The aggregate readiness state of this pod for accepting traffic.", 0),
    ("Status", "string", "The aggregate status of the containers in this pod.", 0),
    (
        "Restarts",
        "string",
        "The number of times the containers in this pod have been restarted and when the last container in this pod has restarted.",
        0,
    ),
    _AGE,
    (
        "IP",
        "string",
        "IP address allocated to the pod. Routable at least within the cluster. Empty if not yet allocated.",
        1,
    ),
    ("Node", "string", "NodeName is a request to schedule this pod onto a specific node.", 1),
    (
        "Nominated Node",
        "string",
        "nominatedNodeName is set only when this pod preempts other pods on the node.",
        1,
    ),
    (
        "Readiness Gates",
        "string",
        "If specified, all readiness gates will be evaluated for pod readiness.",
        1,
    ),
]


def _node_row(node: Obj, now: float) -> list[Any]:
    meta, spec, status = _meta(node), node.get("spec") or {}, node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    states = {"True": "Ready", "False": "NotReady"}
    state = states.get(ready.get("status", ""), "Unknown") if ready else "Unknown"
    if spec.get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = meta.get("labels") or {}
    roles = sorted(
        {k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/") and "/" in k}
        | ({labels["kubernetes.io/role"]} if labels.get("kubernetes.io/role") else set())
    )
    addresses = status.get("addresses") or []
    internal = next((a.get("address") for a in addresses if a.get("type") == "InternalIP"), None)
    external = next((a.get("address") for a in addresses if a.get("type") == "ExternalIP"), None)
    info = status.get("nodeInfo") or {}
    return [
        meta.get("name", ""),
        state,
        ",".join(r for r in roles if r) or "<none>",
        _age(meta.get("creationTimestamp"), now),
        info.get("kubeletVersion", ""),
        _none(internal),
        _none(external),
        info.get("osImage", "<unknown>") or "<unknown>",
        info.get("kernelVersion", "<unknown>") or "<unknown>",
        info.get("containerRuntimeVersion", "<unknown>") or "<unknown>",
    ]


_NODE_COLUMNS: list[Column] = [
    _NAME,
    ("Status", "string", "The status of the node", 0),
    ("Roles", "string", "The roles of the node", 0),
    _AGE,
    ("Version", "string", "Kubelet Version reported by the node.", 0),
    (
        "Internal-IP",
        "string",
        "List of addresses reachable to the node. Queried from cloud provider, if available.",
        1,
    ),
    (
        "External-IP",
        "string",
        "List of addresses reachable to the node. Queried from cloud provider, if available.",
        1,
    ),
    (
        "OS-Image",
        "string",
        "OS Image reported by the node from /etc/os-release (e.g. Debian GNU/Linux 7 (wheezy)).",
        1,
    ),
    (
        "Kernel-Version",
        "string",
        "Kernel Version reported by the node from 'uname -r' (e.g. 3.16.0-0.bpo.4-amd64).",
        1,
    ),
    (
        "Container-Runtime",
        "string",
        "ContainerRuntime Version reported by the node through runtime remote API (e.g. containerd://1.4.2).",
        1,
    ),
]


def _namespace_row(ns: Obj, now: float) -> list[Any]:
    return [
        _meta(ns).get("name", ""),
        (ns.get("status") or {}).get("phase", ""),
        _age(_meta(ns).get("creationTimestamp"), now),
    ]


_NAMESPACE_COLUMNS: list[Column] = [
    _NAME,
    ("Status", "string", "The status of the namespace", 0),
    _AGE,
]


def _selector_text(selector: Obj | None) -> str:
    if not selector:
        return "<none>"
    from sim.k8s.selectors import selector_object_to_string

    if "matchLabels" in selector or "matchExpressions" in selector:
        return selector_object_to_string(selector) or "<none>"
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "<none>"


def _service_row(svc: Obj, now: float) -> list[Any]:
    spec = svc.get("spec") or {}
    kind = spec.get("type", "ClusterIP")
    external = spec.get("externalIPs") or []
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    if kind == "LoadBalancer":
        shown = [i.get("ip") or i.get("hostname") for i in ingress] + external
        ext = ",".join(x for x in shown if x) or "<pending>"
    elif kind == "ExternalName":
        ext = spec.get("externalName", "<none>")
    else:
        ext = ",".join(external) or "<none>"
    ports = []
    for port in spec.get("ports") or []:
        text = f"{port.get('port')}"
        if port.get("nodePort"):
            text += f":{port['nodePort']}"
        ports.append(f"{text}/{port.get('protocol', 'TCP')}")
    return [
        _meta(svc).get("name", ""),
        kind,
        spec.get("clusterIP") or "<none>",
        ext,
        ",".join(ports) or "<none>",
        _age(_meta(svc).get("creationTimestamp"), now),
        _selector_text(spec.get("selector")),
    ]


_SERVICE_COLUMNS: list[Column] = [
    _NAME,
    ("Type", "string", "type determines how the Service is exposed.", 0),
    (
        "Cluster-IP",
        "string",
        "clusterIP is the IP address of the service and is usually assigned randomly.",
        0,
    ),
    (
        "External-IP",
        "string",
        "externalIPs is a list of IP addresses for which nodes in the cluster will also accept traffic for this service.",
        0,
    ),
    ("Port(s)", "string", "The list of ports that are exposed by this service.", 0),
    _AGE,
    (
        "Selector",
        "string",
        "Route service traffic to pods with label keys and values matching this selector.",
        1,
    ),
]


def _event_row(ev: Obj, now: float) -> list[Any]:
    involved = ev.get("involvedObject") or {}
    source = ev.get("source") or {}
    last = ev.get("lastTimestamp") or ev.get("eventTime") or _meta(ev).get("creationTimestamp")
    first = ev.get("firstTimestamp") or ev.get("eventTime") or _meta(ev).get("creationTimestamp")
    component = source.get("component") or ev.get("reportingComponent") or ""
    host = source.get("host")
    return [
        _age(last, now),
        ev.get("type", ""),
        ev.get("reason", ""),
        f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}",
        involved.get("fieldPath", ""),
        f"{component}, {host}" if host else component,
        str(ev.get("message", "")).strip(),
        _age(first, now),
        int(ev.get("count") or 1),
        _meta(ev).get("name", ""),
    ]


_EVENT_COLUMNS: list[Column] = [
    ("Last Seen", "string", "The last time this event was seen.", 0),
    ("Type", "string", "Type of this event (Normal, Warning), new types could be added in the future.", 0),
    (
        "Reason",
        "string",
        "This should be a short, machine understandable string that gives the reason for the transition into the object's current status.",
        0,
    ),
    ("Object", "string", "The object that this event is about.", 0),
    ("Subobject", "string", "The subobject (fieldPath) this event is about.", 1),
    ("Source", "string", "The component reporting this event.", 1),
    ("Message", "string", "A human-readable description of the status of this operation.", 0),
    ("First Seen", "string", "The time at which the event was first recorded.", 1),
    ("Count", "integer", "The number of times this event has occurred.", 1),
    ("Name", "string", "Name of the event.", 1),
]


def _configmap_row(cm: Obj, now: float) -> list[Any]:
    return [
        _meta(cm).get("name", ""),
        len(cm.get("data") or {}) + len(cm.get("binaryData") or {}),
        _age(_meta(cm).get("creationTimestamp"), now),
    ]


_CONFIGMAP_COLUMNS: list[Column] = [
    _NAME,
    ("Data", "string", "Data contains the configuration data.", 0),
    _AGE,
]


def _lease_row(lease: Obj, now: float) -> list[Any]:
    return [
        _meta(lease).get("name", ""),
        (lease.get("spec") or {}).get("holderIdentity", ""),
        _age(_meta(lease).get("creationTimestamp"), now),
    ]


_LEASE_COLUMNS: list[Column] = [
    _NAME,
    ("Holder", "string", "holderIdentity contains the identity of the holder of a current lease.", 0),
    _AGE,
]


def _endpointslice_row(eps: Obj, now: float) -> list[Any]:
    ports = [str(p.get("port")) for p in eps.get("ports") or [] if p.get("port") is not None]
    addresses = [a for e in eps.get("endpoints") or [] for a in e.get("addresses") or []]
    shown = ",".join(addresses[:3]) + (f" + {len(addresses) - 3} more..." if len(addresses) > 3 else "")
    return [
        _meta(eps).get("name", ""),
        eps.get("addressType", ""),
        ",".join(ports) or "<unset>",
        shown or "<unset>",
        _age(_meta(eps).get("creationTimestamp"), now),
    ]


_ENDPOINTSLICE_COLUMNS: list[Column] = [
    _NAME,
    ("AddressType", "string", "The IP protocol for this slice", 0),
    ("Ports", "string", "The ports contained in this slice", 0),
    ("Endpoints", "string", "The endpoints contained in this slice", 0),
    _AGE,
]


def _containers(template: Obj) -> tuple[str, str]:
    containers = ((template.get("spec") or {}).get("containers")) or []
    return ",".join(c.get("name", "") for c in containers), ",".join(c.get("image", "") for c in containers)


def _deployment_row(dep: Obj, now: float) -> list[Any]:
    spec, status = dep.get("spec") or {}, dep.get("status") or {}
    names, images = _containers(spec.get("template") or {})
    return [
        _meta(dep).get("name", ""),
        f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
        int(status.get("updatedReplicas") or 0),
        int(status.get("availableReplicas") or 0),
        _age(_meta(dep).get("creationTimestamp"), now),
        names,
        images,
        _selector_text(spec.get("selector")),
    ]


_DEPLOYMENT_COLUMNS: list[Column] = [
    _NAME,
    ("Ready", "string", "Number of the pod with ready state", 0),
    (
        "Up-to-date",
        "string",
        "Total number of non-terminated pods targeted by this deployment that have the desired template spec.",
        0,
    ),
    (
        "Available",
        "string",
        "Total number of available pods (ready for at least minReadySeconds) targeted by this deployment.",
        0,
    ),
    _AGE,
    ("Containers", "string", "Names of each container in the template.", 1),
    ("Images", "string", "Images referenced by each container in the template.", 1),
    (
        "Selector",
        "string",
        "Label selector for pods. Existing ReplicaSets whose pods are selected by this will be the ones affected by this deployment.",
        1,
    ),
]


def _replicaset_row(rs: Obj, now: float) -> list[Any]:
    spec, status = rs.get("spec") or {}, rs.get("status") or {}
    names, images = _containers(spec.get("template") or {})
    return [
        _meta(rs).get("name", ""),
        int(spec.get("replicas", 1)),
        int(status.get("replicas") or 0),
        int(status.get("readyReplicas") or 0),
        _age(_meta(rs).get("creationTimestamp"), now),
        names,
        images,
        _selector_text(spec.get("selector")),
    ]


_REPLICASET_COLUMNS: list[Column] = [
    _NAME,
    ("Desired", "integer", "Replicas is the number of desired replicas.", 0),
    ("Current", "integer", "Replicas is the most recently observed number of replicas.", 0),
    (
        "Ready",
        "integer",
        "readyReplicas is the number of pods targeted by this ReplicaSet with a Ready Condition.",
        0,
    ),
    _AGE,
    ("Containers", "string", "Names of each container in the template.", 1),
    ("Images", "string", "Images referenced by each container in the template.", 1),
    ("Selector", "string", "Selector is a label query over pods that should match the replica count.", 1),
]


def _statefulset_row(sts: Obj, now: float) -> list[Any]:
    spec, status = sts.get("spec") or {}, sts.get("status") or {}
    names, images = _containers(spec.get("template") or {})
    return [
        _meta(sts).get("name", ""),
        f"{int(status.get('readyReplicas') or 0)}/{int(spec.get('replicas', 1))}",
        _age(_meta(sts).get("creationTimestamp"), now),
        names,
        images,
    ]


_STATEFULSET_COLUMNS: list[Column] = [
    _NAME,
    ("Ready", "string", "Number of the pod with ready state", 0),
    _AGE,
    ("Containers", "string", "Names of each container in the template.", 1),
    ("Images", "string", "Images referenced by each container in the template.", 1),
]


def _daemonset_row(ds: Obj, now: float) -> list[Any]:
    spec, status = ds.get("spec") or {}, ds.get("status") or {}
    template = spec.get("template") or {}
    names, images = _containers(template)
    node_selector = (template.get("spec") or {}).get("nodeSelector") or {}
    return [
        _meta(ds).get("name", ""),
        int(status.get("desiredNumberScheduled") or 0),
        int(status.get("currentNumberScheduled") or 0),
        int(status.get("numberReady") or 0),
        int(status.get("updatedNumberScheduled") or 0),
        int(status.get("numberAvailable") or 0),
        # labels.FormatLabels: sorted key=value pairs, "<none>" when empty.
        ",".join(f"{k}={v}" for k, v in sorted(node_selector.items())) or "<none>",
        _age(_meta(ds).get("creationTimestamp"), now),
        names,
        images,
        _selector_text(spec.get("selector")),
    ]


_DAEMONSET_COLUMNS: list[Column] = [
    _NAME,
    (
        "Desired",
        "integer",
        "The total number of nodes that should be running the daemon pod (including nodes correctly "
        "running the daemon pod). More info: https://kubernetes.io/docs/concepts/workloads/controllers/daemonset/",
        0,
    ),
    (
        "Current",
        "integer",
        "The number of nodes that are running at least 1 daemon pod and are supposed to run the daemon pod. "
        "More info: https://kubernetes.io/docs/concepts/workloads/controllers/daemonset/",
        0,
    ),
    (
        "Ready",
        "integer",
        "numberReady is the number of nodes that should be running the daemon pod and have one or more of "
        "the daemon pod running with a Ready Condition.",
        0,
    ),
    ("Up-to-date", "integer", "The total number of nodes that are running updated daemon pod", 0),
    (
        "Available",
        "integer",
        "The number of nodes that should be running the daemon pod and have one or more of the daemon pod "
        "running and available (ready for at least spec.minReadySeconds)",
        0,
    ),
    (
        "Node Selector",
        "string",
        "NodeSelector is a selector which must be true for the pod to fit on a node. Selector which must "
        "match a node's labels for the pod to be scheduled on that node. More info: "
        "https://kubernetes.io/docs/concepts/configuration/assign-pod-node/",
        0,
    ),
    _AGE,
    ("Containers", "string", "Names of each container in the template.", 1),
    ("Images", "string", "Images referenced by each container in the template.", 1),
    (
        "Selector",
        "string",
        "A label query over pods that are managed by the daemon set. Must match in order to be controlled. "
        "It must match the pod template's labels. More info: "
        "https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#label-selectors",
        1,
    ),
]


def _pdb_row(pdb: Obj, now: float) -> list[Any]:
    spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
    return [
        _meta(pdb).get("name", ""),
        str(spec["minAvailable"]) if "minAvailable" in spec else "N/A",
        str(spec["maxUnavailable"]) if "maxUnavailable" in spec else "N/A",
        int(status.get("disruptionsAllowed") or 0),
        _age(_meta(pdb).get("creationTimestamp"), now),
    ]


_PDB_COLUMNS: list[Column] = [
    _NAME,
    ("Min Available", "string", "The minimum number of pods that must be available simultaneously.", 0),
    ("Max Unavailable", "string", "The maximum number of pods that may be unavailable simultaneously.", 0),
    ("Allowed Disruptions", "integer", "Calculated number of pods that may be disrupted simultaneously.", 0),
    _AGE,
]


def _resourceslice_row(rs: Obj, now: float) -> list[Any]:
    spec = rs.get("spec") or {}
    return [
        _meta(rs).get("name", ""),
        spec.get("nodeName", "") or "<none>",
        spec.get("driver", ""),
        (spec.get("pool") or {}).get("name", ""),
        _age(_meta(rs).get("creationTimestamp"), now),
    ]


_RESOURCESLICE_COLUMNS: list[Column] = [
    _NAME,
    ("Node", "string", "The node providing the resources, if any.", 0),
    ("Driver", "string", "The driver providing the resources.", 0),
    ("Pool", "string", "The pool that the resource slice belongs to.", 0),
    _AGE,
]


def _resourceclaim_row(claim: Obj, now: float) -> list[Any]:
    """STATE as kubectl prints it: pending, or allocated(,reserved); deleted while terminating."""
    status = claim.get("status") or {}
    states = []
    if _meta(claim).get("deletionTimestamp"):
        states.append("deleted")
    if status.get("allocation"):
        states.append("allocated")
        if status.get("reservedFor"):
            states.append("reserved")
    elif not states:
        states.append("pending")
    return [_meta(claim).get("name", ""), ",".join(states), _age(_meta(claim).get("creationTimestamp"), now)]


_RESOURCECLAIM_COLUMNS: list[Column] = [
    _NAME,
    ("State", "string", "A summary of the current state (allocated, pending, reserved, etc.).", 0),
    _AGE,
]


def _custom_row(obj: Obj, now: float) -> list[Any]:
    return [_meta(obj).get("name", ""), _meta(obj).get("creationTimestamp", "")]


_CUSTOM_COLUMNS: list[Column] = [
    _NAME,
    ("Age", "date", _AGE[2], 0),
]

PRINTERS: dict[str, tuple[list[Column], Printer]] = {
    "pods": (_POD_COLUMNS, _pod_row),
    "nodes": (_NODE_COLUMNS, _node_row),
    "namespaces": (_NAMESPACE_COLUMNS, _namespace_row),
    "services": (_SERVICE_COLUMNS, _service_row),
    "events": (_EVENT_COLUMNS, _event_row),
    "configmaps": (_CONFIGMAP_COLUMNS, _configmap_row),
    "leases": (_LEASE_COLUMNS, _lease_row),
    "endpointslices": (_ENDPOINTSLICE_COLUMNS, _endpointslice_row),
    "deployments": (_DEPLOYMENT_COLUMNS, _deployment_row),
    "replicasets": (_REPLICASET_COLUMNS, _replicaset_row),
    "statefulsets": (_STATEFULSET_COLUMNS, _statefulset_row),
    "daemonsets": (_DAEMONSET_COLUMNS, _daemonset_row),
    "poddisruptionbudgets": (_PDB_COLUMNS, _pdb_row),
    "resourceslices": (_RESOURCESLICE_COLUMNS, _resourceslice_row),
    "resourceclaims": (_RESOURCECLAIM_COLUMNS, _resourceclaim_row),
}


def _row_object(obj: Obj, include: str) -> Obj | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": _meta(obj)}


def to_table(
    plural: str,
    objects: list[Obj],
    now: float,
    *,
    resource_version: str | None = None,
    continue_token: str | None = None,
    include_object: str = "Metadata",
    with_columns: bool = True,
) -> Obj:
    """A Table of ``objects`` (full objects in, one row each)."""
    columns, printer = PRINTERS.get(plural, (_CUSTOM_COLUMNS, _custom_row))
    rows = []
    for obj in objects:
        row: Obj = {"cells": printer(obj, now)}
        shown = _row_object(obj, include_object)
        if shown is not None:
            row["object"] = shown
        rows.append(row)
    meta: Obj = {}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    if continue_token:
        meta["continue"] = continue_token
    table: Obj = {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta}
    if with_columns:
        table["columnDefinitions"] = [
            {
                "name": name,
                "type": kind,
                "format": "name" if name == "Name" and index == 0 else "",
                "description": description,
                "priority": priority,
            }
            for index, (name, kind, description, priority) in enumerate(columns)
        ]
    table["rows"] = rows
    return table
