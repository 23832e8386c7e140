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

Adapters: ``activities.envoy_gateway.EnvoyGateway`` (Envoy through fleetmend's xDS control plane,
the one the dev stack, the demo and the production docs use) and ``SimRouterGateway`` below (the
simulator's own router, kept while its last users move to Envoy). A new gateway is one file that
implements ``Gateway``; ``activities.deps`` picks it from the ``gateway`` setting.
"""

from __future__ import annotations

from typing import Any, Protocol
from urllib.parse import urlsplit

from activities.router_client import RouterClient
from fleet.incident import PoolRef
from fleet.protocol import GatewayPolicy, JournalEntry, RoutingSet
from ledger.effect import ActionSignature


class Gateway(Protocol):
    def policy(self, pool: PoolRef) -> GatewayPolicy: ...

    def apply(self, pool: PoolRef, policy: GatewayPolicy, *, part: str | None = None) -> dict[str, Any]:
        """Make ``policy`` the pool's whole policy. ``part`` names the piece this change is about
        (``weights``, ``admission``, ``retry-policy``): a gateway whose record of changes is per
        piece (the sim router's request log) writes that piece even when it already holds the value,
        so every applied ledger row has its action in the world's record."""
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
        """How the gateway's own record shows a change (ledger reconcile), or None if it keeps none."""
        ...


class SimRouterGateway:
    """The simulator's router through its admin API (``activities.router_client``)."""

    def __init__(self, router: RouterClient, base_url: str) -> None:
        self.router = router
        self.world = urlsplit(base_url).netloc

    def action_signature(self, pool: PoolRef, what: str) -> ActionSignature | None:
        # The body names the router version it replaces, known only at apply time: match on verb + path.
        return ActionSignature(
            world=self.world, verb="PUT", path=f"/router/v1/pools/{pool.namespace}/{pool.service}/{what}",
            body_digest="*",
        )  # fmt: skip

    def policy(self, pool: PoolRef) -> GatewayPolicy:
        state = self.router.state(pool)
        return GatewayPolicy(weights=state.weights, admission=state.admission, retry=state.retry)

    def apply(self, pool: PoolRef, policy: GatewayPolicy, *, part: str | None = None) -> dict[str, Any]:
        current = self.policy(pool)
        state = self.router.state(pool)
        if policy.weights != current.weights or part == "weights":
            state = self.router.set_weights(pool, policy.weights)
        if policy.admission != current.admission or part == "admission":
            state = self.router.set_admission(pool, policy.admission)
        if policy.retry != current.retry or part == "retry-policy":
            state = self.router.set_retry_policy(pool, policy.retry)
        return {"version": state.version, "policy": policy.model_dump(mode="json")}

    def applied(self, pool: PoolRef, policy: GatewayPolicy) -> dict[str, Any] | None:
        state = self.router.state(pool)
        if GatewayPolicy(weights=state.weights, admission=state.admission, retry=state.retry) == policy:
            return {"version": state.version, "policy": policy.model_dump(mode="json")}
        return None

    def routing_set(self, pool: PoolRef) -> RoutingSet:
        return self.router.routing_set(pool)

    def admitted_requests(self, pool: PoolRef) -> int | None:
        return self.router.state(pool).admitted_requests_total

    def request_outcomes(
        self, pool: PoolRef, *, replica: str | None = None, since: float | None = None
    ) -> list[JournalEntry]:
        return self.router.journal(pool, replica=replica, since=since)
