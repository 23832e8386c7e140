"""Request outcomes as Envoy reports them: its access-log service (ALS) → ``gateway_requests``.

Every Envoy of the gateway streams one ``HTTPAccessLogEntry`` per finished request to the control
plane (``envoy.access_loggers.http_grpc`` in ``gateway.bootstrap``); the control plane names the
engine that served it (the upstream address → the pod, from its own snapshot) and stores a row.
The gateway adapter reads them back as ``JournalEntry`` (the in-flight record, cut streams).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envoy.data.accesslog.v3 import accesslog_pb2

from fleet.gateway import JournalEntry, Outcome
from fleet.vocabulary import TIER_HEADER, Tier

# Envoy's response-flag short names (access-log docs) for the ALS booleans fleetmend reads.
FLAG_NAMES: dict[str, str] = {
    "upstream_connection_termination": "UC",
    "upstream_connection_failure": "UF",
    "no_healthy_upstream": "UH",
    "upstream_remote_reset": "UR",
    "upstream_retry_limit_exceeded": "URX",
    "upstream_request_timeout": "UT",
    "upstream_overflow": "UO",
    "local_reset": "LR",
    "downstream_connection_termination": "DC",
    "downstream_remote_reset": "DR",
    "stream_idle_timeout": "SI",
    "upstream_protocol_error": "UPE",
    "no_route_found": "NR",
    "no_cluster_found": "NC",
    "overload_manager": "OM",
}
# The upstream went away under a request that had started: the stream was cut.
UPSTREAM_GONE = frozenset({"UC", "UR", "UPE", "LR"})


def classify(code: int, flags: frozenset[str], route: str) -> tuple[Outcome, bool]:
    """(outcome, truncated) of one request: shed by a shed route, cut mid-stream, refused, or served."""
    truncated = code == 200 and bool(flags & UPSTREAM_GONE)
    if route.startswith("shed-"):
        return Outcome.SHED, False
    if code == 200 and not truncated:
        return Outcome.COMPLETED, False
    if code in (429, 503) and flags & {"UO", "UH"}:
        return Outcome.REJECTED, False
    return Outcome.TERMINAL_ERROR, truncated


def _seconds(duration: Any) -> float | None:
    if duration is None or (duration.seconds == 0 and duration.nanos == 0):
        return None
    return float(duration.seconds + duration.nanos / 1e9)


def request_row(
    entry: accesslog_pb2.HTTPAccessLogEntry, envoy: str, pods_by_address: Mapping[str, tuple[str, str]]
) -> dict[str, Any] | None:
    """A ``gateway_requests`` row for one entry, or None for a request to no pool fleetmend serves.

    ``pods_by_address``: "ip:port" → (pool, pod), from the control plane's current snapshot.
    """
    common, request, response = entry.common_properties, entry.request, entry.response
    cluster = common.upstream_cluster
    upstream = common.upstream_remote_address.socket_address
    address = f"{upstream.address}:{upstream.port_value}" if upstream.address else ""
    pool, replica = pods_by_address.get(address, (cluster, None))
    if not pool:
        authority = request.authority.split(":")[0]
        service, _, namespace = authority.partition(".")
        pool = f"{namespace.split('.')[0]}/{service}" if namespace else ""
    if not pool:
        return None
    flags = sorted(
        FLAG_NAMES[f.name] for f, on in common.response_flags.ListFields() if on and f.name in FLAG_NAMES
    )
    started = common.start_time.seconds + common.start_time.nanos / 1e9
    tier = request.request_headers.get(TIER_HEADER)
    return {
        "pool": pool,
        "request_id": request.request_id,
        "tier": tier if tier in {t.value for t in Tier} else None,
        "replica": replica,
        "route": common.route_name or None,
        "response_code": int(response.response_code.value),
        "flags": ",".join(flags),
        "started_at": started,
        "duration_s": _seconds(common.duration) or _seconds(common.time_to_last_downstream_tx_byte) or 0.0,
        "first_byte_s": _seconds(common.time_to_first_upstream_rx_byte),
        "attempts": max(1, int(common.upstream_request_attempt_count or 1)),
        "bytes_sent": int(response.response_body_bytes),
        "envoy": envoy,
    }


def journal_entry(row: Mapping[str, Any]) -> JournalEntry:
    flags = frozenset(f for f in str(row["flags"]).split(",") if f)
    outcome, truncated = classify(int(row["response_code"]), flags, str(row["route"] or ""))
    tier = row["tier"]
    return JournalEntry(
        request_id=str(row["request_id"]),
        pool=str(row["pool"]),
        tier=Tier(tier) if tier else Tier.STANDARD,
        outcome=outcome,
        replica=row["replica"],
        attempt=int(row["attempts"]),
        started_at=float(row["started_at"]),
        ended_at=float(row["started_at"]) + float(row["duration_s"]),
        ttft_s=row["first_byte_s"],
        bytes_sent=int(row["bytes_sent"]),
        truncated=truncated,
        detail=f"{row['response_code']} {','.join(sorted(flags)) or '-'} via {row['envoy']}",
    )
