"""The world's own record of every mutating request it received.

fleetmend's ledger claims "at most once"; this log is the independent
evidence: each POST/PUT/PATCH/DELETE that reached the simulator (Kubernetes API,
faults, the simulated Jira) with its time, verb, path, a
digest of its body, the client identity and the status answered. Served at
``GET /sim/v1/actions?since_seq=N`` as ``list[fleet.actionlog.ActionLogEntry]``.
"""

from __future__ import annotations

import hashlib
import threading

from fleet.actionlog import ActionLogEntry

MUTATING_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def body_digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


class ActionLog:
    """Append-only, thread-safe, sequence-numbered from 1."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[ActionLogEntry] = []

    def record(
        self, *, time: float, verb: str, path: str, body: bytes, client: str, status: int
    ) -> ActionLogEntry:
        with self._lock:
            entry = ActionLogEntry(
                seq=len(self._entries) + 1,
                time=time,
                verb=verb.upper(),
                path=path,
                body_digest=body_digest(body),
                client=client,
                status=status,
            )
            self._entries.append(entry)
            return entry

    def since(self, since_seq: int = 0) -> list[ActionLogEntry]:
        """Entries with ``seq > since_seq``, oldest first."""
        with self._lock:
            return list(self._entries[max(0, since_seq) :])

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
