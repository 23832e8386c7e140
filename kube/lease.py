"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's ``leaderelection`` does it.

Every worker runs an elector; one holds the Lease and runs the fast path, the
others stand by. The three durations mean what client-go's ``LeaderElectionConfig``
(k8s.io/client-go/tools/leaderelection/leaderelection.go) says they mean:

* ``lease_duration_s`` (LeaseDuration): how long a standby waits, from the moment
  it last *observed* the Lease record change, before it may force-acquire it. It
  judges by its own clock (client-go's observedTime), so clock skew between
  workers does not matter; the timestamps in the record only signal a change.
* ``renew_deadline_s`` (RenewDeadline): how long the holder keeps retrying a
  renewal before it gives up and stops leading, which must come before a standby
  may take over (renew deadline < lease duration).
* ``retry_period_s`` (RetryPeriod): the interval between tries, for the holder's
  renewals and a standby's acquisition attempts alike.

Each update names the resourceVersion it read, so two candidates racing for an
expired Lease cannot both win (the loser gets 409 Conflict). A graceful stop
releases the Lease (holder cleared, duration 1 s) so a standby takes it at once.

**Takeover bound.** A holder killed with ``kill -9`` simply stops renewing. A
standby sees its last renewal at its next try, at most one retry period after it
(tries run at a fixed rate, every retry period from the start of the previous
one), and then tries again exactly when that observation is a lease duration
old instead of waiting for its next retry tick (client-go's standby waits for its
next jittered tick, up to 1.2 retry periods later). So a standby holds the Lease
within ``lease_duration_s + retry_period_s`` of the holder's death, plus the
round trips of the read and the update that take it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fleetmend.fastpath")


def micro_time(at: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds, UTC)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        coordination: Callable[[], k8s.CoordinationV1Api],
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        retry_period_s: float = 2.0,
        request_timeout_s: float = 5.0,
    ) -> None:
        if not retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "leader election needs retry period < renew deadline < lease duration, got "
                f"{retry_period_s} / {renew_deadline_s} / {lease_duration_s}"
            )
        self._api = coordination
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._timeout = request_timeout_s
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        # When the other holder's Lease, as last observed, expires (monotonic); None: no such Lease.
        self.expires_at: float | None = None
        self.leading = False
        self.transitions_won = 0
        # Its own thread, as client-go's elector has its own goroutine: a renewal queued behind other
        # blocking work in the event loop's default executor (a burst's topology lookups) missed its
        # deadline, and the leader stepped down in the middle of the burst it was detecting.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleetmend-lease")

    # -- one attempt (synchronous: run it in a thread) ----------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """Take or renew the Lease; False when another holder's Lease is still valid or we lost a race."""
        api = self._api()
        now = time.time()
        self.expires_at = None
        lease = self._read(api)
        if lease is None:
            return self._create(api, now)
        spec, rv = lease.get("spec") or {}, (lease.get("metadata") or {}).get("resourceVersion")
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), rv)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            self.expires_at = self._observed_at + duration
            return False
        taking_over = holder != self.identity
        body = self._body(
            now,
            acquire=now if taking_over else _parse(spec.get("acquireTime"), now),
            transitions=int(spec.get("leaseTransitions") or 0) + (1 if taking_over and holder else 0),
            resource_version=rv,
        )
        try:
            response = api.replace_namespaced_lease(
                self.name, self.namespace, body, _request_timeout=self._timeout, _preload_content=False
            )
        except ApiException as err:
            if err.status == 409:  # another candidate updated it first
                return False
            raise
        updated = json.loads(response.data)  # type: ignore[attr-defined]  # _preload_content=False: the raw response
        self._observed = (
            self.identity,
            (updated.get("spec") or {}).get("renewTime"),
            (updated.get("metadata") or {}).get("resourceVersion"),
        )
        self._observed_at = time.monotonic()
        if taking_over:
            self.transitions_won += 1
            log.info(
                "fast path: leader election won",
                extra={
                    "lease": f"{self.namespace}/{self.name}",
                    "identity": self.identity,
                    "previous": holder,
                },
            )
        return True

    def _read(self, api: k8s.CoordinationV1Api) -> dict[str, Any] | None:
        try:
            response = api.read_namespaced_lease(
                self.name, self.namespace, _request_timeout=self._timeout, _preload_content=False
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return dict(json.loads(response.data))  # type: ignore[attr-defined]  # the raw response

    def _create(self, api: k8s.CoordinationV1Api, now: float) -> bool:
        body = self._body(now, acquire=now, transitions=0, resource_version=None)
        try:
            api.create_namespaced_lease(self.namespace, body, _request_timeout=self._timeout)
        except ApiException as err:
            if err.status == 409:  # created by another candidate meanwhile
                return False
            raise
        self.transitions_won += 1
        log.info(
            "fast path: lease created, leading",
            extra={"lease": f"{self.namespace}/{self.name}", "identity": self.identity},
        )
        return True

    def _body(self, now: float, *, acquire: float, transitions: int, resource_version: str | None) -> Any:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(
                    1, math.ceil(self.lease_duration_s)
                ),  # never shorter than configured
                "acquireTime": micro_time(acquire),
                "renewTime": micro_time(now),
                "leaseTransitions": transitions,
            },
        }

    def release(self) -> None:
        """Give the Lease up (holder cleared), so a standby takes over at once."""
        api = self._api()
        try:
            lease = self._read(api)
            spec = (lease or {}).get("spec") or {}
            if lease is None or (spec.get("holderIdentity") or "") != self.identity:
                return
            body = self._body(
                time.time(),
                acquire=_parse(spec.get("acquireTime"), time.time()),
                transitions=int(spec.get("leaseTransitions") or 0),
                resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
            )
            body["spec"]["holderIdentity"] = None
            body["spec"]["leaseDurationSeconds"] = 1
            api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self._timeout)
        except Exception as err:  # best effort: the Lease expires anyway
            log.warning("fast path: releasing the lease failed", extra={"error": str(err)[:200]})

    # -- the loop ------------------------------------------------------------------------------

    async def run(
        self, stop: asyncio.Event, lead: Callable[[asyncio.Event], Coroutine[Any, Any, None]]
    ) -> None:
        """Campaign until ``stop``; while leading, run ``lead(lost)``, whose event is set when leadership ends."""
        while not stop.is_set():
            tried = time.monotonic()
            if not await self._attempt():
                await _sleep_or(stop, self._until_next_try(tried))
                continue
            self.leading = True
            lost = asyncio.Event()
            task: asyncio.Task[None] = asyncio.create_task(lead(lost), name="fastpath-lead")
            last_renew = tried
            try:
                while not stop.is_set() and not task.done():
                    await _sleep_or(stop, max(0.0, tried + self.retry_period_s - time.monotonic()))
                    if stop.is_set():
                        break
                    tried = time.monotonic()
                    if await self._attempt():
                        last_renew = tried
                    elif time.monotonic() - last_renew >= self.renew_deadline_s:
                        log.warning("fast path: lease not renewed within the deadline; stepping down")
                        break
            finally:
                self.leading = False
                lost.set()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, timeout=5.0)
                if not task.done():
                    task.cancel()
        await asyncio.get_running_loop().run_in_executor(self._thread, self.release)

    def _until_next_try(self, tried: float) -> float:
        """A standby's pause: one retry period from its last try's start, or less when the Lease it
        watches expires sooner (it tries the moment it may take over, not at the next tick)."""
        wake = tried + self.retry_period_s
        if self.expires_at is not None:
            wake = min(wake, self.expires_at)
        return max(0.0, wake - time.monotonic())

    async def _attempt(self) -> bool:
        try:
            return await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(self._thread, self.try_acquire_or_renew),
                timeout=self.renew_deadline_s,
            )
        except Exception as err:
            log.warning("fast path: lease request failed", extra={"error": str(err)[:200]})
            return False


def _parse(value: Any, default: float) -> float:
    """A MicroTime string back to Unix seconds (``default`` when absent or unreadable)."""
    if not isinstance(value, str):
        return default
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return default


async def _sleep_or(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
