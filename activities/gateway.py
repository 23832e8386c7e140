"""The gateway port: everything the runbook asks of the gateway in front of a pool.

Six questions and one action, whatever the gateway is:

* ``policy(pool)`` — the weights, admission and retry policy fleetmend last set;
* ``apply(pool, policy)`` — set the whole policy and return once the gateway runs it (raise
  ``PermanentEffectError`` with the gateway's own words when it refuses the config);
* ``applied(pool, policy)`` — the probe for an unknown outcome: is exactly this running?;
* ``routing_set(pool)`` — the engines the gateway would send a new request to, now;
* ``admitted_requests(pool)`` — a counter: requests it let past admission (first attempts, not
  retries), ever; two reads a few seconds apart are the pool's arrival rate, counted where the
  requests arrive rather than guessed from the engines' queues;
* ``request_outcomes(pool, replica, since)`` — what happened to each request (the in-flight record).

The adapter: ``activities.envoy_gateway.EnvoyGateway`` (Envoy through fleetmend's xDS control
plane), the one the dev stack, the demo, the tests, the benches and the production docs use. A new
gateway is one file that implements ``Gateway`` and a value of the ``gateway`` setting that
``activities.deps`` picks it by.
"""

from __future__ import annotations

from typing import Any, Protocol

from fleet.gateway import GatewayPolicy, JournalEntry, RoutingSet
from fleet.incident import PoolRef
from ledger.effect import ActionSignature


class Gateway(Protocol):
    def policy(self, pool: PoolRef) -> GatewayPolicy: ...

    def apply(self, pool: PoolRef, policy: GatewayPolicy) -> dict[str, Any]:
        """Make ``policy`` the pool's whole policy; return once the gateway runs it."""
        ...

    def applied(self, pool: PoolRef, policy: GatewayPolicy) -> dict[str, Any] | None: ...

    def routing_set(self, pool: PoolRef) -> RoutingSet: ...

    def admitted_requests(self, pool: PoolRef) -> int | None:
        """Requests past admission (first attempts) since the gateway started; None if it keeps no count."""
        ...

    def request_outcomes(
        self, pool: PoolRef, *, replica: str | None = None, since: float | None = None
    ) -> list[JournalEntry]: ...

    def action_signature(self, pool: PoolRef, what: str) -> ActionSignature | None:
        """How the gateway's own request log shows a change (ledger reconcile), or None if its record
        is elsewhere (Envoy: the ACK of the revision, in ``gateway_acks``)."""
        ...
