"""Watches, as the apiserver serves them: ``GET ...?watch=true`` streams JSON watch events.

* ``resourceVersion`` unset or ``"0"``: synthetic ``ADDED`` events for every current object,
  then changes; ``resourceVersion=N``: every change after N, in order, from the store's event
  history. Events already dropped from the history answer with an ``ERROR`` event carrying the
  ``410 Expired`` Status (``too old resource version: N (M)``) on an HTTP 200 stream, as the
  watch cache does; clients re-list and watch again.
* ``sendInitialEvents=true`` (the WatchList protocol, with ``resourceVersionMatch=NotOlderThan``
  and ``allowWatchBookmarks=true``): the current objects as ``ADDED``, then a ``BOOKMARK`` with the
  ``k8s.io/initial-events-end: "true"`` annotation.
* ``allowWatchBookmarks=true``: a ``BOOKMARK`` (only ``metadata.resourceVersion``) every
  ``BOOKMARK_INTERVAL_S`` wall seconds.
* Label and field selectors filter the stream; an object that stops (starts) matching after a
  change is sent as ``DELETED`` (``ADDED``).
* ``timeoutSeconds`` ends the stream; the server also ends every stream when it shuts down.
* After an API server restart (``restart_cache``) the watch cache starts at the revision current
  then, as a restarted apiserver's cache is initialised by a list at etcd's current revision: a
  watch resuming from an older resourceVersion gets the ``410 Expired`` ERROR event even when
  the store still holds those events; clients re-list.

Events come from the store's watchers (called under the store's lock, on any thread) and are
handed to each stream's queue on the server's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from sim.k8s.errors import ApiError
from sim.k8s.resources import Resource
from sim.k8s.selectors import parse_field_selector, parse_label_selector
from sim.k8s.store import ObjectStore, TooOldResourceVersion, WatchEvent, labels_of

Obj = dict[str, Any]
BOOKMARK_INTERVAL_S = 10.0
DEFAULT_TIMEOUT_S = 1800.0  # the apiserver's --min-request-timeout
INITIAL_EVENTS_END = "k8s.io/initial-events-end"


@dataclass(frozen=True)
class WatchRequest:
    resource: Resource
    namespace: str | None
    label_selector: str | None
    field_selector: str | None
    resource_version: str
    send_initial_events: bool
    bookmarks: bool
    timeout_s: float


class WatchHub:
    """Fans the store's events out to the open watch streams (on the server's event loop)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._queues: dict[int, tuple[str, asyncio.Queue[WatchEvent | None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Event | None = None
        self._next = 0
        # The oldest resourceVersion a watch may resume from (0: the store's own history decides).
        self._cache_start = 0
        store.watch(self._on_event)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._closing = asyncio.Event()

    def _on_event(self, event: WatchEvent) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        for plural, queue in list(self._queues.values()):
            if plural != event.resource:
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                queue.put_nowait(event)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, event)

    def close(self) -> None:
        """End every stream (server shutdown)."""
        if self._closing is not None:
            self._closing.set()
        for _, queue in list(self._queues.values()):
            queue.put_nowait(None)

    def end_streams(self) -> None:
        """End the open streams without closing the hub (their connections were reset: a restart)."""
        for _, queue in list(self._queues.values()):
            queue.put_nowait(None)

    def restart_cache(self) -> int:
        """Start the watch cache afresh at the store's current revision (a restarted apiserver's
        cache holds no history from before it listed); returns that revision."""
        with self.store.lock:
            self._cache_start = int(self.store.resource_version)
            return self._cache_start

    @property
    def cache_start(self) -> int:
        return self._cache_start

    @property
    def open_streams(self) -> int:
        return len(self._queues)

    def subscribe(self, plural: str) -> tuple[int, asyncio.Queue[WatchEvent | None]]:
        queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._next += 1
        self._queues[self._next] = (plural, queue)
        return self._next, queue

    def unsubscribe(self, key: int) -> None:
        self._queues.pop(key, None)

    async def stream(
        self, req: WatchRequest, render: Callable[[str, Obj, bool], Obj]
    ) -> AsyncIterator[bytes]:
        """The watch's JSON lines. ``render(type, object, first)`` shapes each event's object."""
        resource = req.resource
        label_match = parse_label_selector(req.label_selector)
        field_match = parse_field_selector(req.field_selector, resource.field_selectors)

        def matches(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = obj.get("metadata") or {}
            if req.namespace is not None and meta.get("namespace", "") != req.namespace:
                return False
            return label_match(labels_of(obj)) and field_match(obj)

        initial: list[tuple[str, Obj]] = []
        expired: TooOldResourceVersion | None = None
        with self.store.lock:
            key, queue = self.subscribe(resource.plural)
            snapshot_rv = self.store.resource_version
            if req.send_initial_events or req.resource_version in ("", "0"):
                for obj in self.store.list(resource.plural, req.namespace):
                    if matches(obj):
                        initial.append(("ADDED", obj))
            else:
                try:
                    requested = int(req.resource_version)
                    if requested < self._cache_start:
                        raise TooOldResourceVersion(requested, self._cache_start + 1)
                    replay = self.store.events_since(resource.plural, requested)
                except TooOldResourceVersion as exc:
                    expired = exc
                    replay = []
                for past in replay:
                    shaped = _shape(past, matches)
                    if shaped is not None:
                        initial.append(shaped)
        first = True

        def line(event_type: str, obj: Obj) -> bytes:
            nonlocal first
            shaped = obj if event_type in ("BOOKMARK", "ERROR") else render(event_type, obj, first)
            if event_type not in ("BOOKMARK", "ERROR"):
                first = False
            return (json.dumps({"type": event_type, "object": shaped}, separators=(",", ":")) + "\n").encode()

        try:
            if expired is not None:
                error = ApiError(410, "Expired", str(expired)).status()
                yield line("ERROR", error)
                return
            for event_type, obj in initial:
                yield line(event_type, obj)
            if req.send_initial_events:
                yield line("BOOKMARK", self._bookmark(resource, snapshot_rv, initial_end=True))
            deadline = time.monotonic() + req.timeout_s
            next_bookmark = time.monotonic() + BOOKMARK_INTERVAL_S
            while True:
                now = time.monotonic()
                if now >= deadline or (self._closing is not None and self._closing.is_set()):
                    return
                wait = min(deadline, next_bookmark if req.bookmarks else deadline) - now
                event: WatchEvent | None
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=max(0.0, wait))
                except TimeoutError:
                    if req.bookmarks and time.monotonic() >= next_bookmark:
                        yield line("BOOKMARK", self._bookmark(resource, self.store.resource_version))
                        next_bookmark = time.monotonic() + BOOKMARK_INTERVAL_S
                    continue
                if event is None:
                    return
                shaped = _shape(event, matches)
                if shaped is not None:
                    yield line(*shaped)
        finally:
            self.unsubscribe(key)
            with contextlib.suppress(Exception):
                while not queue.empty():
                    queue.get_nowait()

    @staticmethod
    def _bookmark(resource: Resource, rv: str, *, initial_end: bool = False) -> Obj:
        meta: Obj = {"resourceVersion": rv}
        if initial_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        return {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": meta}


def _shape(event: WatchEvent, matches: Callable[[Obj | None], bool]) -> tuple[str, Obj] | None:
    """The event as this watch sees it (selector transitions become ADDED/DELETED), or None."""
    now_matches = matches(event.object)
    if event.type == "MODIFIED":
        before = matches(event.old) if event.old is not None else now_matches
        if now_matches and before:
            return "MODIFIED", event.object
        if now_matches:
            return "ADDED", event.object
        if before:
            return "DELETED", event.object
        return None
    return (event.type, event.object) if now_matches else None
