"""Alert routing rules: which Alertmanager alerts mean what to fleetmend.

Operators keep their existing alert names; a YAML file says, per alert name,
which labels name the lost entity (a node, a pod, or a pool directly), what
kind of fault it suggests and what fleetmend should do with it:

* ``start-incident`` — signal-with-start into the pool's FleetIncident;
* ``signal-open-incident`` — context for an incident that is already running
  (e.g. KV-cache saturation on the survivors); ignored when none is open.

The shipped defaults (``worker/intake/rules.yaml``) cover every alert in
``deploy/prometheus/rules.yml``. A custom file (``FLEETMEND_ALERT_RULES_FILE``)
is validated when the webhook starts; a mistake stops it with a message that
names the rule and the field, never at the first alert at 3 a.m.
"""

from __future__ import annotations

import string
from enum import StrEnum
from pathlib import Path
from typing import Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleet.incident import Severity
from fleet.vocabulary import FaultKind

SHIPPED_RULES_FILE = Path(__file__).with_name("rules.yaml")


class AlertRulesError(ValueError):
    """The routing rules file cannot be used; the message says where and how to fix it."""


class RuleAction(StrEnum):
    START_INCIDENT = "start-incident"
    SIGNAL_OPEN_INCIDENT = "signal-open-incident"


class EntityLabels(BaseModel):
    """Which alert labels name the entity the alert is about.

    Exactly one shape: ``node`` (resolved to the pods on it), ``namespace`` +
    ``pod`` (resolved to the pod's pool and replica group), or ``namespace`` +
    ``service`` (the pool itself, optionally with ``replica_group``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: str | None = None
    namespace: str | None = None
    pod: str | None = None
    service: str | None = None
    replica_group: str | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> Self:
        if self.node is not None:
            if any(v is not None for v in (self.namespace, self.pod, self.service, self.replica_group)):
                raise ValueError(
                    "'node' names the entity on its own; drop namespace/pod/service/replica_group"
                )
            return self
        if self.namespace is None:
            raise ValueError("name the entity: either 'node', or 'namespace' with 'pod' or 'service'")
        if (self.pod is None) == (self.service is None):
            raise ValueError("with 'namespace', give exactly one of 'pod' or 'service'")
        if self.pod is not None and self.replica_group is not None:
            raise ValueError("'replica_group' goes with 'service'; a pod's group is read from Kubernetes")
        return self

    @property
    def shape(self) -> Literal["node", "pod", "pool"]:
        if self.node is not None:
            return "node"
        return "pod" if self.pod is not None else "pool"

    def required_labels(self) -> list[str]:
        names = [self.node, self.namespace, self.pod, self.service]
        return [n for n in names if n is not None]


class AlertRule(BaseModel):
    """What one alert name means, and what fleetmend does when it fires or resolves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    alert: str = Field(min_length=1, max_length=200, description="The alert's `alertname` label")
    description: str = Field("", description="Why this alert matters, for the operator reading the file")
    action: RuleAction = RuleAction.START_INCIDENT
    fault: FaultKind | None = Field(None, description="Fault kind the alert suggests (triage hint)")
    fault_hint: str | None = Field(
        None,
        description="Hint template over alert labels, e.g. 'gpu-xid:{err_code}'; default: the fault kind",
    )
    severity: Severity | None = Field(None, description="Override; default: the alert's `severity` label")
    entity: EntityLabels
    match_labels: dict[str, str] = Field(
        default_factory=dict, description="Extra label values the alert must carry for this rule to apply"
    )

    @field_validator("fault_hint")
    @classmethod
    def _hint_template(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(value) if f is not None]
        except ValueError as err:
            raise ValueError(f"fault_hint {value!r} is not a valid template: {err}") from err
        for name in fields:
            if not name.isidentifier():
                raise ValueError(f"fault_hint placeholder {{{name}}} must be a plain label name")
        return value

    def applies_to(self, labels: dict[str, str]) -> bool:
        if labels.get("alertname") != self.alert:
            return False
        return all(labels.get(k) == v for k, v in self.match_labels.items())

    def hint_for(self, labels: dict[str, str]) -> str | None:
        if self.fault_hint is None:
            return self.fault.value if self.fault else None
        fields = [f for _, f, _, _ in string.Formatter().parse(self.fault_hint) if f]
        if any(not labels.get(f) for f in fields):
            return self.fault.value if self.fault else None
        return self.fault_hint.format_map(labels)


class AlertRules(BaseModel):
    """The routing table. First rule that applies to an alert wins."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = Field(description="Rules file format version (1)")
    rules: list[AlertRule] = Field(min_length=1)

    @model_validator(mode="after")
    def _no_shadowed_rules(self) -> Self:
        seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for index, rule in enumerate(self.rules):
            key = (rule.alert, tuple(sorted(rule.match_labels.items())))
            if key in seen:
                raise ValueError(
                    f"rules[{index}] ({rule.alert}) repeats an earlier rule with the same match_labels "
                    "and would never apply; merge them or add match_labels"
                )
            seen.add(key)
        return self

    def rule_for(self, labels: dict[str, str]) -> AlertRule | None:
        for rule in self.rules:
            if rule.applies_to(labels):
                return rule
        return None

    @property
    def alert_names(self) -> frozenset[str]:
        return frozenset(r.alert for r in self.rules)


def load_alert_rules(path: Path | None = None) -> AlertRules:
    """Read and validate a rules file (default: the shipped rules).

    Raises ``AlertRulesError`` naming the file, the rule and the field at fault.
    """
    source = path or SHIPPED_RULES_FILE
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as err:
        raise AlertRulesError(
            f"cannot read alert rules file {source}: {err.strerror or err}. "
            "Fix FLEETMEND_ALERT_RULES_FILE or unset it to use the shipped rules."
        ) from err
    return parse_alert_rules(text, source=str(source))


def parse_alert_rules(text: str, *, source: str = "<rules>") -> AlertRules:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise AlertRulesError(f"{source} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise AlertRulesError(f"{source} must be a mapping with 'version: 1' and a 'rules' list")
    try:
        return AlertRules.model_validate(data)
    except ValidationError as err:
        raise AlertRulesError(_explain(err, data, source)) from err


def _explain(err: ValidationError, data: dict[str, object], source: str) -> str:
    rules = data.get("rules")
    lines = [f"{source} has {err.error_count()} problem(s):"]
    for problem in err.errors():
        loc = problem["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int) and isinstance(rules, list):
            entry = rules[loc[1]] if loc[1] < len(rules) else None
            name = entry.get("alert") if isinstance(entry, dict) else None
            if name:
                where = f"{where} (rule for {name})"
        lines.append(f"  - {where}: {problem['msg']}")
    lines.append("Fix the file (format: worker/intake/rules.yaml) or unset FLEETMEND_ALERT_RULES_FILE.")
    return "\n".join(lines)
