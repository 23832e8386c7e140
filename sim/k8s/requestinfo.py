"""What a request is, in Kubernetes terms: the apiserver's ``RequestInfo``.

Resource requests (``/api/v1/...``, ``/apis/{group}/{version}/...``) have a verb
(get, list, watch, create, update, patch, delete, deletecollection), an API group and
version, a resource, an optional subresource, namespace and name. Everything else
(``/api``, ``/apis``, ``/openapi/v2``, ``/healthz``, ...) is a non-resource request whose verb
is the lower-cased HTTP method. Audit events and RBAC rules are written in these terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs

_HTTP_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True)
class RequestInfo:
    path: str
    verb: str
    is_resource: bool = False
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def is_mutation(self) -> bool:
        return self.verb in ("create", "update", "patch", "delete", "deletecollection")


def request_info(method: str, path: str, query: str = "") -> RequestInfo:
    """Parse like ``k8s.io/apiserver/pkg/endpoints/request.RequestInfoFactory``."""
    method = method.upper()
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return RequestInfo(path=path, verb=method.lower())
    if not rest:  # /api/v1, /apis/apps/v1: discovery
        return RequestInfo(path=path, verb=method.lower())
    namespace = ""
    if rest[0] == "namespaces":
        if len(rest) > 1:
            namespace = rest[1]
            # /namespaces/{name}[/status|/finalize] is the namespace itself (name and namespace both {name})
            if len(rest) > 2 and rest[2] not in _NAMESPACE_SUBRESOURCES:
                rest = rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else ""
    subresource = rest[2] if len(rest) > 2 else ""
    params = parse_qs(query)
    if method == "GET":
        watching = params.get("watch", [""])[0] in ("true", "1")
        verb = "watch" if watching else ("get" if name else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = _HTTP_VERBS.get(method, method.lower())
    return RequestInfo(
        path=path,
        verb=verb,
        is_resource=True,
        api_group=group,
        api_version=version,
        resource=resource,
        subresource=subresource,
        namespace=namespace,
        name=name,
    )
