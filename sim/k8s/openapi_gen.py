"""Generate ``sim/k8s/data/openapi-definitions.json.gz``: the served kinds' OpenAPI definitions.

The apiserver's OpenAPI definitions for Kubernetes v1.37, taken from the ``_definitions.json``
that the ``kubernetes-validate`` package ships (a JSON-Schema rendering of the release's
``swagger.json``: same names, descriptions, ``required`` lists and ``x-kubernetes-*`` extensions),
turned back into OpenAPI form (``"type": ["string", "null"]`` -> ``"string"``, refs to
``#/definitions/...``, the ``apiVersion``/``kind`` enums kubernetes-validate adds removed) and cut
down to what the simulator serves. Run it when the served kinds or the version change::

    python -m sim.k8s.openapi_gen          # needs the dev extra (kubernetes-validate)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

VERSION = "1.37.0"
OUT = Path(__file__).parent / "data" / "openapi-definitions.json.gz"
ROOTS = [
    "io.k8s.api.core.v1.Pod",
    "io.k8s.api.core.v1.PodList",
    "io.k8s.api.core.v1.Node",
    "io.k8s.api.core.v1.NodeList",
    "io.k8s.api.core.v1.Namespace",
    "io.k8s.api.core.v1.NamespaceList",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.core.v1.ServiceList",
    "io.k8s.api.core.v1.Event",
    "io.k8s.api.core.v1.EventList",
    "io.k8s.api.core.v1.ConfigMap",
    "io.k8s.api.core.v1.ConfigMapList",
    "io.k8s.api.discovery.v1.EndpointSlice",
    "io.k8s.api.discovery.v1.EndpointSliceList",
    "io.k8s.api.coordination.v1.Lease",
    "io.k8s.api.coordination.v1.LeaseList",
    "io.k8s.api.apps.v1.Deployment",
    "io.k8s.api.apps.v1.DeploymentList",
    "io.k8s.api.apps.v1.ReplicaSet",
    "io.k8s.api.apps.v1.ReplicaSetList",
    "io.k8s.api.apps.v1.StatefulSet",
    "io.k8s.api.apps.v1.StatefulSetList",
    "io.k8s.api.apps.v1.DaemonSet",
    "io.k8s.api.apps.v1.DaemonSetList",
    "io.k8s.api.batch.v1.Job",
    "io.k8s.api.batch.v1.JobList",
    "io.k8s.api.policy.v1.PodDisruptionBudget",
    "io.k8s.api.policy.v1.PodDisruptionBudgetList",
    "io.k8s.api.policy.v1.Eviction",
    "io.k8s.api.autoscaling.v1.Scale",
    # What fleetmend's own manifests (deploy/k8s) create, so `kubectl apply --dry-run=server` runs.
    "io.k8s.api.core.v1.ServiceAccount",
    "io.k8s.api.core.v1.ServiceAccountList",
    "io.k8s.api.networking.v1.NetworkPolicy",
    "io.k8s.api.networking.v1.NetworkPolicyList",
    "io.k8s.api.rbac.v1.Role",
    "io.k8s.api.rbac.v1.RoleList",
    "io.k8s.api.rbac.v1.RoleBinding",
    "io.k8s.api.rbac.v1.RoleBindingList",
    "io.k8s.api.rbac.v1.ClusterRole",
    "io.k8s.api.rbac.v1.ClusterRoleList",
    "io.k8s.api.rbac.v1.ClusterRoleBinding",
    "io.k8s.api.rbac.v1.ClusterRoleBindingList",
    # Dynamic Resource Allocation (resource.k8s.io/v1): GPUs as devices of the NVIDIA DRA driver.
    "io.k8s.api.resource.v1.DeviceClass",
    "io.k8s.api.resource.v1.DeviceClassList",
    "io.k8s.api.resource.v1.ResourceSlice",
    "io.k8s.api.resource.v1.ResourceSliceList",
    "io.k8s.api.resource.v1.ResourceClaim",
    "io.k8s.api.resource.v1.ResourceClaimList",
    "io.k8s.api.resource.v1.ResourceClaimTemplate",
    "io.k8s.api.resource.v1.ResourceClaimTemplateList",
    "io.k8s.api.resource.v1.DeviceTaintRule",
    "io.k8s.api.resource.v1.DeviceTaintRuleList",
    "io.k8s.apimachinery.pkg.apis.meta.v1.DeleteOptions",
    "io.k8s.apimachinery.pkg.apis.meta.v1.Status",
    "io.k8s.apimachinery.pkg.apis.meta.v1.WatchEvent",
    "io.k8s.apimachinery.pkg.apis.meta.v1.APIResourceList",
    "io.k8s.apimachinery.pkg.apis.meta.v1.Patch",
]


def _openapi(node: Any, *, parent_key: str = "") -> Any:
    if isinstance(node, list):
        return [_openapi(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = value.replace("#/$defs/", "#/definitions/")
        elif key == "type" and isinstance(value, list):
            kinds = [v for v in value if v != "null"]
            out[key] = kinds[0] if len(kinds) == 1 else kinds
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _openapi(prop, parent_key=name) for name, prop in value.items()}
        elif key == "enum" and parent_key in ("apiVersion", "kind"):
            continue  # kubernetes-validate pins these; the apiserver's schema does not
        else:
            out[key] = _openapi(value)
    return out


def _special(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The few definitions whose OpenAPI v2 form is not a plain schema (int-or-string, quantity)."""
    description = schema.get("description", "")
    if name == "io.k8s.apimachinery.pkg.util.intstr.IntOrString":
        return {"description": description, "type": "string", "format": "int-or-string"}
    if name == "io.k8s.apimachinery.pkg.api.resource.Quantity":
        return {"description": description, "type": "string"}
    return schema


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def generate() -> dict[str, Any]:
    from kubernetes_validate.utils import schema_contents

    source = schema_contents(f"kubernetes-json-schema/v{VERSION}-local/_definitions.json", VERSION)["$defs"]
    wanted: dict[str, Any] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        schema = _special(name, _openapi(source[name]))
        wanted[name] = schema
        todo.extend(sorted(_refs(schema) - set(wanted)))
    return {"version": VERSION, "definitions": dict(sorted(wanted.items()))}


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(generate(), sort_keys=True, separators=(",", ":")).encode()
    OUT.write_bytes(gzip.compress(data, mtime=0))
    print(f"wrote {OUT} ({len(data)} bytes of JSON)")


if __name__ == "__main__":
    main()
