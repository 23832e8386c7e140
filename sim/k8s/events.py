"""core/v1 Events written by the simulated controllers (Scheduled, FailedScheduling, ...).

Repeats of the same (object, reason, message) bump ``count`` and
``lastTimestamp`` of one Event, as the client-go event correlator does.
"""

from __future__ import annotations

import threading
import uuid
from typing import Any

from sim.clock import SimClock
from sim.k8s.store import ObjectStore

Obj = dict[str, Any]


class EventRecorder:
    def __init__(self, store: ObjectStore, clock: SimClock) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str, str], tuple[str, str]] = {}

    def record(
        self,
        involved: Obj,
        reason: str,
        message: str,
        *,
        event_type: str = "Normal",
        component: str,
    ) -> None:
        meta = involved["metadata"]
        namespace = meta.get("namespace") or "default"
        key = (meta["uid"], reason, message)
        now = self._clock.timestamp()
        with self._lock:
            existing = self._index.get(key)
            if existing is not None:
                updated = self._store.mutate(
                    "events",
                    existing[0],
                    existing[1],
                    lambda e: e.update(count=e.get("count", 1) + 1, lastTimestamp=now),
                )
                if updated is not None:
                    return
            name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
            self._store.create(
                "events",
                {
                    "metadata": {"name": name, "namespace": namespace},
                    "involvedObject": {
                        "apiVersion": involved.get("apiVersion"),
                        "kind": involved.get("kind"),
                        "name": meta["name"],
                        "namespace": meta.get("namespace"),
                        "uid": meta["uid"],
                        "resourceVersion": meta.get("resourceVersion"),
                    },
                    "reason": reason,
                    "message": message,
                    "type": event_type,
                    "count": 1,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "source": {"component": component},
                    "reportingComponent": component,
                    "reportingInstance": "",
                },
            )
            self._index[key] = (namespace, name)
