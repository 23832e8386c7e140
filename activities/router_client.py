"""The router/gateway admin API client (httpx), speaking ``fleet.protocol``.

Changes are absolute and versioned: each write names the version it replaces
and the router answers 409 when someone else changed it first. On 409 we read
the state again and re-apply the *same absolute value* — never an increment —
so a retried write cannot compound.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from fleet.incident import PoolRef
from fleet.protocol import (
    Admission,
    AdmissionChange,
    JournalEntry,
    JournalPage,
    RetryPolicy,
    RetryPolicyChange,
    RouterState,
    RoutingSet,
    WeightsChange,
)

_MAX_CONFLICT_RETRIES = 5


class RouterClient:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 5.0,
        http: httpx.Client | None = None,
        user_agent: str = "fleetmend/0.1",
    ) -> None:
        self._http = http or httpx.Client(
            base_url=base_url.rstrip("/"), timeout=timeout_s, headers={"User-Agent": user_agent}
        )

    def _pool_path(self, pool: PoolRef) -> str:
        return f"/router/v1/pools/{pool.namespace}/{pool.service}"

    def state(self, pool: PoolRef) -> RouterState:
        r = self._http.get(f"{self._pool_path(pool)}/state")
        r.raise_for_status()
        return RouterState.model_validate(r.json())

    def routing_set(self, pool: PoolRef) -> RoutingSet:
        r = self._http.get(f"{self._pool_path(pool)}/routing-set")
        r.raise_for_status()
        return RoutingSet.model_validate(r.json())

    def set_weights(self, pool: PoolRef, weights: dict[str, float]) -> RouterState:
        return self._versioned_put(
            pool,
            "weights",
            lambda v: WeightsChange(replaces_version=v, weights=weights).model_dump(mode="json"),
        )

    def set_admission(self, pool: PoolRef, admission: Admission) -> RouterState:
        return self._versioned_put(
            pool,
            "admission",
            lambda v: AdmissionChange(replaces_version=v, admission=admission).model_dump(mode="json"),
        )

    def set_retry_policy(self, pool: PoolRef, retry: RetryPolicy) -> RouterState:
        return self._versioned_put(
            pool,
            "retry-policy",
            lambda v: RetryPolicyChange(replaces_version=v, retry=retry).model_dump(mode="json"),
        )

    def _versioned_put(
        self, pool: PoolRef, what: str, body: Callable[[int], dict[str, object]]
    ) -> RouterState:
        for _ in range(_MAX_CONFLICT_RETRIES):
            current = self.state(pool)
            r = self._http.put(f"{self._pool_path(pool)}/{what}", json=body(current.version))
            if r.status_code == 409:
                continue
            r.raise_for_status()
            return RouterState.model_validate(r.json())
        raise RuntimeError(
            f"router kept answering 409 for {what} on {pool.key}: another controller is changing it; "
            "find who else writes the router's admin API"
        )

    def journal(
        self,
        pool: PoolRef,
        *,
        replica: str | None = None,
        since: float | None = None,
        until: float | None = None,
    ) -> list[JournalEntry]:
        """All journal entries matching the filters, following pagination."""
        entries: list[JournalEntry] = []
        cursor = since
        while True:
            params: dict[str, str] = {"pool": pool.key}
            if replica:
                params["replica"] = replica
            if cursor is not None:
                params["since"] = repr(cursor)
            if until is not None:
                params["until"] = repr(until)
            r = self._http.get("/router/v1/journal", params=params)
            r.raise_for_status()
            page = JournalPage.model_validate(r.json())
            entries.extend(page.entries)
            if page.next_since is None or not page.entries:
                return entries
            cursor = page.next_since
