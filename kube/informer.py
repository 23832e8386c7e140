"""An informer, as client-go's: list, then watch from the list's resourceVersion; 410 Gone -> list again.

Runs in a thread with the official (synchronous) ``kubernetes`` client. It keeps
a cache of the objects it has seen (keyed namespace/name) and hands every change
to ``on_event(type, object)`` as plain dicts. A re-list after a broken watch
(410 Gone: the API server no longer has the history; a dropped connection; an
API server restart) is diffed against the cache, as client-go's DeltaFIFO
``Replace`` does: an object deleted while the watch was down still arrives as
``DELETED`` (with its last known state), one that changed as ``MODIFIED``, one
created as ``ADDED`` — a broken watch misses no loss.

An API server that restarts resets the open watch and then refuses connections
for a while: the informer keeps its cache and retries the list with capped
exponential back-off and jitter (client-go's reflector backs off from 800 ms to
30 s; here from ``BACKOFF_INITIAL_S`` to ``BACKOFF_MAX_S``, because the fast path
exists to notice a loss within seconds), so it is back at most ``BACKOFF_MAX_S``
after the server is. A 410 re-lists at once: the server is up, only its history
is gone.

One informer per resource type: the API server serves one watch per type, not a
poll per pool.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fleetmend.fastpath")

EventHandler = Callable[[str, dict[str, Any]], None]

# Server-side watch timeout: the watch is re-opened from the last resourceVersion after it.
WATCH_TIMEOUT_S = 60
# Back-off after an error that is not 410 (API server unreachable or restarting, 5xx): the n-th
# consecutive failure waits a random time in [d/2, d], d = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**n).
BACKOFF_INITIAL_S = 0.25
BACKOFF_MAX_S = 4.0


def object_key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


class Informer:
    """List + watch one resource type; ``sync`` lists, ``watch_once`` watches until it ends."""

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        on_event: EventHandler,
        *,
        label_selector: str | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        request_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self._list = list_fn
        self._on_event = on_event
        self._selector = label_selector
        self._watch_timeout = watch_timeout_s
        self._request_timeout = request_timeout_s
        self.cache: dict[str, dict[str, Any]] = {}
        self.resource_version: str | None = None
        self.lists = 0
        self.relists_after_gone = 0
        self.relists_after_error = 0  # re-lists that followed a broken watch or an unreachable server
        self.failures = 0  # consecutive failed list/watch attempts (back-off grows with it)
        self.synced = False  # a list has succeeded: the cache holds the whole collection
        self._watch: watch.Watch | None = None

    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self._selector} if self._selector else {}

    def sync(self) -> None:
        """List every object; emit the difference from the cache (ADDED / MODIFIED / DELETED).

        An object whose content differs with the same resourceVersion (a server whose history
        restarted) counts as MODIFIED too."""
        listed = self._list(_preload_content=False, _request_timeout=self._request_timeout, **self._kwargs())
        body = json.loads(listed.data)
        self.lists += 1
        if self.failures:
            self.relists_after_error += 1
            log.info("re-listed after a broken watch", extra={"resource": self.name})
        self.failures = 0
        self.synced = True
        fresh = {object_key(o): o for o in body.get("items") or []}
        old = self.cache
        self.cache = fresh
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "") or None
        for key, obj in old.items():
            if key not in fresh:
                self._emit("DELETED", obj)
        for key, obj in fresh.items():
            before = old.get(key)
            if before is None:
                self._emit("ADDED", obj)
            elif before != obj:
                self._emit("MODIFIED", obj)

    def watch_once(self, stop: threading.Event) -> None:
        """Watch from ``resource_version`` until the server ends the watch, ``stop``, or an error.

        410 Gone re-lists (and diffs) at once; another error backs off, then re-lists too.
        """
        if self.resource_version is None:
            self.sync()
        w = watch.Watch()
        self._watch = w
        try:
            for event in w.stream(
                self._list,
                resource_version=self.resource_version,
                timeout_seconds=self._watch_timeout,
                allow_watch_bookmarks=True,
                _request_timeout=self._watch_timeout + self._request_timeout,
                **self._kwargs(),
            ):
                if stop.is_set():
                    break
                kind, obj = event["type"], event["raw_object"]
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if rv:
                    self.resource_version = str(rv)
                if kind == "BOOKMARK":
                    continue
                key = object_key(obj)
                if kind == "DELETED":
                    self.cache.pop(key, None)
                else:
                    self.cache[key] = obj
                self._emit(kind, obj)
        except ApiException as err:
            if err.status == 410:
                self.relists_after_gone += 1
                log.info("watch expired (410 Gone): re-listing", extra={"resource": self.name})
                self.sync()
                return
            log.warning(
                "watch failed: re-listing after a pause",
                extra={"resource": self.name, "status": err.status, "reason": str(err.reason)[:200]},
            )
            self._back_off(stop)
            self._sync_quietly(stop)
        except Exception as err:  # connection reset, API server restarting
            log.warning(
                "watch broken: re-listing after a pause",
                extra={"resource": self.name, "error": str(err)[:200]},
            )
            self._back_off(stop)
            self._sync_quietly(stop)
        finally:
            self._watch = None

    def backoff_s(self) -> float:
        """The pause before the next attempt, after ``failures`` consecutive failures (with jitter)."""
        ceiling = min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** max(0, self.failures - 1))
        return random.uniform(ceiling / 2, ceiling)

    def _back_off(self, stop: threading.Event) -> None:
        self.failures += 1
        stop.wait(self.backoff_s())

    def _sync_quietly(self, stop: threading.Event) -> None:
        if stop.is_set():
            return
        try:
            self.sync()
        except Exception as err:
            log.warning("re-list failed", extra={"resource": self.name, "error": str(err)[:200]})
            self.resource_version = None  # list again before the next watch (the cache stays)

    def run(self, stop: threading.Event, *, give_up_after: int | None = None) -> None:
        """The informer loop: list, then watch, until ``stop`` (or, with ``give_up_after``, until that many
        consecutive attempts have failed: the caller reads without the cache then, and may start again)."""
        while not stop.is_set() and (give_up_after is None or self.failures < give_up_after):
            try:
                if self.resource_version is None:
                    self.sync()
                self.watch_once(stop)
            except Exception as err:
                log.warning("list failed", extra={"resource": self.name, "error": str(err)[:200]})
                self._back_off(stop)

    def stop(self) -> None:
        w = self._watch
        if w is not None:
            w.stop()

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            self._on_event(kind, obj)
        except Exception:  # a handler bug must not kill the watch
            log.exception("informer handler failed", extra={"resource": self.name, "event": kind})
