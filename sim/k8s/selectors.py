"""Label and field selectors with the apiserver's syntax.

Label selectors: equality (``a=b``, ``a==b``, ``a!=b``), set-based
(``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``), comma-joined = AND.
Field selectors: ``path=value`` / ``path!=value`` on the few fields the
apiserver indexes (``metadata.name``, ``metadata.namespace``, ``spec.nodeName``,
``status.phase``, and ``involvedObject.*`` for events).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from sim.k8s.errors import ApiError, bad_request

Matcher = Callable[[Mapping[str, str]], bool]

_SET_RE = re.compile(r"^\s*(!?)([A-Za-z0-9./_-]+)\s*(?:\s(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ_RE = re.compile(r"^\s*([A-Za-z0-9./_-]+)\s*(==|=|!=)\s*([A-Za-z0-9._-]*)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside ``( )``."""
    terms: list[str] = []
    depth = 0
    current = ""
    for char in selector:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += char
    terms.append(current)
    return [t for t in (t.strip() for t in terms) if t]


def _term_matcher(term: str) -> Matcher:
    eq = _EQ_RE.match(term)
    if eq:
        key, op, value = eq.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    match = _SET_RE.match(term)
    if not match:
        raise bad_request(f'unable to parse requirement: invalid label selector term "{term}"')
    negate, key, op, values_text = match.groups()
    if op is None:
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    if negate:
        raise bad_request(f'unable to parse requirement: "!" cannot be combined with {op} in "{term}"')
    values = {v.strip() for v in values_text.split(",") if v.strip()}
    if op == "in":
        return lambda labels: labels.get(key) in values
    return lambda labels: labels.get(key) not in values


def parse_label_selector(selector: str | None) -> Matcher:
    """A predicate over a label map; an empty selector matches everything."""
    if not selector:
        return lambda labels: True
    matchers = [_term_matcher(term) for term in _split_terms(selector)]
    return lambda labels: all(m(labels) for m in matchers)


def matches_label_selector_object(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Evaluate a ``metav1.LabelSelector`` object (matchLabels + matchExpressions).

    As in Kubernetes, a null selector matches nothing and an empty one matches everything.
    """
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, operator, values = expr["key"], expr["operator"], set(expr.get("values") or [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and labels.get(key) in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def selector_object_to_string(selector: Mapping[str, Any]) -> str:
    """Render a LabelSelector object in query-string syntax (as ``status.selector`` shows it)."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        values = ",".join(sorted(expr.get("values") or []))
        op = expr["operator"]
        if op == "In":
            parts.append(f"{expr['key']} in ({values})")
        elif op == "NotIn":
            parts.append(f"{expr['key']} notin ({values})")
        elif op == "Exists":
            parts.append(expr["key"])
        else:
            parts.append(f"!{expr['key']}")
    return ",".join(parts)


# Selectable fields that are not plain paths, and the value an absent field selects as.
_FIELD_PATHS = {"source": "source.component"}
_FIELD_DEFAULTS = {"spec.unschedulable": "false", "spec.hostNetwork": "false"}


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    default = _FIELD_DEFAULTS.get(path, "")
    path = _FIELD_PATHS.get(path, path)
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, Mapping):
            return default
        current = current.get(part)
    if current is None:
        return default
    if isinstance(current, bool):
        return "true" if current else "false"
    return str(current)


def parse_field_selector(
    selector: str | None, supported: frozenset[str]
) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate over a whole object; unknown fields get the apiserver's 400."""
    if not selector:
        return lambda obj: True
    checks: list[tuple[str, bool, str]] = []
    for term in _split_terms(selector):
        match = re.match(r"^\s*([A-Za-z0-9.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
        if not match:
            raise bad_request(f'invalid field selector: "{term}"')
        path, op, value = match.groups()
        if path not in supported:
            raise ApiError(
                400,
                "BadRequest",
                f"field label not supported: {path} (supported: {', '.join(sorted(supported))})",
            )
        checks.append((path, op != "!=", value))
    return lambda obj: all((_field_value(obj, p) == v) == positive for p, positive, v in checks)
