"""An informer, as client-go's: list, then watch from the list's resourceVersion; 410 Gone -> list again.

Runs in a thread with the official (synchronous) ``kubernetes`` client. It keeps
a cache of the objects it has seen (keyed namespace/name) and hands every change
to ``on_event(type, object)`` as plain dicts. A re-list after a broken watch
(410 Gone: the API server no longer has the history; a dropped connection; an
API server restart) is diffed against the cache, so an object deleted while the
watch was down still arrives as ``DELETED`` — a broken watch misses no loss.

One informer per resource type: the API server serves one watch per type, not a
poll per pool.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

log = logging.getLogger("fleetmend.fastpath")

EventHandler = Callable[[str, dict[str, Any]], None]

# Server-side watch timeout: the watch is re-opened from the last resourceVersion after it.
WATCH_TIMEOUT_S = 60
# Back-off after an error that is not 410 (API server unreachable, 5xx).
ERROR_BACKOFF_S = 0.5


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
        self._watch: watch.Watch | None = None

    def _kwargs(self) -> dict[str, Any]:
        return {"label_selector": self._selector} if self._selector else {}

    def sync(self) -> None:
        """List every object; emit the difference from the cache (ADDED / MODIFIED / DELETED)."""
        listed = self._list(_preload_content=False, _request_timeout=self._request_timeout, **self._kwargs())
        body = json.loads(listed.data)
        self.lists += 1
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
            elif _rv(before) != _rv(obj):
                self._emit("MODIFIED", obj)

    def watch_once(self, stop: threading.Event) -> None:
        """Watch from ``resource_version`` until the server ends the watch, ``stop``, or an error.

        410 Gone re-lists (and diffs); another error backs off, then re-lists too.
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
            stop.wait(ERROR_BACKOFF_S)
            self._sync_quietly()
        except Exception as err:  # connection reset, API server restarting
            log.warning(
                "watch broken: re-listing after a pause",
                extra={"resource": self.name, "error": str(err)[:200]},
            )
            stop.wait(ERROR_BACKOFF_S)
            self._sync_quietly()
        finally:
            self._watch = None

    def _sync_quietly(self) -> None:
        try:
            self.sync()
        except Exception as err:
            log.warning("re-list failed", extra={"resource": self.name, "error": str(err)[:200]})
            self.resource_version = None  # list again before the next watch

    def run(self, stop: threading.Event) -> None:
        """The informer loop: list, then watch, until ``stop``."""
        while not stop.is_set():
            try:
                if self.resource_version is None:
                    self.sync()
                self.watch_once(stop)
            except Exception as err:
                log.warning("list failed", extra={"resource": self.name, "error": str(err)[:200]})
                stop.wait(ERROR_BACKOFF_S)

    def stop(self) -> None:
        w = self._watch
        if w is not None:
            w.stop()

    def _emit(self, kind: str, obj: dict[str, Any]) -> None:
        try:
            self._on_event(kind, obj)
        except Exception:  # a handler bug must not kill the watch
            log.exception("informer handler failed", extra={"resource": self.name, "event": kind})


def _rv(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("resourceVersion")
