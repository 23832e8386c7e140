"""Turn one Alertmanager alert into loss reports for the pools it concerns.

The routing rules say what the alert means and which labels name the entity;
the pool topology (Kubernetes API) says which pools and replica groups that
entity belongs to. Every alert ends up either as loss reports (one per affected
replica group, each addressed to its pool's FleetIncident) or as *ignored*
with a reason an operator can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import ValidationError

from fleet.incident import LossReport, PoolRef, Severity, incident_workflow_id
from worker.intake.alertmanager import AlertmanagerAlert
from worker.intake.rules import AlertRule, AlertRules, RuleAction
from worker.intake.topology import (
    AffectedGroup,
    PoolTopology,
    TopologyAnswers,
    is_namespace_name,
    is_object_name,
)

# Labels copied into a LossReport are bounded: they end up in workflow history.
_MAX_REPORT_LABELS = 64
_MAX_LABEL_VALUE = 512


class IgnoreReason(StrEnum):
    NO_RULE = "no-rule"
    LABELS_MISSING = "labels-missing"
    INVALID_ENTITY = "invalid-entity"
    NOT_FOUND = "not-found"
    NOT_SERVING = "not-serving"
    NO_OPEN_INCIDENT = "no-open-incident"


@dataclass(frozen=True)
class RoutedReport:
    """A loss report and the incident it goes to."""

    workflow_id: str
    action: RuleAction
    report: LossReport


@dataclass(frozen=True)
class IgnoredAlert:
    alert_name: str
    fingerprint: str
    reason: IgnoreReason
    detail: str


@dataclass(frozen=True)
class _Lookup:
    """An alert whose node or pod must be resolved through the Kubernetes API."""

    rule: AlertRule
    node: str | None = None
    pod: tuple[str, str] | None = None


class AlertRouter:
    """Applies the routing rules to alerts, resolving entities through the pool topology."""

    def __init__(self, rules: AlertRules, topology: PoolTopology) -> None:
        self.rules = rules
        self._topology = topology

    async def route(self, alert: AlertmanagerAlert) -> list[RoutedReport] | IgnoredAlert:
        """Reports for every affected replica group, or why the alert is ignored."""
        return (await self.route_all([alert]))[0]

    async def route_all(self, alerts: list[AlertmanagerAlert]) -> list[list[RoutedReport] | IgnoredAlert]:
        """``route`` for every alert of a notification, in order, resolving all their nodes and pods
        with one topology lookup (batched for large groups).

        Raises ``KubernetesUnavailable`` when the entities cannot be resolved right now.
        """
        planned = [self._plan(alert) for alert in alerts]
        nodes = [p.node for p in planned if isinstance(p, _Lookup) and p.node is not None]
        pods = [p.pod for p in planned if isinstance(p, _Lookup) and p.pod is not None]
        answers = await self._topology.resolve(nodes, pods) if nodes or pods else TopologyAnswers()
        return [
            self._finish(alert, plan, answers) if isinstance(plan, _Lookup) else plan
            for alert, plan in zip(alerts, planned, strict=True)
        ]

    def _plan(self, alert: AlertmanagerAlert) -> list[RoutedReport] | IgnoredAlert | _Lookup:
        """Everything that needs no Kubernetes API: the rule, its labels, the entity's name."""
        rule = self.rules.rule_for(alert.labels)
        if rule is None:
            return self._ignored(alert, IgnoreReason.NO_RULE, "no routing rule for this alert name")
        missing = [name for name in rule.entity.required_labels() if not alert.labels.get(name)]
        if missing:
            return self._ignored(
                alert,
                IgnoreReason.LABELS_MISSING,
                f"rule {rule.alert} needs label(s) {', '.join(missing)} to name the {rule.entity.shape}",
            )
        shape = rule.entity.shape
        if shape == "pool":
            return self._pool_report(rule, alert)
        if shape == "node":
            node = alert.labels[rule.entity.node or ""]
            if not is_object_name(node):
                return self._ignored(
                    alert, IgnoreReason.INVALID_ENTITY, f"{node!r} is not a Kubernetes node name"
                )
            return _Lookup(rule, node=node)
        namespace = alert.labels[rule.entity.namespace or ""]
        pod = alert.labels[rule.entity.pod or ""]
        if not (is_namespace_name(namespace) and is_object_name(pod)):
            return self._ignored(
                alert, IgnoreReason.INVALID_ENTITY, f"{namespace!r}/{pod!r} is not a Kubernetes pod name"
            )
        return _Lookup(rule, pod=(namespace, pod))

    def _finish(
        self, alert: AlertmanagerAlert, plan: _Lookup, answers: TopologyAnswers
    ) -> list[RoutedReport] | IgnoredAlert:
        if plan.node is not None:
            groups = answers.nodes[plan.node]
            where = f"node {plan.node}"
        else:
            assert plan.pod is not None
            namespace, pod = plan.pod
            found = answers.pods[plan.pod]
            if found is None:
                return self._ignored(alert, IgnoreReason.NOT_FOUND, f"pod {namespace}/{pod} not found")
            groups, where = found, f"pod {namespace}/{pod}"
        if not groups:
            return self._ignored(alert, IgnoreReason.NOT_SERVING, f"no serving pool has a pod on {where}")
        return self._group_reports(plan.rule, alert, groups, alerted_pod=plan.pod is not None)

    def _pool_report(self, rule: AlertRule, alert: AlertmanagerAlert) -> list[RoutedReport] | IgnoredAlert:
        namespace = alert.labels[rule.entity.namespace or ""]
        service = alert.labels[rule.entity.service or ""]
        try:
            pool = PoolRef(namespace=namespace, service=service)
        except ValidationError:
            return self._ignored(
                alert,
                IgnoreReason.INVALID_ENTITY,
                f"{namespace!r}/{service!r} is not a Kubernetes Service name",
            )
        group = alert.labels.get(rule.entity.replica_group) if rule.entity.replica_group else None
        node = alert.labels.get("node") or None
        pod = alert.labels.get("pod") or None
        report = self._report(rule, alert, pool, alert.fingerprint, node=node, pod=pod, group=group or None)
        return [RoutedReport(incident_workflow_id(pool), rule.action, report)]

    def _group_reports(
        self, rule: AlertRule, alert: AlertmanagerAlert, groups: list[AffectedGroup], *, alerted_pod: bool
    ) -> list[RoutedReport]:
        per_pool: dict[PoolRef, int] = {}
        for g in groups:
            per_pool[g.pool] = per_pool.get(g.pool, 0) + 1
        routed = []
        for g in groups:
            # The workflow absorbs repeats by fingerprint: one alert covering several groups of
            # the same pool yields one fingerprint per group, stable across re-deliveries.
            fingerprint = (
                alert.fingerprint if per_pool[g.pool] == 1 else f"{alert.fingerprint}/{g.replica_group}"
            )
            if alerted_pod:
                pod: str | None = alert.labels[rule.entity.pod or ""]
            else:
                pod = g.pods[0] if len(g.pods) == 1 else None
            node = g.nodes[0] if len(g.nodes) == 1 else None
            report = self._report(rule, alert, g.pool, fingerprint, node=node, pod=pod, group=g.replica_group)
            routed.append(RoutedReport(incident_workflow_id(g.pool), rule.action, report))
        return routed

    @staticmethod
    def _report(
        rule: AlertRule,
        alert: AlertmanagerAlert,
        pool: PoolRef,
        fingerprint: str,
        *,
        node: str | None,
        pod: str | None,
        group: str | None,
    ) -> LossReport:
        return LossReport(
            pool=pool,
            fingerprint=fingerprint,
            alert_name=rule.alert,
            status=alert.status,
            severity=rule.severity or _severity(alert.labels.get("severity")),
            node=node,
            pod=pod,
            replica_group=group,
            fault_hint=rule.hint_for(alert.labels),
            observed_at=alert.starts_at.timestamp(),
            source="alertmanager",
            labels={k: v[:_MAX_LABEL_VALUE] for k, v in sorted(alert.labels.items())[:_MAX_REPORT_LABELS]},
        )

    @staticmethod
    def _ignored(alert: AlertmanagerAlert, reason: IgnoreReason, detail: str) -> IgnoredAlert:
        return IgnoredAlert(alert.name or "(no alertname)", alert.fingerprint, reason, detail)


def _severity(label: str | None) -> Severity:
    try:
        return Severity(label) if label else Severity.CRITICAL
    except ValueError:
        return Severity.CRITICAL
