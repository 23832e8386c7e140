"""Prometheus metrics of the alert intake, served on the webhook's ``/metrics``.

The intake counts alerts and signals; the webhook app adds its request counts to the
same registry. The fast path's intake keeps its own instance.

Each app gets its own registry so several receivers (tests, benchmarks) in one
process never share counts. Label values are bounded: reasons are enums and
alert names are only those of the routing rules.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_rejected = Counter(
            "fleetmend_webhook_requests_rejected",
            "Webhook requests refused before any alert was acted on, by reason",
            ["reason"],
            registry=r,
        )
        self.alerts_received = Counter(
            "fleetmend_alerts_received", "Alerts in authenticated, valid payloads", ["status"], registry=r
        )
        self.alerts_accepted = Counter(
            "fleetmend_alerts_accepted",
            "Alerts delivered to (or absorbed by) a pool's incident, by routing rule",
            ["alertname", "action"],
            registry=r,
        )
        self.alerts_ignored = Counter(
            "fleetmend_alerts_ignored", "Alerts fleetmend does not act on, by reason", ["reason"], registry=r
        )
        self.reports_deduplicated = Counter(
            "fleetmend_loss_reports_deduplicated",
            "Loss reports not signalled again because this receiver delivered the same one recently",
            registry=r,
        )
        self.signals_sent = Counter(
            "fleetmend_incident_signals_sent",
            "report_loss signals delivered to FleetIncident workflows",
            ["mode"],
            registry=r,
        )
        self.notification_alerts = Histogram(
            "fleetmend_webhook_notification_alerts",
            "Alerts per valid notification (the size of Alertmanager's groups)",
            buckets=(1, 10, 100, 1000, 2000, 5000, 10_000, 20_000),
            registry=r,
        )
        self.alerts_truncated = Counter(
            "fleetmend_webhook_alerts_truncated",
            "Alerts Alertmanager left out of notifications (truncatedAlerts, its max_alerts)",
            registry=r,
        )
        self.request_seconds = Histogram(
            "fleetmend_webhook_request_duration_seconds",
            "Time to answer an alert notification",
            ["code"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
