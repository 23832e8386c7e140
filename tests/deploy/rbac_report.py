"""Each grant of the shipped RBAC, with the calls that used it, derived from the API server's audit log.

The simulated API server enforces RBAC and writes every request as an ``audit.k8s.io/v1`` Event with
the requesting user (``system:serviceaccount:fleetmend:fleetmend-worker``, ...). ``RbacReport``
expands the rendered Roles and ClusterRoles into single grants (component, verb, API group,
resource, where) and attributes each allowed call of a fleetmend ServiceAccount to the grants that
allow it: a grant no call used is one fleetmend does not need; a forbidden call is one the Roles lack.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sim.k8s.rbac import SA_PREFIX, Attributes, rule_allows

Obj = dict[str, Any]


@dataclass(frozen=True, order=True)
class GrantRule:
    """One verb on one resource, given to one component by one binding."""

    component: str
    role: str  # "ClusterRole/fleetmend-worker-pool"
    binding: str  # "RoleBinding inference/fleetmend-worker-pool"
    namespace: str  # where it applies; "" = every namespace (ClusterRoleBinding)
    verb: str
    group: str
    resource: str

    def describe(self) -> str:
        where = f"in {self.namespace}" if self.namespace else "cluster-wide"
        return (
            f"{self.component}: {self.verb} {self.resource} ({self.group or 'core'}) {where} "
            f"[{self.role} via {self.binding}]"
        )

    def allows(self, attrs: Attributes) -> bool:
        if self.namespace and attrs.namespace != self.namespace:
            return False
        rule = {"verbs": [self.verb], "apiGroups": [self.group], "resources": [self.resource]}
        return rule_allows(rule, attrs)


@dataclass
class RbacReport:
    grants: list[GrantRule]
    used: dict[GrantRule, set[str]] = field(default_factory=dict)
    denied: list[str] = field(default_factory=list)  # the API server's 403 messages to fleetmend
    calls: int = 0

    @property
    def unused(self) -> list[GrantRule]:
        return [g for g in self.grants if not self.used.get(g)]

    def lines(self) -> list[str]:
        out = []
        for grant in self.grants:
            calls = sorted(self.used.get(grant, set()))
            out.append(
                f"{grant.describe()}: {len(calls)} distinct call(s)" + (" UNUSED" if not calls else "")
            )
            out.extend(f"    {c}" for c in calls[:5])
        out.extend(f"DENIED: {line}" for line in self.denied)
        return out


def grant_rules(objects: Iterable[Obj], components: dict[str, tuple[str, str]]) -> list[GrantRule]:
    """Every (verb, group, resource) the rendered bindings give each component's ServiceAccount."""
    objects = list(objects)
    roles = {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
    }
    found: set[GrantRule] = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        meta = binding["metadata"]
        scope = meta.get("namespace", "") if binding["kind"] == "RoleBinding" else ""
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], scope if ref["kind"] == "Role" else "", ref["name"]))
        if role is None:
            continue
        where = f"{binding['kind']} {scope + '/' if scope else ''}{meta['name']}"
        for component, (sa_ns, sa_name) in components.items():
            if not any(
                s.get("kind") == "ServiceAccount" and s.get("namespace") == sa_ns and s.get("name") == sa_name
                for s in binding.get("subjects") or []
            ):
                continue
            for rule in role.get("rules") or []:
                for verb in rule.get("verbs") or []:
                    for group in rule.get("apiGroups") or []:
                        for resource in rule.get("resources") or []:
                            found.add(
                                GrantRule(
                                    component,
                                    f"{ref['kind']}/{ref['name']}",
                                    where,
                                    scope,
                                    verb,
                                    group,
                                    resource,
                                )
                            )
    return sorted(found)


def _attributes(event: Obj) -> Attributes:
    ref = event.get("objectRef") or {}
    return Attributes(
        verb=str(event.get("verb", "")),
        namespace=str(ref.get("namespace", "")),
        group=str(ref.get("apiGroup", "")),
        resource=str(ref.get("resource", "")),
        subresource=str(ref.get("subresource", "")),
        name=str(ref.get("name", "")),
    )


def build_report(
    objects: Iterable[Obj], components: dict[str, tuple[str, str]], events: Iterable[Obj]
) -> RbacReport:
    """The grants of ``objects`` with the calls in ``events`` (audit Events) that used each."""
    report = RbacReport(grant_rules(objects, components))
    users = {f"{SA_PREFIX}{ns}:{name}": component for component, (ns, name) in components.items()}
    for event in events:
        component = users.get((event.get("user") or {}).get("username", ""))
        if component is None or not event.get("objectRef"):
            continue
        report.calls += 1
        status = event.get("responseStatus") or {}
        forbidden = (event.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid"
        if status.get("code") == 403 and forbidden:  # RBAC's refusal, not an injected (admission) one
            message = f"{component}: {status.get('message', '')}"
            if message not in report.denied:
                report.denied.append(message)
            continue
        attrs = _attributes(event)
        where = f"in {attrs.namespace}" if attrs.namespace else "cluster-wide"
        call = f"{attrs.verb} {attrs.qualified} ({attrs.group or 'core'}) {where}"
        for grant in report.grants:
            if grant.component == component and grant.allows(attrs):
                report.used.setdefault(grant, set()).add(call)
    return report


def wildcard_rules(objects: Iterable[Obj]) -> list[str]:
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
