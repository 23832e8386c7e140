"""What fleetmend asks the Kubernetes API for, and whether the shipped RBAC allows it.

* ``KubeCallRecorder`` records every request the official ``kubernetes`` client sends from this
  process (it wraps ``RESTClientObject.request``, where every API call leaves the library) as a
  ``KubeCall``: who sent it (the worker's activities or the webhook), verb, API group, resource,
  subresource, namespace — the attributes an RBAC authorizer decides on, derived from method and
  URL exactly as the API server's request-info resolver does. Until the simulated API server
  writes audit events (``audit.k8s.io/v1``), this is the record; the decision logic below takes
  ``KubeCall`` from either source.
* ``Rbac`` evaluates the rendered manifests (ClusterRoles, Roles and their bindings) the way the
  RBAC authorizer does, for a ServiceAccount; ``denied`` names the rule that is missing.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes.client import rest

WORKER = "worker"
WEBHOOK = "webhook"
GATEWAY = "gateway"

# Discovery documents are readable by every authenticated identity through the cluster's own
# default ClusterRole system:discovery; fleetmend's RBAC does not (and need not) grant them.
DISCOVERY_PATHS = ("/api", "/apis", "/version", "/openapi")


@dataclass(frozen=True, order=True)
class KubeCall:
    component: str
    verb: str
    group: str  # "" = core
    resource: str
    subresource: str = ""
    namespace: str = ""  # "" = cluster-scoped or all namespaces
    name: str = field(default="", compare=False)

    @property
    def key(self) -> tuple[str, str, str, str, str, str]:
        return (self.component, self.verb, self.group, self.resource, self.subresource, self.namespace)

    def describe(self) -> str:
        what = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        group = self.group or "core"
        where = f"in namespace {self.namespace}" if self.namespace else "cluster-wide"
        return f"{self.verb} {what} ({group}) {where}"


def request_info(method: str, url: str) -> tuple[str, str, str, str, str, str] | None:
    """(verb, group, resource, subresource, namespace, name) of a resource request; None for discovery."""
    parts = urlsplit(url)
    segments = [s for s in parts.path.split("/") if s]
    if not segments or segments[0] not in ("api", "apis"):
        return None
    if segments[0] == "api":
        group, rest_ = "", segments[2:]
    else:
        if len(segments) < 3:
            return None
        group, rest_ = segments[1], segments[3:]
    if not rest_:
        return None  # /api/v1, /apis/apps/v1: discovery
    namespace = ""
    if rest_[0] == "namespaces" and len(rest_) >= 3:
        namespace, rest_ = rest_[1], rest_[2:]
    resource = rest_[0]
    name = rest_[1] if len(rest_) > 1 else ""
    sub = rest_[2] if len(rest_) > 2 else ""
    if resource == "namespaces" and name:
        namespace = name  # the namespace object itself lives "in" itself, as the API server says
    query = parse_qs(parts.query)
    method = method.upper()
    if method == "GET":
        verb = "watch" if query.get("watch", [""])[0] in ("true", "1") else ("get" if name else "list")
    elif method == "POST":
        verb = "create"
    elif method == "PUT":
        verb = "update"
    elif method == "PATCH":
        verb = "patch"
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = method.lower()
    return verb, group, resource, sub, namespace, name


def _component() -> str | None:
    """Which fleetmend process a call belongs to, from where it was made (None: the test itself)."""
    frames = [f.filename for f in traceback.extract_stack()]
    # The webhook's lookups run in the alert intake it shares with the fast path (worker/intake/).
    if any("/worker/webhook/" in f or "/worker/intake/" in f for f in frames):
        return WEBHOOK
    if any(f.endswith("/gateway/world.py") for f in frames) or threading.current_thread().name.startswith(
        "gateway-watch"
    ):
        return GATEWAY
    if threading.current_thread().name.startswith("fleetmend-activity"):
        return WORKER
    return None


class KubeCallRecorder:
    """Records fleetmend's Kubernetes API calls in this process while installed."""

    def __init__(self) -> None:
        self.calls: list[KubeCall] = []
        self.discovery: list[str] = []
        self._lock = threading.Lock()
        self._original: Callable[..., Any] | None = None

    def install(self) -> None:
        original = rest.RESTClientObject.request
        recorder = self

        def request(client: Any, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
            recorder.record(method, url)
            return original(client, method, url, *args, **kwargs)

        self._original = original
        rest.RESTClientObject.request = request  # type: ignore[method-assign,assignment]

    def uninstall(self) -> None:
        if self._original is not None:
            rest.RESTClientObject.request = self._original  # type: ignore[method-assign,assignment]
            self._original = None

    def record(self, method: str, url: str) -> None:
        component = _component()
        if component is None:
            return
        info = request_info(method, url)
        with self._lock:
            if info is None:
                self.discovery.append(urlsplit(url).path)
                return
            verb, group, resource, sub, namespace, name = info
            self.calls.append(KubeCall(component, verb, group, resource, sub, namespace, name))

    def distinct(self) -> list[KubeCall]:
        with self._lock:
            return sorted({c.key: c for c in self.calls}.values())


@contextmanager
def recording() -> Iterator[KubeCallRecorder]:
    recorder = KubeCallRecorder()
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.uninstall()


# ------------------------------------------------------------------------------------------ RBAC


@dataclass(frozen=True)
class Grant:
    """One rule of one role as a ServiceAccount holds it: where it applies and through what."""

    role: str  # "ClusterRole/x" or "Role/ns/x"
    binding: str
    namespace: str  # "" = every namespace and cluster-scoped resources (ClusterRoleBinding)
    rule: dict[str, Any]


class Rbac:
    """The RBAC objects of a rendered manifest set."""

    def __init__(
        self, objects: Iterable[dict[str, Any]], service_accounts: dict[str, tuple[str, str]]
    ) -> None:
        """``service_accounts``: component -> (namespace, ServiceAccount name)."""
        objs = list(objects)
        self.service_accounts = service_accounts
        self.cluster_roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ClusterRole"}
        self.roles = {
            (o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs if o["kind"] == "Role"
        }
        self.bindings = [o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]

    def grants(self, component: str) -> list[Grant]:
        sa_namespace, sa_name = self.service_accounts[component]
        out: list[Grant] = []
        for b in self.bindings:
            subjects = b.get("subjects") or []
            if not any(
                s.get("kind") == "ServiceAccount"
                and s.get("name") == sa_name
                and s.get("namespace") == sa_namespace
                for s in subjects
            ):
                continue
            ref = b["roleRef"]
            scope = "" if b["kind"] == "ClusterRoleBinding" else b["metadata"]["namespace"]
            if ref["kind"] == "ClusterRole":
                role = self.cluster_roles.get(ref["name"])
                label = f"ClusterRole/{ref['name']}"
            else:
                role = self.roles.get((scope, ref["name"]))
                label = f"Role/{scope}/{ref['name']}"
            if role is None:
                continue  # a dangling roleRef grants nothing
            binding = f"{b['kind']}/{(scope + '/') if scope else ''}{b['metadata']['name']}"
            out += [Grant(label, binding, scope, rule) for rule in role.get("rules") or []]
        return out

    @staticmethod
    def _matches(rule: dict[str, Any], call: KubeCall) -> bool:
        if call.verb not in rule.get("verbs", []):
            return False
        if call.group not in rule.get("apiGroups", []):
            return False
        wanted = f"{call.resource}/{call.subresource}" if call.subresource else call.resource
        if wanted not in rule.get("resources", []):
            return False
        names = rule.get("resourceNames") or []
        return not names or call.name in names

    def allowing(self, call: KubeCall) -> list[Grant]:
        """The grants that allow ``call`` (empty: denied)."""
        out = []
        for grant in self.grants(call.component):
            if grant.namespace and grant.namespace != call.namespace:
                continue  # a RoleBinding allows its own namespace only (never cluster-wide requests)
            if self._matches(grant.rule, call):
                out.append(grant)
        return out

    def denied(self, calls: Iterable[KubeCall]) -> list[str]:
        """One line per call the RBAC would refuse, naming the ServiceAccount and the rule to add."""
        lines = []
        for call in calls:
            if self.allowing(call):
                continue
            ns, sa = self.service_accounts[call.component]
            subresource = f"/{call.subresource}" if call.subresource else ""
            rule = f"apiGroups: [{call.group!r}], resources: [{call.resource}{subresource}], verbs: [{call.verb}]"
            scope = (
                f"a Role/RoleBinding in namespace {call.namespace}"
                if call.namespace
                else "a ClusterRole with a ClusterRoleBinding"
            )
            lines.append(
                f"RBAC denies {ns}/{sa} ({call.component}): {call.describe()}; needs {{{rule}}} in {scope}"
            )
        return lines

    def unused(self, calls: Iterable[KubeCall]) -> list[str]:
        """Every (role, group, resource, verb) granted that no recorded call used: broader than needed."""
        recorded = list(calls)
        lines = []
        for component in self.service_accounts:
            for grant in self.grants(component):
                for group in grant.rule.get("apiGroups", []):
                    for resource in grant.rule.get("resources", []):
                        for verb in grant.rule.get("verbs", []):
                            res, _, sub = resource.partition("/")
                            used = any(
                                c.component == component
                                and (c.verb, c.group, c.resource, c.subresource) == (verb, group, res, sub)
                                and (not grant.namespace or c.namespace == grant.namespace)
                                for c in recorded
                            )
                            if not used:
                                lines.append(
                                    f"{grant.role} (via {grant.binding}) grants {verb} {resource} "
                                    f"({group or 'core'}) that {component} never called"
                                )
        return lines


def wildcard_rules(objects: Iterable[dict[str, Any]]) -> list[str]:
    """Rules with a ``*`` anywhere (never acceptable in fleetmend's RBAC)."""
    out = []
    for o in objects:
        if o["kind"] not in ("ClusterRole", "Role"):
            continue
        for rule in o.get("rules") or []:
            for key in ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs"):
                if any("*" in str(v) for v in rule.get(key) or []):
                    out.append(f"{o['kind']}/{o['metadata']['name']}: {key} {rule[key]}")
    return out


if __name__ == "__main__":  # pragma: no cover - a debugging aid: parse a URL
    print(request_info(sys.argv[1], sys.argv[2]))
