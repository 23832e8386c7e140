"""The simulated API server's audit log: every request it serves, as ``audit.k8s.io/v1`` Events.

One JSON object per line, as ``kube-apiserver --audit-log-path`` writes them, under this policy
(also written next to the log as ``audit-policy.yaml``)::

    apiVersion: audit.k8s.io/v1
    kind: Policy
    omitStages: [RequestReceived, ResponseStarted]
    rules:
      - level: Request      # mutations carry the request body as requestObject
        verbs: [create, update, patch, delete, deletecollection]
      - level: Metadata     # reads, watches and non-resource requests: who, what, answer

Each event has ``user`` (from the bearer token), ``userAgent``, ``sourceIPs``, the Kubernetes
``verb``, ``objectRef`` (resource, subresource, namespace, name, apiGroup, apiVersion),
``responseStatus.code`` (plus reason and message on failures), ``stage: ResponseComplete``,
``requestReceivedTimestamp`` / ``stageTimestamp`` (the sim's clock, in microseconds) and the
``authorization.k8s.io/decision`` annotation. A watch is logged when its stream ends.

fleetmend's ``ledger reconcile`` reads this file as it would a real cluster's audit log; the
same events say which (verb, group, resource, subresource, namespace) a client used, the raw
material of a least-privilege Role (``rbac_rules``).
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.clock import SimClock, micro_timestamp
from sim.k8s.requestinfo import request_info

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules:
  - level: Request
    verbs: [create, update, patch, delete, deletecollection]
  - level: Metadata
"""
_MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True)
class User:
    username: str
    groups: tuple[str, ...] = ()

    def info(self) -> dict[str, Any]:
        return {"username": self.username, "groups": list(self.groups)} if self.username else {}


ADMIN = User("sim-admin", ("system:masters", "system:authenticated"))


class AuditLog:
    """Append-only JSON-lines audit log (thread-safe; every line is flushed when written)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._count = 0
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / "audit-policy.yaml").write_text(AUDIT_POLICY)
            self._file = path.open("w", encoding="utf-8")  # a new cluster starts a new log

    def write(self, event: dict[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            self._count += 1
            if self._file is not None and not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()

    def __len__(self) -> int:
        with self._lock:
            return self._count

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


def read_events(path: Path) -> Iterator[dict[str, Any]]:
    """The events of an audit log file (JSON lines; blank lines skipped)."""
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


def rbac_rules(events: Iterable[dict[str, Any]], username: str | None = None) -> list[dict[str, Any]]:
    """The RBAC rules that would allow exactly the resource requests in ``events``.

    One rule per (namespace, apiGroup, resource[/subresource]) with the sorted verbs used;
    ``namespace`` is "" for cluster-scoped resources and cluster-wide lists. Only allowed
    requests count (a 403 is what the client was *not* given).
    """
    verbs: dict[tuple[str, str, str], set[str]] = {}
    for event in events:
        ref = event.get("objectRef") or {}
        if not ref.get("resource"):
            continue
        if username is not None and (event.get("user") or {}).get("username") != username:
            continue
        if (event.get("annotations") or {}).get("authorization.k8s.io/decision") == "forbid":
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        key = (ref.get("namespace", ""), ref.get("apiGroup", ""), resource)
        verbs.setdefault(key, set()).add(event["verb"])
    return [
        {"namespace": ns, "apiGroups": [group], "resources": [resource], "verbs": sorted(used)}
        for (ns, group, resource), used in sorted(verbs.items())
    ]


class AuditMiddleware:
    """Wraps the Kubernetes API app: writes one audit Event per request when its response ends."""

    def __init__(
        self,
        app: ASGIApp,
        log: AuditLog,
        clock: SimClock,
        authenticate: Callable[[dict[str, str]], User | None],
    ) -> None:
        self.app = app
        self.log = log
        self.clock = clock
        self.authenticate = authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = self.clock.now()
        method = scope["method"]
        query = scope.get("query_string", b"").decode("latin-1")
        info = request_info(method, scope["path"], query)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        body: list[bytes] = []
        status = {"code": 500}
        error_body: list[bytes] = []
        written = {"done": False}

        def record() -> None:
            if written["done"]:
                return
            written["done"] = True
            self.log.write(
                self._event(scope, info, headers, query, received, body, status["code"], error_body)
            )

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request" and info.is_mutation:
                body.append(message.get("body", b""))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            elif message["type"] == "http.response.body":
                if status["code"] >= 400 and sum(len(c) for c in error_body) < _MAX_ERROR_BODY:
                    error_body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    record()  # logged before the client can see the end of the response
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            record()

    def _event(
        self,
        scope: Scope,
        info: Any,
        headers: dict[str, str],
        query: str,
        received: float,
        body: list[bytes],
        code: int,
        error_body: list[bytes],
    ) -> dict[str, Any]:
        user = self.authenticate(headers)
        uri = scope["path"] + (f"?{query}" if query else "")
        client = scope.get("client") or ("", 0)
        event: dict[str, Any] = {
            "kind": "Event",
            "apiVersion": "audit.k8s.io/v1",
            "level": "Request" if info.is_mutation else "Metadata",
            "auditID": str(uuid.uuid4()),
            "stage": "ResponseComplete",
            "requestURI": uri,
            "verb": info.verb,
            "user": user.info() if user is not None else {},
            "sourceIPs": [client[0]] if client and client[0] else [],
            "userAgent": headers.get("user-agent", ""),
        }
        request_object = _json_or_none(b"".join(body)) if info.is_mutation else None
        if info.is_resource:
            ref: dict[str, Any] = {"resource": info.resource}
            namespace = info.namespace
            name = info.name
            if info.verb == "create" and isinstance(request_object, dict) and not info.subresource:
                meta = request_object.get("metadata") or {}
                name = name or str(meta.get("name") or "")
                namespace = namespace or str(meta.get("namespace") or "")
            if namespace:
                ref["namespace"] = namespace
            if name:
                ref["name"] = name
            if info.api_group:
                ref["apiGroup"] = info.api_group
            ref["apiVersion"] = info.api_version
            if info.subresource:
                ref["subresource"] = info.subresource
            event["objectRef"] = ref
        event["responseStatus"] = _response_status(code, b"".join(error_body))
        if request_object is not None:
            event["requestObject"] = request_object
        event["requestReceivedTimestamp"] = micro_timestamp(received)
        event["stageTimestamp"] = micro_timestamp(self.clock.now())
        if user is not None:
            decision = (scope.get("state") or {}).get("authorization_decision")
            if decision is None:  # not dispatched (e.g. exec, reviews' own routes): the status says it
                decision = "forbid" if code == 403 else "allow"
            event["annotations"] = {"authorization.k8s.io/decision": decision}
        return event


def _json_or_none(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _response_status(code: int, body: bytes) -> dict[str, Any]:
    status: dict[str, Any] = {"metadata": {}, "code": code}
    if code >= 400:
        parsed = _json_or_none(body)
        if isinstance(parsed, dict) and parsed.get("kind") == "Status":
            for field in ("status", "message", "reason"):
                if parsed.get(field):
                    status[field] = parsed[field]
    return status
