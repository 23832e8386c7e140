"""The Kubernetes REST API of the simulated cluster (the subset fleetmend calls).

Real paths (``/api/v1/...``, ``/apis/{group}/{version}/...``), verbs, list and
object shapes, subresources (``pods/status``, ``pods/eviction``, ``*/scale``,
``*/status``), label and field selectors, optimistic concurrency and
``Status`` errors — so the official ``kubernetes`` client raises its real
exception types. Every request to ``/api`` and ``/apis`` needs the bearer token
from the generated kubeconfig (401 otherwise).
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sim.k8s import objects as o
from sim.k8s.controllers import disruption
from sim.k8s.controllers.workloads import selector_string
from sim.k8s.controlplane import ControlPlane
from sim.k8s.errors import (
    ApiError,
    bad_request,
    conflict,
    invalid,
    method_not_allowed,
    not_found,
    timeout,
    unauthorized,
)
from sim.k8s.faults import ApiFaults, error_for
from sim.k8s.patch import apply_patch
from sim.k8s.resources import RESOURCES, Resource, resource_for

Obj = dict[str, Any]
SERVER_VERSION = {
    "major": "1",
    "minor": "33",
    "gitVersion": "v1.33.4-fleetmend-sim",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-08-01T00:00:00Z",
    "goVersion": "go1.24.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SCALABLE = {"deployments", "replicasets", "leaderworkersets"}
# Pod spec fields the apiserver lets an update change (ValidatePodUpdate).
_MUTABLE_POD_SPEC = {"activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"}


def status_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.status(), status_code=error.code, headers=error.headers)


class KubeApi:
    """Handles one parsed request against the control plane."""

    def __init__(self, control: ControlPlane, faults: ApiFaults, token: str) -> None:
        self.control = control
        self.store = control.store
        self.faults = faults
        self.token = token

    # ------------------------------------------------------------- dispatch
    async def dispatch(self, request: Request, group: str, version: str, rest: str) -> Response:
        try:
            self._authorise(request)
            segments = [s for s in rest.split("/") if s]
            target = self._parse(group, version, segments)
            rule = self.faults.pick(request.method, request.url.path)
            if rule is not None and rule.error == "timeout":
                if rule.apply_before_timeout:
                    await self._handle(request, *target)
                await asyncio.sleep(rule.delay_s)
                raise timeout(
                    "the server was unable to return a response in the time allotted (injected fault)"
                )
            if rule is not None:
                resource, namespace, name, _ = target
                raise error_for(
                    rule,
                    resource.plural,
                    name or "",
                    resource.group,
                    verb=request.method,
                    namespace=namespace or "",
                )
            return await self._handle(request, *target)
        except ApiError as error:
            return status_response(error)

    def _authorise(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        if header != f"Bearer {self.token}":
            raise unauthorized()

    def _parse(
        self, group: str, version: str, segments: list[str]
    ) -> tuple[Resource, str | None, str | None, str | None]:
        if not segments:
            raise not_found("", "", group)
        namespace: str | None = None
        if segments[0] == "namespaces" and len(segments) >= 3 and segments[2] in RESOURCES:
            namespace = segments[1]
            segments = segments[2:]
        plural = segments[0]
        resource = resource_for(group, version, plural)
        if resource is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        name = segments[1] if len(segments) > 1 else None
        sub = segments[2] if len(segments) > 2 else None
        if len(segments) > 3 or (sub is not None and sub not in resource.subresources):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if resource.namespaced and name is not None and namespace is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if not resource.namespaced:
            namespace = None
        return resource, namespace, name, sub

    async def _handle(
        self, request: Request, resource: Resource, namespace: str | None, name: str | None, sub: str | None
    ) -> Response:
        method = request.method
        body = await request.body()
        if name is None:
            if method == "GET":
                return self._list(request, resource, namespace)
            if method == "POST":
                return self._create(resource, namespace, _json(body))
            raise method_not_allowed(
                f"the server does not allow this method on the requested resource ({method})"
            )
        ns = namespace or ""
        if method == "GET":
            obj = self.store.get(resource.plural, ns, name)
            return _ok(self._scale(resource, obj) if sub == "scale" else obj)
        if method == "PATCH":
            return _ok(self._patch(request, resource, ns, name, sub, _json(body)))
        if method == "PUT":
            return _ok(self._replace(resource, ns, name, sub, _json(body)))
        if method == "DELETE":
            return _ok(self._delete(request, resource, ns, name, _json(body) if body else None))
        if method == "POST" and sub == "eviction":
            return self._evict(ns, name, _json(body))
        raise method_not_allowed(
            f"the server does not allow this method on the requested resource ({method})"
        )

    # ----------------------------------------------------------------- reads
    def _list(self, request: Request, resource: Resource, namespace: str | None) -> Response:
        query = request.query_params
        if query.get("watch") in ("true", "1"):
            raise method_not_allowed(
                "watch is not supported by the fleetmend simulator; poll with list instead"
            )
        items = self.store.list(
            resource.plural, namespace, query.get("labelSelector"), query.get("fieldSelector")
        )
        if not resource.custom:
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        meta: Obj = {"resourceVersion": self.store.resource_version}
        limit = int(query.get("limit") or 0)
        start = int(query.get("continue") or 0) if (query.get("continue") or "0").isdigit() else 0
        if limit > 0:
            page = items[start : start + limit]
            if start + limit < len(items):
                meta["continue"] = str(start + limit)
                meta["remainingItemCount"] = len(items) - start - limit
            items = page
        return _ok(
            {"kind": resource.list_kind, "apiVersion": resource.api_version, "metadata": meta, "items": items}
        )

    def _scale(self, resource: Resource, obj: Obj) -> Obj:
        if resource.plural == "leaderworkersets":
            selector = obj.get("status", {}).get("hpaPodSelector", "")
            replicas = int(obj.get("status", {}).get("replicas", 0))
        else:
            selector = selector_string(obj)
            replicas = int(obj.get("status", {}).get("replicas", 0))
        meta = obj["metadata"]
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": int(obj["spec"].get("replicas", 1))},
            "status": {"replicas": replicas, "selector": selector},
        }

    # ---------------------------------------------------------------- writes
    def _create(self, resource: Resource, namespace: str | None, body: Any) -> Response:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        meta = body.setdefault("metadata", {})
        if resource.namespaced:
            body_ns = meta.get("namespace")
            if body_ns and namespace and body_ns != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace or body_ns or "default"
            if self.store.find("namespaces", "", meta["namespace"]) is None:
                raise not_found("namespaces", meta["namespace"])
        self._validate(resource, body, None)
        if resource.plural not in ("nodes", "events"):
            body.pop("status", None)  # status is written by controllers, not on create
        with self.store.lock:
            if resource.plural == "pods":
                created = self.control.create_pod(body)
            else:
                created = self.store.create(resource.plural, body)
        return _ok(created, 201)

    def _patch(
        self, request: Request, resource: Resource, namespace: str, name: str, sub: str | None, body: Any
    ) -> Obj:
        content_type = request.headers.get("content-type")
        with self.store.lock:
            current = self.store.get(resource.plural, namespace, name)
            if sub == "scale":
                scale = self._scale(resource, current)
                patched_scale = apply_patch(scale, body, content_type, custom_resource=resource.custom)
                self._check_precondition(resource, current, patched_scale, body)
                return self._scale(resource, self._set_replicas(resource, current, patched_scale))
            patched = apply_patch(current, body, content_type, custom_resource=resource.custom)
            self._check_precondition(resource, current, patched, body)
            result = self._store_update(resource, current, patched, sub)
        return result

    def _replace(self, resource: Resource, namespace: str, name: str, sub: str | None, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        with self.store.lock:
            current = self.store.get(resource.plural, namespace, name)
            requested = (body.get("metadata") or {}).get("resourceVersion")
            if not requested and resource.custom:
                raise invalid(
                    resource.kind,
                    name,
                    "metadata.resourceVersion",
                    "must be specified for an update",
                    resource.group,
                    "0x0",
                )
            if requested and requested != current["metadata"]["resourceVersion"]:
                raise conflict(resource.plural, name, resource.group)
            if sub == "scale":
                return self._scale(resource, self._set_replicas(resource, current, body))
            body.setdefault("metadata", {})
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._store_update(resource, current, body, sub)

    def _check_precondition(self, resource: Resource, current: Obj, patched: Obj, body: Any) -> None:
        if isinstance(body, dict):
            requested = (body.get("metadata") or {}).get("resourceVersion")
            if requested and requested != current["metadata"]["resourceVersion"]:
                raise conflict(resource.plural, o.name_of(current), resource.group)

    def _set_replicas(self, resource: Resource, current: Obj, scale: Obj) -> Obj:
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise invalid(
                "Scale",
                o.name_of(current),
                "spec.replicas",
                "must be greater than or equal to 0",
                "autoscaling",
                replicas,
            )
        current["spec"]["replicas"] = replicas
        return self.store.update(resource.plural, current, check_version=False)

    def _store_update(self, resource: Resource, current: Obj, new: Obj, sub: str | None) -> Obj:
        name = o.name_of(current)
        new_meta = new.setdefault("metadata", {})
        if new_meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({new_meta.get('name')}) does not match the name on the URL ({name})"
            )
        new_meta["name"] = name
        if resource.namespaced:
            new_meta["namespace"] = o.namespace_of(current)
        if sub == "status":
            result = copy.deepcopy(current)
            result["status"] = new.get("status", {})
            result["metadata"]["resourceVersion"] = new_meta.get(
                "resourceVersion", current["metadata"]["resourceVersion"]
            )
            new = result
        elif "status" in resource.subresources and "status" in current:
            new["status"] = current["status"]
        self._validate(resource, new, current)
        return self.store.update(resource.plural, new)

    def _validate(self, resource: Resource, obj: Obj, current: Obj | None) -> None:
        name = obj.get("metadata", {}).get("name", "")
        for key, value in (obj.get("metadata", {}).get("labels") or {}).items():
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
                raise invalid(
                    resource.kind,
                    name,
                    f"metadata.labels: Invalid value: {value!r}",
                    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                    "and must start and end with an alphanumeric character",
                    resource.group,
                )
            if not key:
                raise invalid(
                    resource.kind, name, "metadata.labels", "label keys must not be empty", resource.group
                )
        if current is None:
            if resource.plural == "pods" and not (obj.get("spec") or {}).get("containers"):
                raise invalid("Pod", name, "spec.containers", "Required value", "")
            return
        if resource.plural in ("deployments", "replicasets") and obj.get("spec", {}).get(
            "selector"
        ) != current["spec"].get("selector"):
            raise invalid(
                resource.kind,
                name,
                "spec.selector",
                "field is immutable",
                resource.group,
                obj["spec"].get("selector"),
            )
        if resource.plural in _SCALABLE:
            replicas = obj.get("spec", {}).get("replicas", 0)
            if not isinstance(replicas, int) or replicas < 0:
                raise invalid(
                    resource.kind,
                    name,
                    "spec.replicas",
                    "must be greater than or equal to 0",
                    resource.group,
                    replicas,
                )
        if resource.plural == "pods":
            old_spec, new_spec = current.get("spec", {}), obj.get("spec", {})
            for key in set(old_spec) | set(new_spec):
                if key in _MUTABLE_POD_SPEC or key == "containers":
                    continue
                if old_spec.get(key) != new_spec.get(key):
                    raise invalid(
                        "Pod",
                        name,
                        "spec",
                        "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                        "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` "
                        "(only additions to existing tolerations), `spec.terminationGracePeriodSeconds`",
                    )
            old_c = [{k: v for k, v in c.items() if k != "image"} for c in old_spec.get("containers") or []]
            new_c = [{k: v for k, v in c.items() if k != "image"} for c in new_spec.get("containers") or []]
            if old_c != new_c:
                raise invalid(
                    "Pod",
                    name,
                    "spec.containers",
                    "Forbidden: pod updates may not change fields other than `spec.containers[*].image`",
                )

    def _delete(self, request: Request, resource: Resource, namespace: str, name: str, options: Any) -> Obj:
        query = request.query_params
        grace: int | None = int(query["gracePeriodSeconds"]) if query.get("gracePeriodSeconds") else None
        propagation = query.get("propagationPolicy")
        if isinstance(options, dict):
            if options.get("gracePeriodSeconds") is not None:
                grace = int(options["gracePeriodSeconds"])
            propagation = options.get("propagationPolicy") or propagation
            preconditions = options.get("preconditions") or {}
            current = self.store.get(resource.plural, namespace, name)
            if preconditions.get("uid") and preconditions["uid"] != current["metadata"]["uid"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {current['metadata']['uid']}",
                    {"name": name, "kind": resource.plural},
                )
            if (
                preconditions.get("resourceVersion")
                and preconditions["resourceVersion"] != current["metadata"]["resourceVersion"]
            ):
                raise conflict(resource.plural, name, resource.group)
        if resource.plural == "nodes":
            self.control.restore_node(name)
        with self.store.lock:
            return self.control.delete(
                resource.plural, namespace, name, grace_seconds=grace, propagation=propagation
            )

    def _evict(self, namespace: str, name: str, body: Any) -> Response:
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            disruption.check_eviction(self.control, pod)
            grace = None
            if isinstance(body, dict):
                options = body.get("deleteOptions") or {}
                if options.get("gracePeriodSeconds") is not None:
                    grace = int(options["gracePeriodSeconds"])
            if not o.is_terminating(pod):
                stamp = self.control.clock.timestamp()
                self.store.mutate(
                    "pods",
                    namespace,
                    name,
                    lambda obj: o.set_condition(
                        obj,
                        "DisruptionTarget",
                        "True",
                        stamp,
                        "EvictionByEvictionAPI",
                        "Eviction API: evicting",
                    ),
                )
            self.control.delete("pods", namespace, name, grace_seconds=grace)
        return _ok(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}, 201
        )


def _json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at position {exc.pos}") from None


def _ok(obj: Obj, status: int = 200) -> JSONResponse:
    return JSONResponse(obj, status_code=status)


def _resource_list(group_version: str, resources: list[Resource]) -> Obj:
    entries = []
    for r in resources:
        verbs = ["get", "list", "patch", "update", "create", "delete"]
        entries.append(
            {
                "name": r.plural,
                "singularName": r.kind.lower(),
                "namespaced": r.namespaced,
                "kind": r.kind,
                "verbs": verbs,
                "shortNames": list(r.short_names),
            }
        )
        for sub in r.subresources:
            entries.append(
                {
                    "name": f"{r.plural}/{sub}",
                    "singularName": "",
                    "namespaced": r.namespaced,
                    "kind": "Scale" if sub == "scale" else ("Eviction" if sub == "eviction" else r.kind),
                    "verbs": ["create"] if sub == "eviction" else ["get", "patch", "update"],
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": entries,
    }


def build_router(api: KubeApi) -> APIRouter:
    """Routes for ``/api``, ``/apis`` and ``/version``."""
    router = APIRouter()
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    def discovery_guard(request: Request) -> Response | None:
        try:
            api._authorise(request)
        except ApiError as error:
            return status_response(error)
        return None

    @router.get("/version", include_in_schema=False)
    async def version() -> JSONResponse:
        return JSONResponse(SERVER_VERSION)

    @router.get("/api", include_in_schema=False)
    async def core_versions(request: Request) -> Response:
        return discovery_guard(request) or JSONResponse(
            {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        )

    @router.get("/api/v1", include_in_schema=False)
    async def core_resources(request: Request) -> Response:
        return discovery_guard(request) or JSONResponse(
            _resource_list("v1", [r for r in RESOURCES.values() if not r.group])
        )

    @router.get("/apis", include_in_schema=False)
    async def groups(request: Request) -> Response:
        denied = discovery_guard(request)
        if denied:
            return denied
        seen: dict[str, str] = {r.group: r.version for r in RESOURCES.values() if r.group}
        return JSONResponse(
            {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {
                        "name": g,
                        "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                        "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
                    }
                    for g, v in sorted(seen.items())
                ],
            }
        )

    @router.get("/apis/{group}/{version}", include_in_schema=False)
    async def group_resources(request: Request, group: str, version: str) -> Response:
        denied = discovery_guard(request)
        if denied:
            return denied
        members = [r for r in RESOURCES.values() if r.group == group and r.version == version]
        if not members:
            return status_response(
                ApiError(404, "NotFound", "the server could not find the requested resource", {})
            )
        return JSONResponse(_resource_list(f"{group}/{version}", members))

    @router.api_route("/api/v1/{rest:path}", methods=methods, include_in_schema=False)
    async def core(request: Request, rest: str) -> Response:
        return await api.dispatch(request, "", "v1", rest)

    @router.api_route("/apis/{group}/{version}/{rest:path}", methods=methods, include_in_schema=False)
    async def grouped(request: Request, group: str, version: str, rest: str) -> Response:
        return await api.dispatch(request, group, version, rest)

    return router
