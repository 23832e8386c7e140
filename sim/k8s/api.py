"""The Kubernetes REST API of the simulated cluster, as kubectl, client-go and the Python client use it.

Real paths (``/api/v1/...``, ``/apis/{group}/{version}/...``), verbs, list and object shapes,
subresources (``pods/status``, ``pods/eviction`` in policy/v1, ``*/scale`` in autoscaling/v1,
``*/status``), label and field selectors, optimistic concurrency and ``Status`` errors for every
failure (also 404s on unknown paths), so the official clients raise their real exception types.

* authentication: the bearer token of the generated kubeconfig (the admin) or a ServiceAccount's
  token; none or another is 401 (``--anonymous-auth=false``); ``/version``, ``/healthz``, ``/livez``,
  ``/readyz`` are open. Resource requests are authorized by RBAC (``sim.k8s.rbac``: 403 outside a
  ServiceAccount's Roles), which also answers the access reviews and TokenRequests;
* ``?watch=true`` streams (see ``sim.k8s.watch``); lists page with ``limit`` + ``continue``
  tokens (expired: 410, malformed: 400) and honour ``resourceVersion`` / ``resourceVersionMatch``;
* ``dryRun=All`` on create, update, patch, delete, deletecollection and eviction: validated and
  answered as a write would be, nothing stored, no controller runs;
* ``fieldValidation`` (Strict: 400 on unknown fields; Warn, the default: a ``Warning`` header;
  Ignore) against the served OpenAPI schemas; unknown fields of built-in kinds are dropped;
* ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io``: server-side printing (``sim.k8s.tables``);
* server-side apply (``application/apply-patch+yaml``) is refused with 415 (see README);
* discovery (``/api``, ``/apis``, ``/apis/{g}/{v}``) and OpenAPI v2/v3 (``sim.k8s.openapi``).

Every request is written to the audit log by ``sim.k8s.audit.AuditMiddleware``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import json
import re
from typing import Any

import yaml
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sim.k8s import objects as o
from sim.k8s import openapi
from sim.k8s.audit import User
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
    unsupported_media_type,
)
from sim.k8s.faults import ApiFaults, error_for
from sim.k8s.patch import apply_patch
from sim.k8s.rbac import Rbac, review_from_protobuf
from sim.k8s.requestinfo import RequestInfo, request_info
from sim.k8s.resources import RESOURCES, Resource, resource_for
from sim.k8s.tables import to_table, wants_table
from sim.k8s.watch import DEFAULT_TIMEOUT_S, WatchHub, WatchRequest

Obj = dict[str, Any]
SERVER_VERSION = {
    "major": "1",
    "minor": "37",
    "emulationMajor": "1",
    "emulationMinor": "37",
    "minCompatibilityMajor": "1",
    "minCompatibilityMinor": "36",
    "gitVersion": "v1.37.1-fleetmend-sim",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-08-01T00:00:00Z",
    "goVersion": "go1.25.5",
    "compiler": "gc",
    "platform": "linux/amd64",
}
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SCALABLE = {"deployments", "replicasets", "statefulsets", "leaderworkersets"}
# Pod spec fields the apiserver lets an update change (ValidatePodUpdate).
_MUTABLE_POD_SPEC = {"activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds"}
_BODY_TYPES = ["application/json", "application/yaml"]
_FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
_NOT_FOUND = "the server could not find the requested resource"
_CONTINUE_VERSION = "meta.k8s.io/v1"


def status_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.status(), status_code=error.code, headers=error.headers)


def _not_found_path() -> ApiError:
    return ApiError(404, "NotFound", _NOT_FOUND, {})


class KubeApi:
    """Handles one parsed request against the control plane."""

    def __init__(self, control: ControlPlane, faults: ApiFaults, token: str) -> None:
        self.control = control
        self.store = control.store
        self.faults = faults
        self.token = token
        self.watches = WatchHub(self.store)
        self.rbac = Rbac(self.store, token)

    # ------------------------------------------------------------- identity
    def authenticate(self, headers: dict[str, str]) -> User | None:
        """The user a request acts as (the kubeconfig's admin, a ServiceAccount, or whom the admin
        impersonates), or None."""
        return self.rbac.authenticate(headers)

    def _authorise(self, request: Request) -> User:
        headers = {k.lower(): v for k, v in request.headers.items()}
        user = self.authenticate(headers)
        if user is None:
            raise unauthorized()
        self.rbac.check_impersonation(headers)
        return user

    # ------------------------------------------------------------- dispatch
    async def dispatch(self, request: Request, group: str, version: str, rest: str) -> Response:
        try:
            user = self._authorise(request)
            info = request_info(request.method, request.url.path, request.url.query)
            # The authorizer's decision, for the audit event's annotation: a 403 that comes later (an
            # injected refusal, like an admission webhook's) was authorized, not forbidden by RBAC.
            request.state.authorization_decision = "forbid"
            self.rbac.authorize(user, info)
            request.state.authorization_decision = "allow"
            review = await self._review(request, user, info)
            if review is not None:
                return review
            segments = [s for s in rest.split("/") if s]
            target = self._parse(group, version, segments)
            # The body is read only for a write (Starlette keeps it for the handler).
            body = await request.body() if request.method in ("POST", "PUT", "PATCH") else b""
            rule = self.faults.pick(request.method, request.url.path, body)
            if rule is not None and rule.error == "timeout":
                if rule.apply_before_timeout:
                    await self._handle(request, info, *target)
                await asyncio.sleep(rule.delay_s)
                raise timeout(
                    "the server was unable to return a response in the time allotted (injected fault)"
                )
            if rule is not None:
                resource, namespace, name, sub = target
                raise error_for(
                    rule,
                    resource.plural + (f"/{sub}" if sub else ""),
                    name or "",
                    resource.group,
                    verb=info.verb,
                    namespace=namespace or "",
                )
            return await self._handle(request, info, *target)
        except ApiError as error:
            return status_response(error)

    async def _review(self, request: Request, user: User, info: RequestInfo) -> Response | None:
        """Access reviews and TokenRequests (``sim.k8s.rbac``), answered before routing."""
        reviews = ("selfsubjectaccessreviews", "selfsubjectrulesreviews")
        if info.verb != "create" or not (
            info.resource in reviews or (info.resource, info.subresource) == ("serviceaccounts", "token")
        ):
            return None
        clock = self.control.clock
        content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        if content_type == "application/vnd.kubernetes.protobuf":  # kubectl auth can-i sends these
            body = review_from_protobuf(await request.body())
        else:
            body = await _body(request)
        answer = self.rbac.serve(
            user,
            info,
            body,
            clock.timestamp(),
            clock.timestamp(clock.now() + 3600),
        )
        return None if answer is None else _ok(answer, 201)

    def _parse(
        self, group: str, version: str, segments: list[str]
    ) -> tuple[Resource, str | None, str | None, str | None]:
        if not segments:
            raise _not_found_path()
        namespace: str | None = None
        if segments[0] == "namespaces" and len(segments) >= 3 and segments[2] in RESOURCES:
            namespace = segments[1]
            segments = segments[2:]
        plural = segments[0]
        resource = resource_for(group, version, plural)
        if resource is None:
            raise _not_found_path()
        name = segments[1] if len(segments) > 1 else None
        sub = segments[2] if len(segments) > 2 else None
        if len(segments) > 3 or (sub is not None and sub not in resource.subresources):
            raise _not_found_path()
        if resource.namespaced and name is not None and namespace is None:
            raise _not_found_path()
        if not resource.namespaced:
            namespace = None
        return resource, namespace, name, sub

    async def _handle(
        self,
        request: Request,
        info: RequestInfo,
        resource: Resource,
        namespace: str | None,
        name: str | None,
        sub: str | None,
    ) -> Response:
        method = request.method
        query = request.query_params
        dry_run = _dry_run(query.getlist("dryRun"))
        if name is None:
            if method == "GET":
                if info.verb == "watch":
                    return self._watch(request, resource, namespace)
                return self._list(request, resource, namespace)
            if method == "POST":
                body = await _body(request)
                validation = _field_validation(query.get("fieldValidation"))
                created, warnings = self._create(resource, namespace, body, dry_run, validation)
                return _ok(created, 201, warnings)
            if method == "DELETE":
                return self._delete_collection(request, resource, namespace, dry_run)
            raise method_not_allowed(
                f"the server does not allow this method on the requested resource ({method})"
            )
        ns = namespace or ""
        if method == "GET":
            obj = self.store.get(resource.plural, ns, name)
            if sub == "log":
                return PlainTextResponse(self.control.pod_log(obj, query.get("container")))
            if sub == "scale":
                return _ok(self._scale(resource, obj))
            if wants_table(request.headers.get("accept")):
                return _ok(self._table(request, resource, [obj], obj["metadata"]["resourceVersion"]))
            return _ok(obj)
        if method == "PATCH":
            content_type = request.headers.get("content-type")
            raw = await request.body()
            validation = _field_validation(query.get("fieldValidation"))
            patched, warnings = self._patch(
                resource, ns, name, sub, content_type, _json(raw), dry_run, validation
            )
            return _ok(patched, 200, warnings)
        if method == "PUT":
            body = await _body(request)
            validation = _field_validation(query.get("fieldValidation"))
            replaced, warnings = self._replace(resource, ns, name, sub, body, dry_run, validation)
            return _ok(replaced, 200, warnings)
        if method == "DELETE":
            raw = await request.body()
            options = _json(raw) if raw else None
            return _ok(self._delete(request, resource, ns, name, options, dry_run))
        if method == "POST" and sub == "eviction":
            return self._evict(ns, name, await _body(request), dry_run)
        raise method_not_allowed(
            f"the server does not allow this method on the requested resource ({method})"
        )

    # ----------------------------------------------------------------- reads
    def _list(self, request: Request, resource: Resource, namespace: str | None) -> Response:
        query = request.query_params
        rv = query.get("resourceVersion") or ""
        match = query.get("resourceVersionMatch") or ""
        current = int(self.store.resource_version)
        if match and not rv:
            raise bad_request("resourceVersionMatch is forbidden unless resourceVersion is provided")
        if match and match not in ("Exact", "NotOlderThan"):
            raise bad_request(
                f'resourceVersionMatch: Unsupported value: "{match}": supported values: "Exact", "NotOlderThan"'
            )
        if rv and rv != "0":
            requested = _int_rv(rv)
            if requested > current:
                raise ApiError(
                    504,
                    "Timeout",
                    f"Too large resource version: {requested}, current: {current}",
                    {
                        "causes": [
                            {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                        ]
                    },
                    {"Retry-After": "1"},
                )
            if match == "Exact" and requested != current:
                raise ApiError(410, "Expired", f"too old resource version: {requested} ({current})", {})
        limit = _int_param(query.get("limit"), "limit")
        token = query.get("continue") or ""
        with self.store.lock:
            start_after = ""
            if token:
                if rv:
                    raise bad_request("specifying resource version is not allowed when using continue")
                token_rv, start_after = _decode_continue(token)
                if token_rv < self.store.compacted_before(resource.plural):
                    raise ApiError(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent list result. "
                        "You can start a new list without the continue parameter.",
                        {},
                    )
            items = self.store.list(
                resource.plural, namespace, query.get("labelSelector"), query.get("fieldSelector")
            )
            list_rv = self.store.resource_version
        if start_after:
            items = [i for i in items if _item_key(i) > start_after]
        next_token = None
        remaining = None
        if limit > 0 and len(items) > limit:
            remaining = len(items) - limit
            items = items[:limit]
            next_token = _encode_continue(int(list_rv), _item_key(items[-1]))
        if wants_table(request.headers.get("accept")):
            return _ok(self._table(request, resource, items, list_rv, next_token))
        if not resource.custom:
            for item in items:
                item.pop("kind", None)
                item.pop("apiVersion", None)
        meta: Obj = {"resourceVersion": list_rv}
        if next_token:
            meta["continue"] = next_token
            meta["remainingItemCount"] = remaining
        return _ok(
            {"kind": resource.list_kind, "apiVersion": resource.api_version, "metadata": meta, "items": items}
        )

    def _table(
        self,
        request: Request,
        resource: Resource,
        items: list[Obj],
        rv: str,
        continue_token: str | None = None,
        *,
        with_columns: bool = True,
    ) -> Obj:
        include = request.query_params.get("includeObject") or "Metadata"
        if include not in ("None", "Metadata", "Object"):
            raise bad_request(f'includeObject: Unsupported value: "{include}"')
        return to_table(
            resource.plural,
            items,
            self.control.clock.now(),
            resource_version=rv,
            continue_token=continue_token,
            include_object=include,
            with_columns=with_columns,
        )

    def _watch(self, request: Request, resource: Resource, namespace: str | None) -> Response:
        query = request.query_params
        rv = query.get("resourceVersion") or ""
        if rv:
            _int_rv(rv)
        send_initial = query.get("sendInitialEvents") in ("true", "1")
        if send_initial and (
            query.get("resourceVersionMatch") != "NotOlderThan"
            or query.get("allowWatchBookmarks") not in ("true", "1")
        ):
            raise invalid(
                "ListOptions",
                "",
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless allowWatchBookmarks=true and "
                "resourceVersionMatch=NotOlderThan",
                "meta.k8s.io",
            )
        timeout_s = float(_int_param(query.get("timeoutSeconds"), "timeoutSeconds") or DEFAULT_TIMEOUT_S)
        # Selectors are checked before the stream starts, so a bad one is a 400, not a broken stream.
        from sim.k8s.selectors import parse_field_selector, parse_label_selector

        parse_label_selector(query.get("labelSelector"))
        parse_field_selector(query.get("fieldSelector"), resource.field_selectors)
        table = wants_table(request.headers.get("accept"))

        def render(event_type: str, obj: Obj, first: bool) -> Obj:
            if not table:
                return obj
            rv_now = obj.get("metadata", {}).get("resourceVersion", "")
            return self._table(request, resource, [obj], rv_now, with_columns=first)

        watch = WatchRequest(
            resource=resource,
            namespace=namespace,
            label_selector=query.get("labelSelector"),
            field_selector=query.get("fieldSelector"),
            resource_version=rv,
            send_initial_events=send_initial,
            bookmarks=query.get("allowWatchBookmarks") in ("true", "1"),
            timeout_s=timeout_s,
        )
        return StreamingResponse(
            self.watches.stream(watch, render),
            media_type="application/json",
            headers={"Cache-Control": "no-cache, private"},
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
    def _decode(self, resource: Resource, obj: Obj, validation: str) -> list[str]:
        """Strict/Warn/Ignore decoding of a body into ``resource``: unknown fields are dropped.

        Returns the warnings to send (Warn); raises the apiserver's 400 (Strict).
        """
        unknown = openapi.prune_unknown_fields(resource, obj)
        if not unknown or validation == "Ignore":
            return []
        if validation == "Strict":
            listed = ", ".join(f'unknown field "{f}"' for f in unknown)
            raise bad_request(
                f'{resource.kind} in version "{resource.version}" cannot be handled as a {resource.kind}: '
                f"strict decoding error: {listed}"
            )
        return [f'unknown field "{f}"' for f in unknown]

    def _create(
        self, resource: Resource, namespace: str | None, body: Any, dry_run: bool, validation: str
    ) -> tuple[Obj, list[str]]:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        _check_kind(resource, body)
        warnings = self._decode(resource, body, validation)
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
        if resource.plural == "devicetaintrules":
            _stamp_device_taint(body, None, self.control.clock.timestamp())
        if resource.plural not in ("nodes", "events"):
            body.pop("status", None)  # status is written by controllers, not on create
            _initial_status(resource, body)
        with self.store.lock:
            if resource.plural == "pods":
                created = self.control.create_pod(body, dry_run=dry_run)
            elif resource.plural == "jobs":
                created = self.control.create_job(body, dry_run=dry_run)
            else:
                created = self.store.create(resource.plural, body, dry_run=dry_run)
        return created, warnings

    def _patch(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        sub: str | None,
        content_type: str | None,
        body: Any,
        dry_run: bool,
        validation: str,
    ) -> tuple[Obj, list[str]]:
        with self.store.lock:
            current = self.store.get(resource.plural, namespace, name)
            if sub == "scale":
                scale = self._scale(resource, current)
                patched_scale = apply_patch(scale, body, content_type, custom_resource=resource.custom)
                self._check_precondition(resource, current, patched_scale, body)
                updated = self._set_replicas(resource, current, patched_scale, dry_run)
                return self._scale(resource, updated), []
            patched = apply_patch(current, body, content_type, custom_resource=resource.custom)
            self._check_precondition(resource, current, patched, body)
            warnings = self._decode(resource, patched, validation)
            result = self._store_update(resource, current, patched, sub, dry_run)
        return result, warnings

    def _replace(
        self,
        resource: Resource,
        namespace: str,
        name: str,
        sub: str | None,
        body: Any,
        dry_run: bool,
        validation: str,
    ) -> tuple[Obj, list[str]]:
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
                return self._scale(resource, self._set_replicas(resource, current, body, dry_run)), []
            _check_kind(resource, body)
            warnings = self._decode(resource, body, validation)
            body.setdefault("metadata", {})
            body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._store_update(resource, current, body, sub, dry_run), warnings

    def _check_precondition(self, resource: Resource, current: Obj, patched: Obj, body: Any) -> None:
        if isinstance(body, dict):
            requested = (body.get("metadata") or {}).get("resourceVersion")
            if requested and requested != current["metadata"]["resourceVersion"]:
                raise conflict(resource.plural, o.name_of(current), resource.group)

    def _set_replicas(self, resource: Resource, current: Obj, scale: Obj, dry_run: bool = False) -> Obj:
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
        return self.store.update(resource.plural, current, check_version=False, dry_run=dry_run)

    def _store_update(
        self, resource: Resource, current: Obj, new: Obj, sub: str | None, dry_run: bool = False
    ) -> Obj:
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
        if resource.plural == "devicetaintrules" and sub != "status":
            _stamp_device_taint(new, current, self.control.clock.timestamp())
        self._validate(resource, new, current)
        return self.store.update(resource.plural, new, dry_run=dry_run)

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

    def _delete(
        self, request: Request, resource: Resource, namespace: str, name: str, options: Any, dry_run: bool
    ) -> Obj:
        query = request.query_params
        grace: int | None = _int_param(query.get("gracePeriodSeconds"), "gracePeriodSeconds", None)
        propagation = query.get("propagationPolicy")
        current = self.store.get(resource.plural, namespace, name)
        if isinstance(options, dict):
            if options.get("kind") not in (None, "DeleteOptions"):
                raise bad_request(f"the body of a delete must be DeleteOptions, got {options.get('kind')}")
            if options.get("gracePeriodSeconds") is not None:
                grace = int(options["gracePeriodSeconds"])
            propagation = options.get("propagationPolicy") or propagation
            dry_run = dry_run or _dry_run(options.get("dryRun") or [])
            preconditions = options.get("preconditions") or {}
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
        if propagation not in (None, "", "Orphan", "Background", "Foreground"):
            raise bad_request(f'propagationPolicy: Unsupported value: "{propagation}"')
        if dry_run:
            return self._deleted_view(resource, current, grace)
        if resource.plural == "nodes":
            self.control.restore_node(name)
        with self.store.lock:
            return self.control.delete(
                resource.plural, namespace, name, grace_seconds=grace, propagation=propagation
            )

    def _deleted_view(self, resource: Resource, current: Obj, grace: int | None) -> Obj:
        """What a delete would answer, without deleting (dry run)."""
        meta = current["metadata"]
        if resource.plural == "pods":
            if grace is None:
                grace = int(current.get("spec", {}).get("terminationGracePeriodSeconds", 30))
            graceful = (
                grace > 0 and current.get("spec", {}).get("nodeName") and not o.is_pod_terminal(current)
            )
            if graceful and "deletionTimestamp" not in meta:
                meta["deletionTimestamp"] = self.control.clock.timestamp(self.control.now() + grace)
                meta["deletionGracePeriodSeconds"] = grace
        elif meta.get("finalizers") and "deletionTimestamp" not in meta:
            meta["deletionTimestamp"] = self.control.clock.timestamp()
            meta["deletionGracePeriodSeconds"] = 0
        return current

    def _delete_collection(
        self, request: Request, resource: Resource, namespace: str | None, dry_run: bool
    ) -> Response:
        query = request.query_params
        grace = _int_param(query.get("gracePeriodSeconds"), "gracePeriodSeconds", None)
        with self.store.lock:
            items = self.store.list(
                resource.plural, namespace, query.get("labelSelector"), query.get("fieldSelector")
            )
            deleted = []
            for item in items:
                if dry_run:
                    deleted.append(self._deleted_view(resource, item, grace))
                else:
                    deleted.append(
                        self.control.delete(
                            resource.plural, o.namespace_of(item), o.name_of(item), grace_seconds=grace
                        )
                    )
            rv = self.store.resource_version
        return _ok(
            {
                "kind": resource.list_kind,
                "apiVersion": resource.api_version,
                "metadata": {"resourceVersion": rv},
                "items": deleted,
            }
        )

    def _evict(self, namespace: str, name: str, body: Any, dry_run: bool) -> Response:
        if body is not None and not isinstance(body, dict):
            raise bad_request("the body of an eviction must be a policy/v1 Eviction")
        if isinstance(body, dict):
            if body.get("kind") not in (None, "Eviction"):
                raise bad_request(f"the body of an eviction must be an Eviction, got {body.get('kind')}")
            body_name = (body.get("metadata") or {}).get("name")
            if body_name and body_name != name:
                raise bad_request(
                    f"name in URL does not match name in Eviction object: {name} != {body_name}"
                )
        options = (body or {}).get("deleteOptions") or {}
        dry_run = dry_run or _dry_run(options.get("dryRun") or [])
        with self.store.lock:
            pod = self.store.get("pods", namespace, name)
            preconditions = options.get("preconditions") or {}
            if preconditions.get("uid") and preconditions["uid"] != pod["metadata"]["uid"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: UID in precondition: {preconditions['uid']}, UID in object meta: {pod['metadata']['uid']}",
                    {"name": name, "kind": "pods"},
                )
            disruption.check_eviction(self.control, pod)
            grace = None
            if options.get("gracePeriodSeconds") is not None:
                grace = int(options["gracePeriodSeconds"])
            if not dry_run:
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


# ---------------------------------------------------------------------------- helpers
def _initial_status(resource: Resource, body: Obj) -> None:
    """The status a kind's create strategy starts from: a Service's is ``{"loadBalancer": {}}``
    (PrepareForCreate resets it to an empty ServiceStatus, which serializes so)."""
    if resource.plural == "services":
        body["status"] = {"loadBalancer": {}}


def _stamp_device_taint(rule: Obj, current: Obj | None, now: str) -> None:
    """A DeviceTaintRule's ``spec.taint.timeAdded``: set on create when absent; on an update that changes
    the effect, replaced by the current time when the request kept the old value (the apiserver's strategy)."""
    taint = (rule.get("spec") or {}).get("taint")
    if not isinstance(taint, dict):
        return
    old = ((current or {}).get("spec") or {}).get("taint") or {}
    if not taint.get("timeAdded"):
        taint["timeAdded"] = old.get("timeAdded") if current is not None and old.get("timeAdded") else now
    if (
        current is not None
        and old.get("effect") != taint.get("effect")
        and taint.get("timeAdded") == old.get("timeAdded")
    ):
        taint["timeAdded"] = now


def _dry_run(values: list[str] | Any) -> bool:
    values = [values] if isinstance(values, str) else list(values or [])
    for value in values:
        if value != "All":
            raise bad_request(f'dryRun: Unsupported value: "{value}": supported values: "All"')
    return bool(values)


def _field_validation(value: str | None) -> str:
    if not value:
        return "Warn"
    if value not in _FIELD_VALIDATION:
        raise bad_request(
            f'fieldValidation: Unsupported value: "{value}": supported values: "Ignore", "Strict", "Warn"'
        )
    return value


def _int_param(value: str | None, name: str, default: int | None = 0) -> Any:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise bad_request(f'{name}: Invalid value: "{value}": must be an integer') from None


def _int_rv(value: str) -> int:
    try:
        rv = int(value)
    except ValueError:
        rv = -1
    if rv < 0:
        raise bad_request(f'resourceVersion: Invalid value: "{value}": must be a non-negative integer')
    return rv


def _item_key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _encode_continue(rv: int, start_after: str) -> str:
    raw = json.dumps({"v": _CONTINUE_VERSION, "rv": rv, "start": start_after + "\u0000"})
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        if data.get("v") != _CONTINUE_VERSION or not isinstance(data.get("rv"), int):
            raise ValueError("unknown continue token version")
        start = str(data.get("start", ""))
    except (ValueError, binascii.Error, AttributeError):
        raise bad_request("continue key is not valid: the continue token is malformed") from None
    return int(data["rv"]), start.rstrip("\x00")


def _check_kind(resource: Resource, body: Obj) -> None:
    kind, api_version = body.get("kind"), body.get("apiVersion")
    if kind and kind != resource.kind:
        raise bad_request(
            f"the object provided is unrecognized (must be of type {resource.kind}): kind {kind!r} "
            f"does not match the resource {resource.plural}"
        )
    if api_version and api_version != resource.api_version:
        raise bad_request(
            f"the API version in the data ({api_version}) does not match the expected API version "
            f"({resource.api_version})"
        )


async def _body(request: Request) -> Any:
    """A POST/PUT body: JSON (also with no Content-Type, as the Python client sends) or YAML."""
    raw = await request.body()
    kind = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if kind in ("", "application/json", "*/*"):
        return _json(raw)
    if kind == "application/yaml":
        try:
            return yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as exc:
            raise bad_request(f"the request body is not valid YAML: {exc}") from None
    error = unsupported_media_type(_BODY_TYPES)
    if "protobuf" in kind or "cbor" in kind:
        error.message += (
            f" (the simulated API server does not decode {kind} request bodies; kubectl's create "
            "generators send them: write the object as YAML and use `kubectl create -f` or `kubectl apply -f`)"
        )
    raise error


def _json(body: bytes) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at position {exc.pos}") from None


def _ok(obj: Obj, status: int = 200, warnings: list[str] | None = None) -> JSONResponse:
    headers = None
    if warnings:
        # RFC 7234 warn-code 299, as the apiserver sends (one header, comma-joined values).
        headers = {"Warning": ", ".join(f'299 - "{w.replace(chr(34), chr(92) + chr(34))}"' for w in warnings)}
    return JSONResponse(obj, status_code=status, headers=headers)


# --------------------------------------------------------------------------- discovery
def resource_list(group_version: str, resources: list[Resource]) -> Obj:
    """``APIResourceList`` as ``/api/v1`` and ``/apis/{group}/{version}`` serve it."""
    entries: list[Obj] = []
    for r in resources:
        entry: Obj = {
            "name": r.plural,
            "singularName": r.singular,
            "namespaced": r.namespaced,
            "kind": r.kind,
            "verbs": list(r.verbs),
        }
        if r.short_names:
            entry["shortNames"] = list(r.short_names)
        if r.categories:
            entry["categories"] = list(r.categories)
        entry["storageVersionHash"] = base64.b64encode(f"{r.group}/{r.version}/{r.kind}".encode()).decode()[
            :11
        ]
        entries.append(entry)
        for sub in r.subresources:
            group, version, kind = r.subresource_kind(sub)
            sub_entry: Obj = {
                "name": f"{r.plural}/{sub}",
                "singularName": "",
                "namespaced": r.namespaced,
                "kind": kind,
                "verbs": list(r.subresource_verbs(sub)),
            }
            if (group, version) != (r.group, r.version):
                sub_entry["group"] = group
                sub_entry["version"] = version
            entries.append(sub_entry)
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": entries,
    }


def group_list() -> Obj:
    seen: dict[str, str] = {r.group: r.version for r in RESOURCES.values() if r.group}
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            {
                "name": g,
                "versions": [{"groupVersion": f"{g}/{v}", "version": v}],
                "preferredVersion": {"groupVersion": f"{g}/{v}", "version": v},
            }
            for g, v in _discovery_groups(seen)
        ],
    }


def _discovery_groups(seen: dict[str, str]) -> list[tuple[str, str]]:
    groups = dict(seen)
    builtin_order = ["apps", "policy", "discovery.k8s.io", "coordination.k8s.io"]
    ordered = [(g, groups.pop(g)) for g in builtin_order if g in groups]
    return ordered + sorted(groups.items())


def build_router(api: KubeApi) -> APIRouter:
    """Routes for ``/api``, ``/apis``, ``/version``, health and OpenAPI."""
    router = APIRouter()
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]

    def guard(request: Request) -> Response | None:
        try:
            api._authorise(request)
        except ApiError as error:
            return status_response(error)
        return None

    @router.get("/version", include_in_schema=False)
    async def version() -> JSONResponse:
        return JSONResponse(SERVER_VERSION)

    for path in ("/healthz", "/livez", "/readyz"):

        async def health(request: Request) -> Response:
            if "verbose" in request.query_params:
                checks = ["ping", "log", "etcd", "poststarthook/start-apiextensions-controllers"]
                text = "".join(f"[+]{c} ok\n" for c in checks)
                return PlainTextResponse(text + f"{request.url.path.strip('/')} check passed\n")
            return PlainTextResponse("ok")

        router.add_api_route(path, health, methods=["GET"], include_in_schema=False)

    @router.get("/api", include_in_schema=False)
    async def core_versions(request: Request) -> Response:
        return guard(request) or JSONResponse(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": request.url.netloc}
                ],
            }
        )

    @router.get("/api/v1", include_in_schema=False)
    async def core_resources(request: Request) -> Response:
        return guard(request) or JSONResponse(
            resource_list("v1", [r for r in RESOURCES.values() if not r.group])
        )

    @router.get("/apis", include_in_schema=False)
    async def groups(request: Request) -> Response:
        return guard(request) or JSONResponse(group_list())

    @router.get("/apis/{group}/{version}", include_in_schema=False)
    async def group_resources(request: Request, group: str, version: str) -> Response:
        denied = guard(request)
        if denied:
            return denied
        members = [r for r in RESOURCES.values() if r.group == group and r.version == version]
        if not members:
            return status_response(_not_found_path())
        return JSONResponse(resource_list(f"{group}/{version}", members))

    @router.get("/apis/{group}", include_in_schema=False)
    async def group_versions(request: Request, group: str) -> Response:
        denied = guard(request)
        if denied:
            return denied
        for entry in group_list()["groups"]:
            if entry["name"] == group:
                return JSONResponse({"kind": "APIGroup", "apiVersion": "v1", **entry})
        return status_response(_not_found_path())

    @router.get("/openapi/v2", include_in_schema=False)
    async def openapi_v2(request: Request) -> Response:
        denied = guard(request)
        if denied:
            return denied
        accept = request.headers.get("accept") or ""
        if "json" not in accept and "*/*" not in accept and accept:
            # client-go asks for the protobuf encoding first; only JSON is served here.
            return status_response(
                ApiError(406, "NotAcceptable", "only application/json is served for /openapi/v2", {})
            )
        return JSONResponse(openapi.v2_document(SERVER_VERSION["gitVersion"]))

    @router.get("/openapi/v3", include_in_schema=False)
    async def openapi_v3_index(request: Request) -> Response:
        return guard(request) or JSONResponse(openapi.v3_index(SERVER_VERSION["gitVersion"]))

    @router.get("/openapi/v3/{path:path}", include_in_schema=False)
    async def openapi_v3(request: Request, path: str) -> Response:
        denied = guard(request)
        if denied:
            return denied
        document = openapi.v3_document(path, SERVER_VERSION["gitVersion"])
        if document is None:
            return status_response(_not_found_path())
        return JSONResponse(document, headers={"Cache-Control": "public, immutable"})

    @router.api_route("/api/v1/{rest:path}", methods=methods, include_in_schema=False)
    async def core(request: Request, rest: str) -> Response:
        return await api.dispatch(request, "", "v1", rest)

    @router.api_route("/apis/{group}/{version}/{rest:path}", methods=methods, include_in_schema=False)
    async def grouped(request: Request, group: str, version: str, rest: str) -> Response:
        return await api.dispatch(request, group, version, rest)

    return router


def exec_routes(api: KubeApi) -> APIRouter:
    """``pods/{name}/exec`` (``sim.k8s.execstream``): matched before the generic resource routes."""
    from sim.k8s.execstream import exec_router

    return exec_router(
        api.authenticate,
        lambda namespace, name: api.store.find("pods", namespace, name),
        api.control.is_node_lost,
    )


def build_kube_app(api: KubeApi) -> FastAPI:
    """The API server as one ASGI app: Kubernetes routes, and a ``Status`` 404 for every other path."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(exec_routes(api))
    app.include_router(build_router(api))

    @app.api_route(
        "/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"], include_in_schema=False
    )
    async def unknown(request: Request, rest: str) -> Response:
        try:
            api._authorise(request)
        except ApiError as error:
            return status_response(error)
        return status_response(_not_found_path())

    return app
