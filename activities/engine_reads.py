"""Reading engines' ``/health`` and ``/metrics`` in a slow world: several at once, within the look's time.

A look at a pool reads one engine per replica group. Against a saturated world an engine
may take seconds to answer; read one after another, a few slow ones would spend the whole
activity's time and fail a look whose Kubernetes half had been read. So a look reads its
engines ``concurrency`` at a time and stops waiting at ``deadline`` (a share of the
activity's start-to-close): what answered is used, what did not is *unread*, with the
reason, and the look still returns.

How an engine's silence is classified (``EngineRead``):

* connection refused, or no connection within the connect timeout: ``UNREACHABLE`` - what a
  dead process or a dead machine leaves (loss evidence, ``fleet.loss``);
* connected, but no answer within the read timeout (or no connection slot free in our own
  pool, or the look's time spent before its turn): *unread* - slow, not dead. Its health
  stays ``UNKNOWN`` and the deciders count it neither idle nor dead
  (``fleet.observation.judge_partial_look``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import httpx
from temporalio import activity

from fleet.engine_metrics import EngineSnapshot, parse_engine_metrics
from fleet.observation import EngineHealth

K = TypeVar("K", bound=Hashable)

# Of one attempt's start-to-close, the share after which a look stops waiting for engines (counted
# from the attempt's start: the Kubernetes and gateway reads before them are in it; the rest of the
# attempt is margin for a last read's HTTP timeout and for returning the result).
ENGINE_SHARE_OF_ATTEMPT = 0.6
# Outside an activity (a direct call), the time a look gives its engines.
DEFAULT_ENGINE_WAIT_S = 15.0


@dataclass(frozen=True)
class EngineRead:
    """One engine's answers: its health, its scrape (when it answered), or why it was not read."""

    health: EngineHealth
    snapshot: EngineSnapshot | None = None
    unread: str | None = None


def _timeout_s(http: httpx.Client, kind: str) -> str:
    value = getattr(http.timeout, kind, None)
    return f"{value:g} s" if isinstance(value, int | float) else "its timeout"


def read_engine(http: httpx.Client, health_url: str, metrics_url: str | None) -> EngineRead:
    """``GET /health`` then ``GET /metrics`` of one engine, each error classified (module doc); with no
    ``metrics_url``, ``/health`` only (whether it serves, not how: the removal breaker's probe)."""
    try:
        h = http.get(health_url)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        return EngineRead(EngineHealth.UNREACHABLE)
    except httpx.PoolTimeout:
        return EngineRead(EngineHealth.UNKNOWN, unread="no free connection to read it (worker busy)")
    except httpx.TimeoutException:
        return EngineRead(
            EngineHealth.UNKNOWN, unread=f"GET /health answered nothing within {_timeout_s(http, 'read')}"
        )
    except httpx.HTTPError:
        return EngineRead(EngineHealth.UNREACHABLE)
    health = EngineHealth.OK if h.status_code == 200 else EngineHealth.FAILING
    if metrics_url is None:
        return EngineRead(health)
    try:
        m = http.get(metrics_url)
    except httpx.TimeoutException:
        return EngineRead(health, unread=f"GET /metrics answered nothing within {_timeout_s(http, 'read')}")
    except httpx.HTTPError:
        return EngineRead(health)
    try:
        snap = parse_engine_metrics(m.text) if m.status_code == 200 else None
    except ValueError:
        snap = None
    return EngineRead(health, snap)


def look_deadline(
    share: float = ENGINE_SHARE_OF_ATTEMPT,
    default_s: float = DEFAULT_ENGINE_WAIT_S,
    *,
    look_s: float | None = None,
) -> float:
    """``time.monotonic()`` by which a look stops waiting for engines: ``share`` of this attempt's
    start-to-close from now (``default_s`` outside an activity). ``look_s``: one look's own time, for
    an activity that takes many looks (its start-to-close is the whole watch, not one look)."""
    budget: timedelta | None = timedelta(seconds=look_s) if look_s is not None else None
    if budget is None and activity.in_activity():
        budget = activity.info().start_to_close_timeout
    seconds = budget.total_seconds() * share if budget is not None else default_s
    return time.monotonic() + max(1.0, seconds)


def read_all(
    read: Callable[[K], EngineRead], keys: Iterable[K], *, deadline: float, concurrency: int
) -> dict[K, EngineRead]:
    """``read(key)`` for every key, ``concurrency`` at a time, until ``deadline`` (monotonic).

    A key whose read had not ended by the deadline is unread ("not read within the look's
    time"); its thread finishes on its own (the HTTP timeouts bound it) and is not waited for.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 (got {concurrency})")
    todo = list(dict.fromkeys(keys))
    if not todo:
        return {}
    out: dict[K, EngineRead] = {}
    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(todo)), thread_name_prefix="engine-read")
    try:
        futures: dict[Future[EngineRead], K] = {pool.submit(read, key): key for key in todo}
        wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        for future, key in futures.items():
            if future.done() and not future.cancelled():
                out[key] = future.result()
            else:
                out[key] = EngineRead(EngineHealth.UNKNOWN, unread="not read within the look's time")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out
