"""Envoy's own view of every engine's health, read through each Envoy's admin API.

Envoy already checks every engine it routes to: each pool's cluster carries an active HTTP
health check on ``/health`` and outlier detection (``gateway.resources.cluster``). The fast
path reads that verdict instead of probing every engine itself, at a cost that grows with the
number of Envoys and with what changes, not with the number of engines:

* every interval, per Envoy, one ``GET /stats?format=json&filter=<regex>`` returns a handful of
  figures per cluster (Envoy's cluster statistics, ``cluster.<name>.``-rooted; see Envoy's
  "Cluster statistics" reference, configuration/upstream/cluster_manager/cluster_stats):
  ``health_check.failure`` and ``health_check.network_failure`` (counters: every failed check),
  ``outlier_detection.ejections_active`` (gauge) and ``outlier_detection.ejections_enforced_total``
  (counter), ``membership_healthy`` and ``membership_total`` (gauges). While every engine
  answers, none of them moves;
* only for an Envoy whose figures moved, one ``GET /clusters?format=json`` (Envoy's admin
  ``/clusters``, the ``envoy.admin.v3.Clusters`` message: ``cluster_statuses[].host_statuses[]``,
  each host with ``address.socket_address.{address,port_value}``, ``hostname`` and
  ``health_status``, an ``envoy.admin.v3.HostHealthStatus``) is read, and only the clusters
  whose figures moved are compared host by host with the last reading. A host is *failing* when
  its ``health_status`` says ``failed_active_health_check`` (its active health check failed it),
  ``failed_outlier_check`` (outlier detection ejected it) or an ``eds_health_status`` other than
  ``HEALTHY``; ``pending_active_hc`` (awaiting its first check) and ``pending_dynamic_removal``
  (leaving service discovery) are neither failing nor healthy.

The same ``/stats`` answer carries each cluster's ``upstream_rq_total`` and ``upstream_rq_retry``
(counters; they move with every request and never make a cluster "moved"): their difference is
the first attempts Envoy sent to the pool's engines, the arrivals admission let through.
``CounterHistory`` keeps a few seconds of those per pool, so a loss the fast path reports carries
the arrival rate from before the loss (``fleet.arrivals.arrivals_before``).

The answer is the hosts that turned healthy and the hosts that fail (``GatewayChanges``), by
address; the fast path maps an address to its pod through the pods informer's index. Field
names as in Envoy's ``api/envoy/admin/v3/clusters.proto`` and as Envoy 1.40 prints them
(``/clusters?format=json`` omits false flags: a healthy host shows only
``{"eds_health_status": "HEALTHY"}``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from fleet.arrivals import PRE_LOSS_GAP_S, PRE_LOSS_STALE_S, PRE_LOSS_WINDOW_S, CounterReading

log = logging.getLogger("fleetmend.fastpath")

# The per-cluster figures that move when a host's health changes (Envoy's cluster statistics).
FIGURES = (
    "health_check.failure",
    "health_check.network_failure",
    "outlier_detection.ejections_active",
    "outlier_detection.ejections_enforced_total",
    "membership_healthy",
    "membership_total",
)
# Read in the same answer, never part of a cluster's health figures: first attempts = total - retry.
TRAFFIC = ("upstream_rq_total", "upstream_rq_retry")
STATS_FILTER = (
    r"^cluster\..+\.(health_check\.(failure|network_failure)"
    r"|outlier_detection\.(ejections_active|ejections_enforced_total)"
    r"|membership_(healthy|total)"
    r"|upstream_rq_(total|retry))$"
)
# HostHealthStatus flags that take a host out of rotation for its health.
FAILED_FLAGS = ("failed_active_health_check", "failed_outlier_check")
# Flags under which the host is neither failing nor healthy yet (or any more).
PENDING_FLAGS = ("pending_active_hc", "pending_dynamic_removal")


@dataclass(frozen=True)
class HostHealth:
    """One engine as one Envoy sees it."""

    admin: str
    cluster: str
    address: str
    port: int
    hostname: str
    failed: tuple[str, ...] = ()
    pending: bool = False

    @property
    def healthy(self) -> bool:
        return not self.failed and not self.pending

    def describe(self) -> str:
        why = ", ".join(self.failed) if self.failed else "health check passes"
        return f"Envoy {self.admin} cluster {self.cluster} host {self.address}:{self.port}: {why}"


@dataclass
class GatewayChanges:
    """What moved since the last reading: hosts that turned healthy (or were first seen healthy),
    and every failing host of the clusters re-read (``new``: not failing at the last reading)."""

    healthy: list[HostHealth] = field(default_factory=list)
    failing: list[tuple[HostHealth, bool]] = field(default_factory=list)

    def extend(self, other: GatewayChanges) -> None:
        self.healthy.extend(other.healthy)
        self.failing.extend(other.failing)


def cluster_figures(stats: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """``{cluster: figures}`` from a ``/stats?format=json`` answer filtered by ``STATS_FILTER``."""
    values: dict[str, dict[str, int]] = {}
    for stat in stats.get("stats") or []:
        name = str(stat.get("name") or "")
        if not name.startswith("cluster.") or "value" not in stat:
            continue
        for figure in FIGURES:
            if name.endswith(f".{figure}"):
                cluster = name[len("cluster.") : -len(figure) - 1]
                values.setdefault(cluster, {})[figure] = int(stat.get("value") or 0)
                break
    return {c: tuple(v.get(f, 0) for f in FIGURES) for c, v in values.items()}


def cluster_first_attempts(stats: dict[str, Any]) -> dict[str, int]:
    """``{cluster: upstream_rq_total - upstream_rq_retry}`` from the same ``/stats`` answer."""
    values: dict[str, dict[str, int]] = {}
    for stat in stats.get("stats") or []:
        name = str(stat.get("name") or "")
        for figure in TRAFFIC:
            if name.startswith("cluster.") and name.endswith(f".{figure}") and "value" in stat:
                values.setdefault(name[len("cluster.") : -len(figure) - 1], {})[figure] = int(
                    stat["value"] or 0
                )
    return {c: v.get(TRAFFIC[0], 0) - v.get(TRAFFIC[1], 0) for c, v in values.items()}


class CounterHistory:
    """Each pool's first-attempts counter, summed over every Envoy, for the last ``keep_s`` seconds:
    about one reading per ``every_s`` per pool (a few dozen numbers per pool, whatever its size).
    A pool whose cluster is gone is forgotten. The sum is over one set of Envoys: when the set
    changes (one joined, with its own lifetime count, or left), every pool's history starts anew."""

    def __init__(
        self,
        keep_s: float = PRE_LOSS_WINDOW_S + PRE_LOSS_GAP_S + PRE_LOSS_STALE_S + 2.0,
        every_s: float = 1.0,
    ) -> None:
        self._keep_s, self._every_s = keep_s, every_s
        self._readings: dict[str, deque[CounterReading]] = {}
        self._envoys: frozenset[str] = frozenset()

    def record(self, at: float, totals: dict[str, int], envoys: frozenset[str] = frozenset()) -> None:
        """One reading of every pool's sum over ``envoys`` (the admin addresses read) at ``at``."""
        if envoys != self._envoys:
            self._readings.clear()
            self._envoys = envoys
        for gone in set(self._readings) - set(totals):
            del self._readings[gone]
        for cluster, total in totals.items():
            readings = self._readings.setdefault(cluster, deque())
            # 0.9: a reading every second even when the poll's own interval jitters around a divisor.
            if readings and at - readings[-1].at < 0.9 * self._every_s:
                continue
            readings.append(CounterReading(at=at, total=max(0, total)))
            while readings and at - readings[0].at > self._keep_s:
                readings.popleft()

    def readings(self, cluster: str) -> list[CounterReading]:
        """Oldest first."""
        return list(self._readings.get(cluster, ()))


def host_health(admin: str, cluster: str, host: dict[str, Any]) -> HostHealth | None:
    """One ``host_statuses[]`` entry of ``/clusters?format=json``; None without a socket address."""
    sock = (host.get("address") or {}).get("socket_address") or {}
    address = sock.get("address")
    if not address:
        return None
    status = host.get("health_status") or {}
    failed = [flag for flag in FAILED_FLAGS if status.get(flag)]
    eds = status.get("eds_health_status")
    if eds not in (None, "HEALTHY"):
        failed.append(f"eds_health_status={eds}")
    return HostHealth(
        admin=admin,
        cluster=cluster,
        address=str(address),
        port=int(sock.get("port_value") or 0),
        hostname=str(host.get("hostname") or ""),
        failed=tuple(failed),
        pending=any(status.get(flag) for flag in PENDING_FLAGS),
    )


class EnvoyHealthView:
    """Reads every Envoy's health figures each ``poll``; the hosts only where they moved."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        admin_urls: Callable[[], Awaitable[list[str]]],
        *,
        timeout_s: float = 2.0,
    ) -> None:
        self._http = http
        self._admin_urls = admin_urls
        self._timeout = timeout_s
        self._figures: dict[str, dict[str, tuple[int, ...]]] = {}  # admin -> cluster -> figures
        # (admin, cluster) -> (address, port) -> host
        self._hosts: dict[tuple[str, str], dict[tuple[str, int], HostHealth]] = {}
        self._failing_admins: set[str] = set()
        # cluster -> first attempts summed over every Envoy, at the last reading every Envoy answered;
        # which Envoys, and when the last of their /stats answers came (unix seconds)
        self.first_attempts: dict[str, int] | None = None
        self.first_attempts_from: frozenset[str] = frozenset()
        self.first_attempts_at = 0.0
        self._attempts: dict[str, dict[str, int]] = {}  # admin -> cluster -> first attempts
        self._attempts_at: dict[str, float] = {}
        self.stats_reads = 0
        self.clusters_reads = 0

    async def poll(self) -> GatewayChanges:
        """One reading of every Envoy (concurrently); an Envoy that does not answer is skipped and
        read in full once it answers again."""
        admins = await self._admin_urls()
        for gone in set(self._figures) - set(admins):
            self._forget(gone)
        results = await asyncio.gather(*(self._poll_one(a) for a in admins), return_exceptions=True)
        changes = GatewayChanges()
        if all(not isinstance(result, BaseException) for result in results):
            totals: dict[str, int] = {}
            for admin in admins:
                for cluster, n in self._attempts.get(admin, {}).items():
                    totals[cluster] = totals.get(cluster, 0) + n
            self.first_attempts = totals
            self.first_attempts_from = frozenset(admins)
            self.first_attempts_at = max((self._attempts_at.get(a, 0.0) for a in admins), default=time.time())
        else:  # a sum missing an Envoy would read as a counter that went backwards
            self.first_attempts = None
        for admin, result in zip(admins, results, strict=True):
            if isinstance(result, BaseException):
                if isinstance(result, asyncio.CancelledError):
                    raise result
                if admin not in self._failing_admins:
                    log.warning(
                        "fast path: cannot read Envoy's health view",
                        extra={"admin": admin, "error": f"{type(result).__name__}: {str(result)[:200]}"},
                    )
                self._failing_admins.add(admin)
                self._forget(admin)
                continue
            if admin in self._failing_admins:
                self._failing_admins.discard(admin)
                log.info("fast path: Envoy's health view readable again", extra={"admin": admin})
            changes.extend(result)
        return changes

    def _forget(self, admin: str) -> None:
        self._figures.pop(admin, None)
        self._attempts.pop(admin, None)
        self._attempts_at.pop(admin, None)
        for key in [k for k in self._hosts if k[0] == admin]:
            del self._hosts[key]

    async def _poll_one(self, admin: str) -> GatewayChanges:
        r = await self._http.get(
            f"{admin}/stats", params={"format": "json", "filter": STATS_FILTER}, timeout=self._timeout
        )
        r.raise_for_status()
        self.stats_reads += 1
        answer = r.json()
        self._attempts[admin], self._attempts_at[admin] = cluster_first_attempts(answer), time.time()
        figures = cluster_figures(answer)
        before = self._figures.get(admin, {})
        moved = {c for c, f in figures.items() if before.get(c) != f}
        for cluster in set(before) - set(figures):  # the cluster is gone: so are its hosts
            self._hosts.pop((admin, cluster), None)
        if not moved:
            self._figures[admin] = figures
            return GatewayChanges()
        r = await self._http.get(f"{admin}/clusters", params={"format": "json"}, timeout=self._timeout)
        r.raise_for_status()
        self.clusters_reads += 1
        changes = GatewayChanges()
        for status in r.json().get("cluster_statuses") or []:
            cluster = str(status.get("name") or "")
            if cluster in moved:
                changes.extend(self._compare(admin, cluster, status.get("host_statuses") or []))
        # Stored only once the hosts were read: a failed /clusters read leaves them "moved".
        self._figures[admin] = figures
        return changes

    def _compare(self, admin: str, cluster: str, hosts: list[dict[str, Any]]) -> GatewayChanges:
        before = self._hosts.get((admin, cluster), {})
        now: dict[tuple[str, int], HostHealth] = {}
        changes = GatewayChanges()
        for raw in hosts:
            host = host_health(admin, cluster, raw)
            if host is None:
                continue
            where = (host.address, host.port)
            now[where] = host
            was = before.get(where)
            if host.failed:
                changes.failing.append((host, was is None or not was.failed))
            elif host.healthy and (was is None or not was.healthy):
                changes.healthy.append(host)
        self._hosts[(admin, cluster)] = now
        return changes
