"""Deliver routed alerts to the pools' FleetIncident workflows.

Every firing or resolved alert becomes a ``report_loss`` signal. For
``start-incident`` rules it is a signal-with-start (``USE_EXISTING``): the
first alert starts the pool's incident, every later one — from any number of
concurrent webhook requests — lands in that same run. The workflow keeps the
fingerprints and absorbs repeats; this receiver additionally skips re-signalling
a report it delivered moments ago, so an Alertmanager retry storm does not
bloat the incident's history.

Failures the sender should retry (Temporal or Kubernetes unreachable) surface
as exceptions the HTTP layer turns into 503; nothing here is ever half-silent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError, RPCStatusCode

from fleet.incident import FLEET_INCIDENT_WORKFLOW, REPORT_LOSS_SIGNAL, LossReport
from worker.config import Settings
from worker.intake.alertmanager import AlertmanagerAlert, AlertmanagerPayload
from worker.intake.metrics import WebhookMetrics
from worker.intake.routing import AlertRouter, IgnoredAlert, IgnoreReason, RoutedReport
from worker.intake.rules import RuleAction

log = logging.getLogger("fleetmend.webhook")

TemporalClientFactory = Callable[[], Awaitable[Client]]

# Signals in flight at once for one notification: a 10,000-alert group must not open
# 10,000 concurrent RPCs to Temporal.
MAX_CONCURRENT_SIGNALS = 64
# Ignored alerts logged one by one per notification; the rest are summed up by reason.
MAX_IGNORED_LOGGED = 20


class TemporalUnavailable(Exception):
    """Temporal did not accept a signal; the notification must be retried."""


@dataclass(frozen=True)
class Delivery:
    """One loss report delivered to an incident (or recognised as already delivered)."""

    workflow_id: str
    alert_name: str
    fingerprint: str
    status: str
    replica_group: str | None
    mode: str  # "signal-with-start" | "signal" | "duplicate"
    run_id: str | None = None


@dataclass
class IntakeResult:
    delivered: list[Delivery] = field(default_factory=list)
    ignored: list[IgnoredAlert] = field(default_factory=list)

    @property
    def workflows(self) -> list[str]:
        return sorted({d.workflow_id for d in self.delivered})


class _RecentDeliveries:
    """Reports this process delivered within ``ttl_s`` (bounded LRU)."""

    def __init__(self, ttl_s: float, capacity: int = 50_000) -> None:
        self._ttl = ttl_s
        self._capacity = capacity
        self._seen: OrderedDict[tuple[object, ...], float] = OrderedDict()

    @staticmethod
    def key(routed: RoutedReport) -> tuple[object, ...]:
        r = routed.report
        return (routed.workflow_id, r.fingerprint, r.status, r.observed_at)

    def __contains__(self, key: tuple[object, ...]) -> bool:
        expires = self._seen.get(key)
        return expires is not None and expires > time.monotonic()

    def add(self, key: tuple[object, ...]) -> None:
        self._seen[key] = time.monotonic() + self._ttl
        self._seen.move_to_end(key)
        while len(self._seen) > self._capacity:
            self._seen.popitem(last=False)


class AlertIntake:
    """From a validated payload to signals into FleetIncident workflows."""

    def __init__(
        self,
        settings: Settings,
        router: AlertRouter,
        client_factory: TemporalClientFactory,
        metrics: WebhookMetrics,
        *,
        rpc_timeout_s: float = 5.0,
        dedupe_ttl_s: float = 120.0,
    ) -> None:
        self._settings = settings
        self._router = router
        self._client_factory = client_factory
        self._client: Client | None = None
        self._client_lock = asyncio.Lock()
        self._metrics = metrics
        self._rpc_timeout = timedelta(seconds=rpc_timeout_s)
        self._recent = _RecentDeliveries(dedupe_ttl_s)
        self._inflight: dict[tuple[object, ...], asyncio.Future[Delivery | None]] = {}
        self._signal_slots = asyncio.Semaphore(MAX_CONCURRENT_SIGNALS)

    async def client(self) -> Client:
        """The Temporal client, connected on first use (and again after a failed connect)."""
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._client is None:
                try:
                    self._client = await self._client_factory()
                except Exception as err:  # the SDK raises RuntimeError for connect failures
                    raise TemporalUnavailable(
                        f"cannot connect to Temporal at {self._settings.temporal_address}: {err}"
                    ) from err
            return self._client

    async def handle(self, payload: AlertmanagerPayload) -> IntakeResult:
        """Route every alert and deliver its reports. Raises ``TemporalUnavailable`` or
        ``KubernetesUnavailable`` when the notification should be retried."""
        for status, count in Counter(a.status.value for a in payload.alerts).items():
            self._metrics.alerts_received.labels(status).inc(count)
        self._metrics.notification_alerts.observe(len(payload.alerts))
        if payload.truncated_alerts:
            self._metrics.alerts_truncated.inc(payload.truncated_alerts)
            log.warning(
                "Alertmanager truncated this notification (the receiver's max_alerts): the alerts it left "
                "out never reach fleetmend while the group stays this large; raise max_alerts",
                extra={"group_key": payload.group_key, "truncated_alerts": payload.truncated_alerts},
            )
        routed = await self._router.route_all(payload.alerts)
        result = IntakeResult()
        pending: list[tuple[int, RoutedReport]] = []
        for index, outcome in enumerate(routed):
            if isinstance(outcome, IgnoredAlert):
                result.ignored.append(outcome)
            else:
                pending.extend((index, r) for r in outcome)
        outcomes = await asyncio.gather(*(self._deliver(r) for _, r in pending), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            first = failures[0]
            if isinstance(first, TemporalUnavailable):
                raise first
            raise TemporalUnavailable(f"delivering a loss report failed: {first}") from first
        by_alert: dict[int, list[Delivery | None]] = {}
        for (index, _), delivery in zip(pending, outcomes, strict=True):
            assert not isinstance(delivery, BaseException)
            by_alert.setdefault(index, []).append(delivery)
        for index, deliveries in sorted(by_alert.items()):
            self._account(payload.alerts[index], deliveries, result)
        for reason, count in Counter(i.reason.value for i in result.ignored).items():
            self._metrics.alerts_ignored.labels(reason).inc(count)
        unlogged: dict[str, int] = {}
        for index, ignored in enumerate(result.ignored):
            if index >= MAX_IGNORED_LOGGED:
                unlogged[ignored.reason.value] = unlogged.get(ignored.reason.value, 0) + 1
                continue
            log.info(
                "alert ignored",
                extra={
                    "alertname": ignored.alert_name,
                    "fingerprint": ignored.fingerprint,
                    "reason": ignored.reason.value,
                    "detail": ignored.detail,
                },
            )
        if unlogged:
            log.info(
                "more alerts ignored (not logged one by one)",
                extra={"group_key": payload.group_key, "by_reason": unlogged},
            )
        return result

    async def deliver(self, reports: list[RoutedReport]) -> list[Delivery | None]:
        """Deliver reports that come from elsewhere than an alert (the fast path), exactly as alerts' are.

        Raises ``TemporalUnavailable`` when Temporal did not take one.
        """
        return list(await asyncio.gather(*(self._deliver(r) for r in reports)))

    def _account(
        self, alert: AlertmanagerAlert, deliveries: list[Delivery | None], result: IntakeResult
    ) -> None:
        done = [d for d in deliveries if d is not None]
        rule = self._router.rules.rule_for(alert.labels)
        if done:
            result.delivered.extend(done)
            action = rule.action.value if rule else "unknown"
            self._metrics.alerts_accepted.labels(done[0].alert_name, action).inc()
            log.info(
                "alert delivered",
                extra={
                    "alertname": done[0].alert_name,
                    "fingerprint": alert.fingerprint,
                    "status": alert.status.value,
                    "workflows": sorted({d.workflow_id for d in done}),
                    "modes": sorted({d.mode for d in done}),
                },
            )
        else:
            result.ignored.append(
                IgnoredAlert(
                    alert.name,
                    alert.fingerprint,
                    IgnoreReason.NO_OPEN_INCIDENT,
                    "no incident is open for the affected pool(s); this alert only adds context to one",
                )
            )

    async def _deliver(self, routed: RoutedReport) -> Delivery | None:
        """Signal one report once: a repeat that arrives while the first delivery is in flight
        waits for it, one that arrives after it is answered from memory."""
        key = _RecentDeliveries.key(routed)
        if key in self._recent:
            self._metrics.reports_deduplicated.inc()
            return _delivery(routed, "duplicate")
        first = self._inflight.get(key)
        if first is not None:
            delivered = await asyncio.shield(first)  # the first delivery's failure fails this one too
            self._metrics.reports_deduplicated.inc()
            return None if delivered is None else _delivery(routed, "duplicate")
        future: asyncio.Future[Delivery | None] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            async with self._signal_slots:
                delivered = await self._signal(routed, key)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except Exception as err:
            future.set_exception(err)
            future.exception()  # retrieved: there may be no one waiting
            raise
        else:
            future.set_result(delivered)
            return delivered
        finally:
            del self._inflight[key]

    async def _signal(self, routed: RoutedReport, key: tuple[object, ...]) -> Delivery | None:
        """Signal (with start) one report; ``None`` when a signal-open-incident rule finds no open incident."""
        report = routed.report
        client = await self.client()
        try:
            if routed.action == RuleAction.START_INCIDENT:
                handle = await client.start_workflow(
                    FLEET_INCIDENT_WORKFLOW,
                    report.pool,
                    id=routed.workflow_id,
                    task_queue=self._settings.task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                    start_signal=REPORT_LOSS_SIGNAL,
                    start_signal_args=[report],
                    static_summary=_summary(report),
                    rpc_timeout=self._rpc_timeout,
                )
                mode, run_id = "signal-with-start", handle.first_execution_run_id
            else:
                await client.get_workflow_handle(routed.workflow_id).signal(
                    REPORT_LOSS_SIGNAL, report, rpc_timeout=self._rpc_timeout
                )
                mode, run_id = "signal", None
        except RPCError as err:
            if routed.action == RuleAction.SIGNAL_OPEN_INCIDENT and err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise TemporalUnavailable(
                f"Temporal did not accept the {REPORT_LOSS_SIGNAL} signal for {routed.workflow_id}: "
                f"{err.status.name}: {err.message}"
            ) from err
        self._recent.add(key)
        self._metrics.signals_sent.labels(mode).inc()
        return _delivery(routed, mode, run_id)


def _delivery(routed: RoutedReport, mode: str, run_id: str | None = None) -> Delivery:
    r = routed.report
    return Delivery(
        workflow_id=routed.workflow_id,
        alert_name=r.alert_name,
        fingerprint=r.fingerprint,
        status=r.status.value,
        replica_group=r.replica_group,
        mode=mode,
        run_id=run_id,
    )


def _summary(report: LossReport) -> str:
    entity = report.replica_group or report.pod or report.node or report.fingerprint
    return f"Incident on {report.pool.key}, opened by {report.alert_name} ({entity})"
