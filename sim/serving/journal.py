"""The gateway's request journal: one entry per attempt, queryable per replica and window.

Pagination: ``since`` is inclusive; a page never splits entries that share an
``ended_at``, and ``next_since`` is the next representable time after the page's
last entry, so a client that follows ``next_since`` sees every entry exactly once.
"""

from __future__ import annotations

import bisect
import math
import threading

from fleet.protocol import JournalEntry, JournalPage, Outcome

DEFAULT_PAGE = 1000


class Journal:
    def __init__(self, max_entries: int = 100_000) -> None:
        self._entries: list[JournalEntry] = []  # sorted by ended_at
        self._ends: list[float] = []
        self._lock = threading.Lock()
        self._max = max_entries

    def record(self, entry: JournalEntry) -> None:
        with self._lock:
            i = bisect.bisect_right(self._ends, entry.ended_at)
            self._ends.insert(i, entry.ended_at)
            self._entries.insert(i, entry)
            if len(self._entries) > self._max:
                drop = len(self._entries) - self._max
                del self._entries[:drop]
                del self._ends[:drop]

    def __len__(self) -> int:
        return len(self._entries)

    def query(
        self,
        *,
        pool: str | None = None,
        replica: str | None = None,
        since: float | None = None,
        until: float | None = None,
        outcome: Outcome | None = None,
        request_id: str | None = None,
        limit: int = DEFAULT_PAGE,
    ) -> JournalPage:
        replica_name = replica.split("/")[-1] if replica else None
        with self._lock:
            start = bisect.bisect_left(self._ends, since) if since is not None else 0
            stop = bisect.bisect_right(self._ends, until) if until is not None else len(self._ends)
            window = self._entries[start:stop]
        out: list[JournalEntry] = []
        next_since: float | None = None
        for e in window:
            if pool is not None and e.pool != pool:
                continue
            if replica_name is not None and e.replica != replica_name:
                continue
            if outcome is not None and e.outcome != outcome:
                continue
            if request_id is not None and e.request_id != request_id:
                continue
            if len(out) >= limit and e.ended_at != out[-1].ended_at:
                next_since = math.nextafter(out[-1].ended_at, math.inf)
                break
            out.append(e)
        return JournalPage(entries=out, next_since=next_since)

    def all(self) -> list[JournalEntry]:
        with self._lock:
            return list(self._entries)
