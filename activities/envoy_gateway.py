"""The gateway port on Envoy: policies through fleetmend's xDS control plane, facts from Envoy itself.

* **Set** a pool's policy: write it to ``gateway_policies`` (``gateway.store``); the control plane
  renders it (``gateway.resources``) and pushes it over ADS to every Envoy.
* **Applied?** Every Envoy connected to the control plane has ACKed a version carrying that
  policy's revision, for clusters, endpoints and routes. A NACK is a refusal: the previous policy
  is put back (so the next snapshot is one Envoy accepts) and the effect fails with Envoy's text;
  nothing is retried blindly. No Envoy connected, or no answer yet: the outcome is unknown, and
  the ledger's probe asks again later.
* **Routing set**: Envoy's admin ``/clusters`` — the hosts each Envoy has for the pool's cluster,
  minus those its active health check or outlier detection took out of rotation (the data plane
  reacts before any alert).
* **Admitted requests**: Envoy's own counters from admin ``/stats``, summed over the Envoys:
  ``cluster.<pool>.upstream_rq_total`` minus ``upstream_rq_retry`` (first attempts sent to an engine).
* **Request outcomes**: what every Envoy reported through its access-log service to the control
  plane, which names the engine that served each request (``gateway.outcomes``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from typing import Any

import httpx

from fleet.gateway import GatewayPolicy, JournalEntry, RoutedEndpoint, RoutingSet
from fleet.incident import PoolRef
from gateway.resources import CLUSTER_TYPE, ENDPOINT_TYPE, ROUTE_TYPE, WEIGHT_SCALE
from gateway.store import EnvoyAnswer, GatewayStore, envoy_admin_urls, revision_of
from ledger.effect import ActionSignature
from ledger.errors import PermanentEffectError

APPLIED_TYPES = (CLUSTER_TYPE, ENDPOINT_TYPE, ROUTE_TYPE)


class GatewayNotApplied(RuntimeError):
    """The policy is stored but not every Envoy runs it yet: the outcome is unknown (retry, probe)."""


def pending_envoys(answers: Sequence[EnvoyAnswer], revision: int) -> tuple[list[str], list[str]]:
    """(Envoys that have not ACKed ``revision`` yet, "node type: error" for each NACK of it or later)."""
    connected = {a.node_id for a in answers if a.connected}
    waiting: set[str] = set()
    refused: list[str] = []
    for node in sorted(connected):
        mine = {a.type_url: a for a in answers if a.node_id == node}
        for type_url in APPLIED_TYPES:
            answer = mine.get(type_url)
            if answer is not None and revision_of(answer.nacked_version) >= revision:
                refused.append(f"{node} {type_url.rsplit('.', 1)[-1]}: {answer.error}")
            elif answer is None or revision_of(answer.acked_version) < revision:
                waiting.add(node)
    return sorted(waiting), refused


class EnvoyGateway:
    def __init__(
        self,
        store: GatewayStore,
        admin_urls: Sequence[str] = (),
        *,
        http: httpx.Client | None = None,
        apply_timeout_s: float = 5.0,
    ) -> None:
        self.store = store
        self.admin_urls = [u.rstrip("/") for u in admin_urls]
        self.http = http or httpx.Client(timeout=httpx.Timeout(3.0, connect=1.0))
        self.apply_timeout_s = apply_timeout_s

    # ---------------------------------------------------------------- policy
    def policy(self, pool: PoolRef) -> GatewayPolicy:
        stored = self.store.get(pool.key)
        return stored.policy if stored is not None else GatewayPolicy()

    def apply(self, pool: PoolRef, policy: GatewayPolicy) -> dict[str, Any]:
        # The whole policy is one revision, and its record is the Envoys' ACK of it.
        previous = self.store.get(pool.key)
        revision = self.store.put(pool.key, policy)
        deadline = time.monotonic() + self.apply_timeout_s
        while True:
            waiting, refused = pending_envoys(self.store.answers(), revision)
            if refused:
                restored = self.store.put(pool.key, previous.policy if previous else GatewayPolicy())
                raise PermanentEffectError(
                    f"Envoy refused the config for {pool.key} (revision {revision}): {'; '.join(refused)}; "
                    f"fleetmend put the previous policy back (revision {restored}){self._settle(restored)}"
                )
            connected = any(a.connected for a in self.store.answers())
            if connected and not waiting:
                return {"revision": revision, "policy": policy.model_dump(mode="json")}
            if time.monotonic() > deadline:
                who = ", ".join(waiting) if connected else "no Envoy is connected to the control plane"
                raise GatewayNotApplied(
                    f"policy revision {revision} for {pool.key} not yet running everywhere ({who}) after "
                    f"{self.apply_timeout_s:.0f} s: check `fleetmend gateway serve` and the Envoys' logs"
                )
            time.sleep(0.05)

    def _settle(self, restored: int) -> str:
        """Wait (up to ``apply_timeout_s``) until every connected Envoy has answered the put-back.

        Envoy refuses per resource type: a change whose clusters it NACKs may still have had its
        endpoints (the weights) ACKed, so for a moment Envoy runs part of the refused change. The
        put-back undoes that part; the refusal is reported once it has (or says who has not yet).
        """
        deadline = time.monotonic() + self.apply_timeout_s
        while True:
            waiting, _ = pending_envoys(self.store.answers(), restored)
            if not waiting:
                return ""
            if time.monotonic() > deadline:
                return f"; not yet answered by {', '.join(waiting)}"
            time.sleep(0.05)

    def applied(self, pool: PoolRef, policy: GatewayPolicy) -> dict[str, Any] | None:
        stored = self.store.get(pool.key)
        if stored is None or stored.policy != policy:
            return None
        answers = self.store.answers()
        waiting, refused = pending_envoys(answers, stored.revision)
        if refused or waiting or not any(a.connected for a in answers):
            return None
        return {"revision": stored.revision, "policy": policy.model_dump(mode="json")}

    def action_signature(self, pool: PoolRef, what: str) -> ActionSignature | None:
        # Envoy's record of a change is its ACK in gateway_acks, not a request log reconcile reads.
        return None

    def _admins(self) -> list[str]:
        """The configured admin URLs, else those of every Envoy connected to the control plane."""
        found = envoy_admin_urls(self.admin_urls, self.store)
        if not found:
            raise GatewayNotApplied(
                "no Envoy is connected to the control plane (gateway_acks): cannot read the routing set; "
                "check `fleetmend gateway serve` and the Envoys, or set FLEETMEND_GATEWAY_ADMIN_URLS"
            )
        return found

    # ------------------------------------------------------------ routing set
    def routing_set(self, pool: PoolRef) -> RoutingSet:
        """Hosts any Envoy would send a new request to (union: a pod routed anywhere is still routed)."""
        routed: dict[str, RoutedEndpoint] = {}
        for admin in self._admins():
            r = self.http.get(f"{admin}/clusters", params={"format": "json"})
            r.raise_for_status()
            for status in r.json().get("cluster_statuses", []):
                if status.get("name") != pool.key:
                    continue
                for host in status.get("host_statuses", []):
                    health = host.get("health_status") or {}
                    if any(
                        health.get(flag)
                        for flag in (
                            "failed_active_health_check",
                            "failed_outlier_check",
                            "pending_dynamic_removal",
                        )
                    ) or health.get("eds_health_status") not in (None, "HEALTHY"):
                        continue
                    sock = (host.get("address") or {}).get("socket_address") or {}
                    name = host.get("hostname") or sock.get("address", "")
                    routed[name] = RoutedEndpoint(
                        pod=name,
                        address=f"{sock.get('address', '')}:{sock.get('port_value', '')}",
                        weight=float(host.get("weight", WEIGHT_SCALE)) / WEIGHT_SCALE,
                    )
        return RoutingSet(pool=pool.key, version=0, endpoints=sorted(routed.values(), key=lambda e: e.pod))

    # ------------------------------------------------------ admitted requests
    def admitted_requests(self, pool: PoolRef) -> int | None:
        """First attempts every Envoy sent to the pool's engines, ever (its cluster's counters)."""
        prefix = f"cluster.{pool.key}."
        total = 0
        for admin in self._admins():
            r = self.http.get(
                f"{admin}/stats",
                params={"format": "json", "filter": f"^{re.escape(prefix)}upstream_rq_(total|retry)$"},
            )
            r.raise_for_status()
            stats = {s.get("name"): int(s.get("value") or 0) for s in r.json().get("stats", [])}
            total += stats.get(f"{prefix}upstream_rq_total", 0) - stats.get(f"{prefix}upstream_rq_retry", 0)
        return total

    # -------------------------------------------------------- request outcomes
    def request_outcomes(
        self, pool: PoolRef, *, replica: str | None = None, since: float | None = None
    ) -> list[JournalEntry]:
        """What Envoy reported for each finished request (its access-log service, gateway.outcomes)."""
        return self.store.requests(pool.key, replica=replica, since=since)
