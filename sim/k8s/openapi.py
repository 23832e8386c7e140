"""OpenAPI v2 (``/openapi/v2``) and v3 (``/openapi/v3``, ``/openapi/v3/{api/v1|apis/g/v}``) documents.

Built from the Kubernetes v1.37 definitions of the served kinds (``data/openapi-definitions.json.gz``,
see ``sim.k8s.openapi_gen``) plus a structural schema for the LeaderWorkerSet custom resource (as its
CRD publishes one). ``kubectl explain`` reads the v3 documents (schemas carry
``x-kubernetes-group-version-kind``); ``kubectl apply``/``create`` find the ``fieldValidation``
query parameter on each PATCH operation and so let the server validate (``fieldValidation=Strict``).
The same definitions drive the server's decoding: ``prune_unknown_fields`` drops (and names)
fields a built-in kind does not have, as the apiserver's decoder does.

v2 is served as JSON only (client-go asks for its protobuf form first and falls back where it can).
"""

from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

from sim.k8s.resources import LWS_GROUP, RESOURCES, Resource

Obj = dict[str, Any]
DATA = Path(__file__).parent / "data" / "openapi-definitions.json.gz"
LWS_SCHEMA_NAME = "io.x-k8s.leaderworkerset.v1.LeaderWorkerSet"
_META = "io.k8s.apimachinery.pkg.apis.meta.v1"

_LWS_SCHEMA: Obj = {
    "description": "LeaderWorkerSet is the Schema for the leaderworkersets API",
    "type": "object",
    "properties": {
        "apiVersion": {
            "description": "APIVersion defines the versioned schema of this representation of an object.",
            "type": "string",
        },
        "kind": {
            "description": "Kind is a string value representing the REST resource this object represents.",
            "type": "string",
        },
        "metadata": {"$ref": f"#/definitions/{_META}.ObjectMeta"},
        "spec": {
            "description": "LeaderWorkerSetSpec defines the desired state of LeaderWorkerSet",
            "type": "object",
            "properties": {
                "replicas": {
                    "description": "Number of leader-workers groups. A scale subresource is available; defaults to 1.",
                    "type": "integer",
                    "format": "int32",
                },
                "startupPolicy": {
                    "description": "StartupPolicy determines the startup policy for the worker statefulset: LeaderCreated or LeaderReady.",
                    "type": "string",
                },
                "leaderWorkerTemplate": {
                    "description": "LeaderWorkerTemplate defines the template for leader/worker pods",
                    "type": "object",
                    "properties": {
                        "size": {
                            "description": "Number of pods to create: the leader plus size-1 workers.",
                            "type": "integer",
                            "format": "int32",
                        },
                        "restartPolicy": {
                            "description": "RestartPolicy defines the restart policy when pod failures happen: RecreateGroupOnPodRestart or None.",
                            "type": "string",
                        },
                        "leaderTemplate": {
                            "description": "LeaderTemplate defines the pod template for leader pods.",
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        },
                        "workerTemplate": {
                            "description": "WorkerTemplate defines the pod template for worker pods.",
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        },
                    },
                    "x-kubernetes-preserve-unknown-fields": True,
                },
                "rolloutStrategy": {
                    "description": "RolloutStrategy defines the strategy that will be applied to update replicas when a revision is made to the leaderWorkerTemplate.",
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                },
                "networkConfig": {
                    "description": "NetworkConfig defines the network configuration of the group",
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                },
            },
            "x-kubernetes-preserve-unknown-fields": True,
        },
        "status": {
            "description": "LeaderWorkerSetStatus defines the observed state of LeaderWorkerSet",
            "type": "object",
            "properties": {
                "replicas": {
                    "description": "Replicas track the total number of groups that have been created (updated or not, ready or not)",
                    "type": "integer",
                    "format": "int32",
                },
                "readyReplicas": {
                    "description": "ReadyReplicas track the number of groups that are in ready state (updated or not).",
                    "type": "integer",
                    "format": "int32",
                },
                "updatedReplicas": {
                    "description": "UpdatedReplicas track the number of groups that have been updated (ready or not).",
                    "type": "integer",
                    "format": "int32",
                },
                "hpaPodSelector": {
                    "description": "HPAPodSelector for pods that belong to the LeaderWorkerSet object, this is needed for HPA to know what pods belong to the LeaderWorkerSet object.",
                    "type": "string",
                },
                "conditions": {
                    "description": "Conditions track the condition of the leaderworkerset.",
                    "type": "array",
                    "items": {"$ref": f"#/definitions/{_META}.Condition"},
                },
            },
            "x-kubernetes-preserve-unknown-fields": True,
        },
    },
    "x-kubernetes-group-version-kind": [{"group": LWS_GROUP, "kind": "LeaderWorkerSet", "version": "v1"}],
}


@functools.cache
def definitions() -> dict[str, Obj]:
    """Every served definition, OpenAPI v2 style (refs to ``#/definitions/...``)."""
    data = json.loads(gzip.decompress(DATA.read_bytes()))
    defs: dict[str, Obj] = data["definitions"]
    defs[LWS_SCHEMA_NAME] = _LWS_SCHEMA
    defs[LWS_SCHEMA_NAME + "List"] = {
        "description": "LeaderWorkerSetList is a list of LeaderWorkerSet",
        "type": "object",
        "required": ["items"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "items": {"type": "array", "items": {"$ref": f"#/definitions/{LWS_SCHEMA_NAME}"}},
            "metadata": {"$ref": f"#/definitions/{_META}.ListMeta"},
        },
        "x-kubernetes-group-version-kind": [
            {"group": LWS_GROUP, "kind": "LeaderWorkerSetList", "version": "v1"}
        ],
    }
    return defs


@functools.cache
def _by_gvk() -> dict[tuple[str, str, str], str]:
    index: dict[tuple[str, str, str], str] = {}
    for name, schema in definitions().items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            index.setdefault((gvk.get("group", ""), gvk["version"], gvk["kind"]), name)
    return index


def schema_name(group: str, version: str, kind: str) -> str | None:
    return _by_gvk().get((group, version, kind))


# ------------------------------------------------------------------------ decoding
def _resolve(schema: Obj) -> Obj:
    defs = definitions()
    while True:
        ref = schema.get("$ref")
        if not ref and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
            ref = schema["allOf"][0].get("$ref")
        if not ref:
            return schema
        schema = defs.get(ref.rsplit("/", 1)[-1], {})


def _prune(schema: Obj, value: Any, path: str, unknown: list[str]) -> None:
    schema = _resolve(schema)
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        if props is None and not isinstance(extra, dict):
            return  # free-form (RawExtension, FieldsV1, ...)
        for key in list(value):
            where = f"{path}.{key}" if path else key
            if props is not None and key in props:
                _prune(props[key], value[key], where, unknown)
            elif isinstance(extra, dict):
                _prune(extra, value[key], where, unknown)
            else:
                unknown.append(where)
                del value[key]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            _prune(schema["items"], item, f"{path}[{index}]", unknown)


def prune_unknown_fields(resource: Resource, obj: Obj) -> list[str]:
    """Drop the fields of ``obj`` that ``resource``'s kind does not declare; returns their paths."""
    if resource.custom:
        return []
    name = schema_name(resource.group, resource.version, resource.kind)
    if name is None:
        return []
    unknown: list[str] = []
    _prune(definitions()[name], obj, "", unknown)
    return unknown


# ------------------------------------------------------------------------- documents
def _param(name: str, description: str, kind: str = "string") -> Obj:
    return {"name": name, "in": "query", "description": description, "type": kind, "uniqueItems": True}


_WRITE_PARAMS = [
    _param("dryRun", "When present, indicates that modifications should not be persisted. Valid value: All"),
    _param(
        "fieldManager",
        "fieldManager is a name associated with the actor or entity that is making these changes.",
    ),
    _param(
        "fieldValidation",
        "fieldValidation instructs the server on how to handle objects in the request containing unknown or "
        "duplicate fields. Valid values are: Ignore, Warn (default), Strict.",
    ),
]
_LIST_PARAMS = [
    _param("labelSelector", "A selector to restrict the list of returned objects by their labels."),
    _param("fieldSelector", "A selector to restrict the list of returned objects by their fields."),
    _param("limit", "limit is a maximum number of responses to return for a list call.", "integer"),
    _param("continue", "The continue option should be set when retrieving more results from the server."),
    _param(
        "resourceVersion",
        "resourceVersion sets a constraint on what resource versions a request may be served from.",
    ),
    _param(
        "resourceVersionMatch",
        "resourceVersionMatch determines how resourceVersion is applied to list calls.",
    ),
    _param("watch", "Watch for changes to the described resources and return them as a stream.", "boolean"),
    _param(
        "allowWatchBookmarks", 'allowWatchBookmarks requests watch events with type "BOOKMARK".', "boolean"
    ),
    _param("sendInitialEvents", "`sendInitialEvents=true` may be set together with `watch=true`.", "boolean"),
    _param("timeoutSeconds", "Timeout for the list/watch call.", "integer"),
]


def _base_path(resource: Resource, namespaced_path: bool) -> str:
    prefix = "/api/v1" if not resource.group else f"/apis/{resource.group}/{resource.version}"
    if resource.namespaced and namespaced_path:
        return f"{prefix}/namespaces/{{namespace}}/{resource.plural}"
    return f"{prefix}/{resource.plural}"


def _operation(
    resource: Resource, action: str, kind: str, group: str, version: str, params: list[Obj], ref: str
) -> Obj:
    return {
        "description": f"{action} {kind}",
        "operationId": f"{action}{resource.kind}",
        "parameters": params,
        "responses": {"200": {"description": "OK", "schema": {"$ref": f"#/definitions/{ref}"}}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": group, "kind": kind, "version": version},
    }


def _paths(resources: list[Resource]) -> Obj:
    paths: Obj = {}
    for resource in resources:
        kind_ref = schema_name(resource.group, resource.version, resource.kind) or ""
        list_ref = schema_name(resource.group, resource.version, resource.list_kind) or kind_ref
        gv = (resource.group, resource.version)
        collection = _base_path(resource, True)
        paths[collection] = {
            "get": _operation(resource, "list", resource.kind, *gv, _LIST_PARAMS, list_ref),
            "post": _operation(resource, "post", resource.kind, *gv, _WRITE_PARAMS, kind_ref),
            "delete": _operation(
                resource, "deletecollection", resource.kind, *gv, _LIST_PARAMS, f"{_META}.Status"
            ),
        }
        if resource.namespaced:
            paths[_base_path(resource, False)] = {
                "get": _operation(resource, "list", resource.kind, *gv, _LIST_PARAMS, list_ref)
            }
        paths[collection + "/{name}"] = {
            "get": _operation(resource, "get", resource.kind, *gv, [], kind_ref),
            "put": _operation(resource, "put", resource.kind, *gv, _WRITE_PARAMS, kind_ref),
            "patch": _operation(resource, "patch", resource.kind, *gv, _WRITE_PARAMS, kind_ref),
            "delete": _operation(resource, "delete", resource.kind, *gv, _WRITE_PARAMS[:1], kind_ref),
        }
        for sub in resource.subresources:
            group, version, kind = resource.subresource_kind(sub)
            ref = schema_name(group, version, kind) or kind_ref
            where = collection + "/{name}/" + sub
            if sub == "eviction":
                paths[where] = {
                    "post": _operation(resource, "post", kind, group, version, _WRITE_PARAMS, ref)
                }
            else:
                paths[where] = {
                    "get": _operation(resource, "get", kind, group, version, [], ref),
                    "put": _operation(resource, "put", kind, group, version, _WRITE_PARAMS, ref),
                    "patch": _operation(resource, "patch", kind, group, version, _WRITE_PARAMS, ref),
                }
    return paths


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


def _closure(names: set[str]) -> dict[str, Obj]:
    defs = definitions()
    out: dict[str, Obj] = {}
    todo = sorted(names)
    while todo:
        name = todo.pop()
        if name in out or name not in defs:
            continue
        out[name] = defs[name]
        todo.extend(_refs(defs[name]) - set(out))
    return dict(sorted(out.items()))


@functools.cache
def v2_document(git_version: str) -> Obj:
    resources = list(RESOURCES.values())
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": git_version},
        "paths": _paths(resources),
        "definitions": definitions(),
    }


def _group_versions() -> dict[str, list[Resource]]:
    out: dict[str, list[Resource]] = {}
    for resource in RESOURCES.values():
        key = "api/v1" if not resource.group else f"apis/{resource.group}/{resource.version}"
        out.setdefault(key, []).append(resource)
    return out


def _to_v3(node: Any) -> Any:
    """OpenAPI v2 schema -> v3: refs to components, a ref with siblings wrapped in allOf."""
    if isinstance(node, list):
        return [_to_v3(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _to_v3(value) for key, value in node.items() if key != "$ref"}
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = ref.replace("#/definitions/", "#/components/schemas/")
        if out:
            out["allOf"] = [{"$ref": target}]
        else:
            out["$ref"] = target
    return out


def _v3_operation(op: Obj) -> Obj:
    result = copy.deepcopy(op)
    params = []
    for param in result.pop("parameters", []):
        kind = param.pop("type", "string")
        param.pop("uniqueItems", None)
        params.append({**param, "schema": {"type": kind, "uniqueItems": True}})
    result["parameters"] = params
    schema = result["responses"]["200"].pop("schema")
    result["responses"]["200"]["content"] = {"application/json": {"schema": _to_v3(schema)}}
    return result


@functools.cache
def v3_document(path: str, git_version: str) -> Obj | None:
    resources = _group_versions().get(path.strip("/"))
    if resources is None:
        return None
    paths = {
        where: {verb: _v3_operation(op) for verb, op in ops.items()}
        for where, ops in _paths(resources).items()
    }
    wanted = _refs(paths) | {
        name
        for r in resources
        for name in (schema_name(r.group, r.version, r.kind), schema_name(r.group, r.version, r.list_kind))
        if name
    }
    wanted |= {f"{_META}.Status", f"{_META}.DeleteOptions", f"{_META}.WatchEvent"}
    schemas = {name: _to_v3(schema) for name, schema in _closure(wanted).items()}
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": git_version},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def v3_index(git_version: str = "") -> Obj:
    entries = {}
    for path in sorted(_group_versions()):
        document = v3_document(path, git_version) or {}
        digest = hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest().upper()[:128]
        entries[path] = {"serverRelativeURL": f"/openapi/v3/{path}?hash={digest}"}
    return {"paths": entries}
