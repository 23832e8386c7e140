"""The gateway's request record in Postgres, read the way the procedures read it."""

from __future__ import annotations

from sqlalchemy import text, update

from gateway.store import GatewayStore
from ledger import CallableEffect, EffectLedger
from ledger.models import gateway_acks_table
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


def test_an_envoy_whose_control_plane_died_without_closing_its_row_lapses_and_a_heartbeat_keeps_one(
    ledger_url: str,
) -> None:
    """A control plane killed -9 never marks its Envoys disconnected: their rows lapse after
    ``liveness_s`` unless a living control plane re-marks them, so nothing waits on a dead Envoy."""
    engine = make_engine(ledger_url)
    store = GatewayStore(engine, liveness_s=30.0)
    for node, admin in (("envoy-dead", "http://127.0.0.1:1"), ("envoy-live", "http://127.0.0.1:2")):
        store.record_answer(node, "clusters", acked="p1.a", admin_url=admin)
    assert store.admin_urls() == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    # Both rows last re-marked a minute ago: the dead one's control plane is gone; the live one's beats.
    with engine.begin() as conn:
        conn.execute(update(gateway_acks_table).values(updated_at=text("now() - interval '60 seconds'")))
    store.mark(["envoy-live"], connected=True)
    assert store.admin_urls() == ["http://127.0.0.1:2"]
    assert {a.node_id: a.connected for a in store.answers()} == {"envoy-dead": False, "envoy-live": True}
    # A control plane that shuts down closes its own Envoys' rows at once.
    store.mark(["envoy-live"], connected=False)
    assert store.admin_urls() == []
    # An answer from a reconnected Envoy makes it connected again.
    store.record_answer("envoy-dead", "clusters", acked="p2.b")
    assert store.admin_urls() == ["http://127.0.0.1:1"]


def test_a_journal_entry_carries_the_operation_ids_its_request_proposed_from_the_ledger(
    ledger_url: str,
) -> None:
    """Envoy's access log names the request; the ledger's rows under ``<request id>/<n>`` are what it
    proposed (an agent's tool calls, a model's ticket): step 4's count of request-derived operation ids."""
    ledger = EffectLedger(ledger_url)

    def done() -> CallableEffect:
        return CallableEffect(lambda _: {"ok": True}, probe=lambda _: None)

    for op_id in ("agent-1/0", "agent-1/2", "agent-2/0", "agent-10/0"):
        ledger.perform(op_id, "ticket.create", "jira", {"title": op_id}, done())
    ledger.perform("fleetmend:incident/x@r/fence/node/n", "k8s.node.cordon", "node/n", {}, done())
    store = GatewayStore(make_engine(ledger_url))
    store.add_requests([_row("agent-1", 100.0, 1.0), _row("agent-2", 101.0, 1.0), _row("plain", 102.0, 1.0)])
    got = {e.request_id: e.effect_operation_ids for e in store.requests("inference/llama")}
    # Exact keys: agent-10's effect is not agent-1's (no prefix match), the procedure's row is no request's.
    assert got == {"agent-1": ["agent-1/0", "agent-1/2"], "agent-2": ["agent-2/0"], "plain": []}
