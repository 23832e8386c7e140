"""Collections a worker reads on every look, kept by one watch each, as a controller's informer cache.

A recovery looks at its pool every few seconds, and each look needs cluster-wide context:
every Node (placement, the fence), every Deployment and ReplicaSet of the pool's namespace
(which controller owns a replica, its replicas: watched per namespace, as fleetmend's RBAC grants
them). Listing them per look costs O(fleet) per look: at 512
nodes a node list is ~0.8 MB of JSON, and a burst of a hundred recoveries spent most of the
worker's time decoding the same lists (py-spy, fleet-scale burst). ``WatchedObjects`` lists once
and follows the watch, so its cost grows with changes, not with looks.

``Watched`` is the shared shape: an ``Informer`` in its own daemon thread, read only while it is
following the server. ``fresh()`` is False before the first list, while the watch is broken
(the cache could be stale) and after it gave up (``GIVE_UP_AFTER`` refusals in a row: a cluster
that went away costs nothing); the caller then lists as before, and the next ``watched`` call
for that collection starts a new watch. Reads may trail the API server by a watch event's latency
(milliseconds), as any informer-fed controller's do.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from kube.informer import Informer, object_key

log = logging.getLogger("fleetmend.kube")

GIVE_UP_AFTER = 15  # consecutive failed attempts (back-off capped at 4 s: about a minute unreachable)

Obj = dict[str, Any]


class Watched(ABC):
    """An informer in its own daemon thread; subclasses keep what they need from ``_on_event``."""

    def __init__(self, name: str, list_fn: Callable[..., Any]) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._informer = Informer(name, list_fn, self._on_event)
        self._thread = threading.Thread(target=self._run, name=f"fleetmend-watch-{name}", daemon=True)

    def start(self) -> Watched:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def fresh(self) -> bool:
        """Listed, following the watch, not given up: what it holds is the server's state."""
        return self._informer.synced and not self._informer.failures and self.running

    def stop(self) -> None:
        self._stop.set()
        self._informer.stop()

    def _run(self) -> None:
        self._informer.run(self._stop, give_up_after=GIVE_UP_AFTER)
        if not self._stop.is_set():
            log.warning("%s watch gave up: the API server refused it %d times", self.name, GIVE_UP_AFTER)
        self._stop.set()

    @abstractmethod
    def _on_event(self, kind: str, obj: Obj) -> None:
        """Fold one informer event (ADDED / MODIFIED / DELETED) into what the subclass keeps."""


class WatchedObjects(Watched):
    """Every object of one resource type, by namespace; ``items(ns)`` is a list of the cached dicts.

    The dicts are the watch's own: readers must not change them (observation code only reads)."""

    def __init__(self, name: str, list_fn: Callable[..., Any]) -> None:
        super().__init__(name, list_fn)
        self._by_ns: dict[str, dict[str, Obj]] = {}

    def items(self, namespace: str | None = None) -> list[Obj] | None:
        """The objects of ``namespace`` (every one when None), or None while not ``fresh()``."""
        if not self.fresh():
            return None
        with self._lock:
            if namespace is not None:
                return list(self._by_ns.get(namespace, {}).values())
            return [o for objs in self._by_ns.values() for o in objs.values()]

    def _on_event(self, kind: str, obj: Obj) -> None:
        ns = (obj.get("metadata") or {}).get("namespace") or ""
        key = object_key(obj)
        with self._lock:
            objs = self._by_ns.setdefault(ns, {})
            if kind == "DELETED":
                objs.pop(key, None)
            else:
                objs[key] = obj


W = TypeVar("W", bound=Watched)

_lock = threading.Lock()
_running: dict[tuple[object, str], Watched] = {}


def watched(key: object, name: str, make: Callable[[], W]) -> W:
    """The process's watch of ``name`` on one cluster (``key`` names it), started if none is running."""
    with _lock:
        found = _running.get((key, name))
        if found is None or not found.running:
            found = _running[(key, name)] = make().start()
        return found  # type: ignore[return-value]
