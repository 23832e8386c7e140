"""The gateway's request record in Postgres, read the way the procedures read it."""

from __future__ import annotations

from gateway.store import GatewayStore
from ledger.store import make_engine


def _row(
    request_id: str, started_at: float, duration_s: float, code: int = 200, flags: str = ""
) -> dict[str, object]:
    return {
        "pool": "inference/llama",
        "request_id": request_id,
        "tier": "standard",
        "replica": "llama-a",
        "route": None,
        "response_code": code,
        "flags": flags,
        "started_at": started_at,
        "duration_s": duration_s,
        "first_byte_s": 0.05,
        "attempts": 1,
        "bytes_sent": 100,
        "envoy": "envoy-0",
    }


def test_since_selects_requests_that_ended_after_it_a_stream_in_flight_at_the_mark_counts(
    ledger_url: str,
) -> None:
    store = GatewayStore(make_engine(ledger_url))
    store.add_requests(
        [
            _row("done-before", started_at=100.0, duration_s=5.0),  # ended at 105
            _row("in-flight-then-cut", started_at=100.0, duration_s=20.0, flags="UPE"),  # ended at 120
            _row("started-after", started_at=112.0, duration_s=1.0),
        ]
    )
    got = {e.request_id: e for e in store.requests("inference/llama", since=110.0)}
    assert sorted(got) == ["in-flight-then-cut", "started-after"]
    assert got["in-flight-then-cut"].ended_at == 120.0
    assert len(store.requests("inference/llama")) == 3
    assert store.requests("inference/llama", replica="llama-b") == []
