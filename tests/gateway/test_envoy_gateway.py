"""The Envoy gateway, driven by fleetmend: a real Envoy, fleetmend's ADS control plane, real
upstream HTTP servers on their own loopback addresses, and the ledger's Postgres.

The control plane's routed hosts are handed in here (``Hosts``) so each test can say exactly which
engines a pool has; reading them from Kubernetes is ``tests/gateway/test_world.py``.
"""

from __future__ import annotations

import collections
import json
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from activities.envoy_gateway import EnvoyGateway
from fleet.gateway import Admission, GatewayPolicy, Outcome, RetryPolicy
from fleet.incident import PoolRef
from fleet.vocabulary import TIER_HEADER, Tier
from gateway.bootstrap import BootstrapSettings
from gateway.resources import DataPlaneSettings, RoutedHost
from gateway.run import ControlPlaneThread
from gateway.store import GatewayStore
from ledger.errors import PermanentEffectError
from ledger.migrate import upgrade_head
from ledger.scratch import PgServer
from ledger.store import make_engine
from worker.devstack.envoy import EnvoyProcess
from worker.processes import free_port

pytestmark = pytest.mark.timeout(240)
POOL = PoolRef(namespace="inference", service="llama")
HOST = {"host": "llama.inference"}


class Engine:
    """A tiny engine: /health, a non-streamed answer naming itself, and a slow token stream."""

    def __init__(self, name: str, address: str) -> None:
        self.name, self.address = name, address
        self.port = free_port(address)
        app = FastAPI()

        @app.get("/health")
        def health() -> dict[str, bool]:
            return {"ok": True}

        @app.get("/v1/who")
        def who() -> dict[str, str]:
            return {"pod": name}

        @app.get("/v1/stream")
        def stream() -> StreamingResponse:
            def tokens() -> Iterator[bytes]:
                for i in range(20):
                    time.sleep(0.05)
                    yield f"data: {i}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(tokens(), media_type="text/event-stream")

        self.server = uvicorn.Server(uvicorn.Config(app, host=address, port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> Engine:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def host(self) -> RoutedHost:
        return RoutedHost(pod=self.name, address=self.address, port=self.port)


class Hosts:
    """What Kubernetes says the pool routes to, as the test decides it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pods: dict[str, RoutedHost] = {}

    def set(self, *engines: Engine) -> None:
        with self.lock:
            self.pods = {e.name: e.host for e in engines}

    def __call__(self) -> dict[str, tuple[RoutedHost, ...]]:
        with self.lock:
            return {POOL.key: tuple(self.pods.values())}


class Gateway:
    def __init__(self, pg_server: PgServer, tmp: Path) -> None:
        self.url = pg_server.create_database("gw")
        upgrade_head(self.url)
        self.hosts = Hosts()
        self.plane = ControlPlaneThread(self.hosts, self.url).start()
        self.access_log = tmp / "access.log"
        self.envoy = EnvoyProcess(
            BootstrapSettings(
                node_id=f"envoy-{uuid.uuid4().hex[:6]}",
                listen_address="127.0.0.1",
                listen_port=free_port(),
                admin_port=free_port(),
                xds_host="127.0.0.1",
                xds_port=self.plane.port,
                access_log_path=str(self.access_log),
            ),
            tmp / "envoy",
        ).start()
        self.store = GatewayStore(make_engine(self.url, pool_size=2))
        # Admin URL as Envoy announced it. The ACK wait is a condition with a generous bound: after
        # restart_plane Envoy reconnects to the new control plane on its own xDS backoff, which on this
        # 2-core machine under the whole suite took over the 5 s production default once.
        self.adapter = EnvoyGateway(self.store, apply_timeout_s=30.0)

    def restart_plane(self, data_plane: DataPlaneSettings | None = None) -> None:
        self.plane.stop()
        self.plane = ControlPlaneThread(
            self.hosts, self.url, port=self.plane.port, data_plane=data_plane or DataPlaneSettings()
        ).start()

    def stop(self) -> None:
        self.envoy.stop()
        self.plane.stop()
        self.store.engine.dispose()


def _octets() -> str:
    return f"127.{random.randint(100, 250)}.{random.randint(0, 250)}"


@pytest.fixture(scope="module")
def engines() -> Iterator[list[Engine]]:
    base = _octets()
    started = [Engine(f"llama-{i}", f"{base}.{i + 1}").start() for i in range(3)]
    yield started
    for e in started:
        e.kill()


@pytest.fixture
def gw(pg_server: PgServer, tmp_path: Path, engines: list[Engine]) -> Iterator[Gateway]:
    g = Gateway(pg_server, tmp_path)
    g.hosts.set(*engines[:2])
    wait_for(lambda: {e.pod for e in g.adapter.routing_set(POOL).endpoints} == {"llama-0", "llama-1"})
    yield g
    g.stop()


def wait_for(check: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()  # type: ignore[operator]
            if last:
                return
        except httpx.HTTPError as err:
            last = err
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout_s} s (last: {last!r})")


def served_by(gw: Gateway, n: int, tier: Tier = Tier.STANDARD) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    with httpx.Client(base_url=gw.envoy.url, headers={**HOST, TIER_HEADER: tier.value}) as http:
        for _ in range(n):
            r = http.get("/v1/who")
            seen[r.json()["pod"] if r.status_code == 200 else str(r.status_code)] += 1
    return seen


def weighted(seen: collections.Counter[str], pod: str, share: float) -> bool:
    """``pod`` served ``share`` of the requests, give or take two (where a weighted schedule
    starts its schedule after a restart or an endpoint update - one may land mid-count when a control
    plane reconnects - is Envoy's business; 2:1 against 1:2 over 30 requests is 20 against 10)."""
    total = sum(seen.values())
    return set(seen) <= {"llama-0", "llama-1"} and abs(seen[pod] - share * total) <= 2.01


def config_dump(gw: Gateway) -> dict[str, object]:
    return dict(httpx.get(gw.envoy.admin_url + "/config_dump", params={"include_eds": ""}).json())


def test_weights_are_envoy_endpoint_weights_and_steer_traffic(gw: Gateway) -> None:
    applied = gw.adapter.apply(POOL, GatewayPolicy(weights={"llama-0": 3.0, "llama-1": 1.0}))
    assert applied["revision"] >= 1
    assert gw.adapter.applied(POOL, GatewayPolicy(weights={"llama-0": 3.0, "llama-1": 1.0})) is not None
    dump = json.dumps(config_dump(gw))
    assert '"load_balancing_weight": 300' in dump and '"load_balancing_weight": 100' in dump
    # Envoy drops an idle engine connection before the engine's own 5 s keep-alive would (no 503 UC
    # from a request sent on a connection the engine is closing).
    assert '"idle_timeout": "4s"' in dump, dump[:2000]
    seen = served_by(gw, 40)
    # Weighted 3:1: one request at a time, so no host has an active request and Envoy's least-request
    # pick is its weighted schedule alone.
    assert weighted(seen, "llama-0", 0.75), seen


def test_shed_tiers_are_answered_by_envoy_with_retry_after_and_a_share_of_a_tier(gw: Gateway) -> None:
    gw.adapter.apply(
        POOL,
        GatewayPolicy(admission=Admission(shed_tiers=[Tier.SHEDDABLE], partial_shed={Tier.STANDARD: 0.25})),
    )
    with httpx.Client(base_url=gw.envoy.url, headers={**HOST, TIER_HEADER: "sheddable"}) as http:
        refused = http.get("/v1/who")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
    assert "x-fleetmend-upstream" not in refused.headers  # Envoy answered; no engine saw it
    assert refused.json()["error"]["type"] == "shed"
    standard = served_by(gw, 400)
    assert 60 <= standard["429"] <= 140, standard  # a quarter of 400, by Envoy's runtime fraction
    assert served_by(gw, 50, Tier.CRITICAL)["429"] == 0  # critical is never shed

    gw.adapter.apply(POOL, GatewayPolicy())  # the gap closed: nothing refused
    assert served_by(gw, 50, Tier.SHEDDABLE)["429"] == 0
    wait_for(lambda: len(gw.adapter.request_outcomes(POOL)) == 501)  # every request, reported by Envoy
    outcomes = gw.adapter.request_outcomes(POOL)
    assert any(o.outcome == Outcome.SHED and o.tier == Tier.SHEDDABLE for o in outcomes)
    assert {o.replica for o in outcomes if o.outcome == Outcome.COMPLETED} == {"llama-0", "llama-1"}


def test_envoy_counts_the_requests_it_admits_and_not_those_it_sheds(gw: Gateway) -> None:
    """The arrival rate the recovery sheds against is Envoy's count, read from its admin /stats."""
    gw.adapter.apply(POOL, GatewayPolicy(admission=Admission(shed_tiers=[Tier.SHEDDABLE])))
    start = gw.adapter.admitted_requests(POOL)
    assert start is not None
    assert sum(served_by(gw, 12, Tier.STANDARD).values()) == 12
    assert served_by(gw, 5, Tier.SHEDDABLE)["429"] == 5
    assert gw.adapter.admitted_requests(POOL) == start + 12  # first attempts only: no shed one, no retry


def test_a_config_envoy_refuses_fails_with_its_own_words_and_nothing_is_retried_blindly(gw: Gateway) -> None:
    good = GatewayPolicy(weights={"llama-0": 2.0, "llama-1": 1.0})
    gw.adapter.apply(POOL, good)
    # A control plane whose data-plane settings break Envoy's own validation (a 0 s health-check
    # interval, forced past fleetmend's checks): every Envoy NACKs the clusters it renders.
    broken = DataPlaneSettings.model_construct(
        **{**DataPlaneSettings().model_dump(), "health_check_interval_s": 0.0}
    )
    gw.restart_plane(broken)
    # Envoy is on the broken plane once it has refused that plane's clusters for the current policy
    # (until then, a stream to the stopping plane may still take and ACK the next change).
    wait_for(lambda: any(a.nacked_version and a.connected for a in gw.store.answers()))
    change = GatewayPolicy(weights={"llama-0": 1.0, "llama-1": 2.0})
    with pytest.raises(PermanentEffectError) as refused:
        gw.adapter.apply(POOL, change)
    text = str(refused.value)
    assert "Envoy refused" in text and "Cluster" in text and "Interval" in text, text  # Envoy's own words
    assert gw.adapter.policy(POOL) == good  # put back: the change is not left half-applied
    dump = json.dumps(config_dump(gw))  # Envoy still runs the last good config
    assert '"load_balancing_weight": 200' in dump and '"load_balancing_weight": 100' in dump, dump
    seen = served_by(gw, 30)
    assert weighted(seen, "llama-0", 2 / 3), seen

    gw.restart_plane()
    assert gw.adapter.apply(POOL, change)["policy"]["weights"] == {"llama-0": 1.0, "llama-1": 2.0}
    assert weighted(served_by(gw, 30), "llama-1", 2 / 3)


def test_deroute_and_a_dead_engine_leave_the_routing_set(gw: Gateway, engines: list[Engine]) -> None:
    gw.hosts.set(engines[0])  # fleetmend removed llama-1's router label
    wait_for(lambda: [e.pod for e in gw.adapter.routing_set(POOL).endpoints] == ["llama-0"])
    assert set(served_by(gw, 10)) == {"llama-0"}

    doomed = Engine("llama-doomed", f"{_octets()}.9").start()
    gw.hosts.set(engines[0], doomed)
    wait_for(lambda: len(gw.adapter.routing_set(POOL).endpoints) == 2)
    doomed.kill()  # still in the EndpointSlice: Envoy's own health check takes it out
    wait_for(lambda: [e.pod for e in gw.adapter.routing_set(POOL).endpoints] == ["llama-0"])
    assert set(served_by(gw, 10)) == {"llama-0"}


def test_envoy_killed_and_restarted_gets_the_current_policy_back(gw: Gateway) -> None:
    policy = GatewayPolicy(
        weights={"llama-0": 1.0, "llama-1": 3.0}, admission=Admission(shed_tiers=[Tier.SHEDDABLE])
    )
    gw.adapter.apply(POOL, policy)
    gw.envoy.kill()
    gw.envoy.start()
    wait_for(lambda: gw.adapter.applied(POOL, policy) is not None)
    wait_for(lambda: len(gw.adapter.routing_set(POOL).endpoints) == 2)
    seen = served_by(gw, 40)
    assert weighted(seen, "llama-1", 0.75), seen
    assert served_by(gw, 5, Tier.SHEDDABLE)["429"] == 5


def test_a_restarted_control_plane_serves_the_same_state_and_takes_new_changes(gw: Gateway) -> None:
    gw.adapter.apply(POOL, GatewayPolicy(weights={"llama-0": 1.0, "llama-1": 1.0}))
    gw.restart_plane()
    changed = GatewayPolicy(weights={"llama-0": 1.0, "llama-1": 4.0})
    wait_for(lambda: any(a.connected for a in gw.store.answers()))
    gw.adapter.apply(POOL, changed)
    assert weighted(served_by(gw, 50), "llama-1", 0.8)


def envoy_counter(gw: Gateway, name: str) -> int:
    """One of Envoy's counters, by its exact name (admin ``/stats`` in JSON, as the adapter reads it)."""
    r = httpx.get(gw.envoy.admin_url + "/stats", params={"format": "json", "filter": f"^{re.escape(name)}$"})
    return sum(int(s.get("value") or 0) for s in r.json().get("stats", []) if s.get("name") == name)


def test_a_refused_connection_is_retried_on_another_host_never_the_same(
    gw: Gateway, engines: list[Engine]
) -> None:
    """An engine that dies between two health checks refuses connections; each request's one retry
    goes to the live engine even though the dead one carries three times its weight (a weighted
    round robin alone would hand it the retry again): Envoy's previous_hosts predicate, named by
    the route."""
    # Health checks a minute apart and fleetmend's gateway-failure ejection out of reach: until
    # Envoy's default outlier rule ejects it (consecutive_5xx, 5 refused connections) Envoy believes
    # the dead engine is fine, so only the retry can save those requests.
    gw.restart_plane(DataPlaneSettings(health_check_interval_s=60, consecutive_gateway_failure=1000))
    doomed = Engine("llama-doomed", f"{_octets()}.8").start()
    gw.hosts.set(engines[0], doomed)
    policy = GatewayPolicy(
        weights={"llama-0": 1.0, "llama-doomed": 3.0}, retry=RetryPolicy(max_attempts=2, budget_fraction=1.0)
    )
    gw.adapter.apply(POOL, policy)
    wait_for(lambda: '"load_balancing_weight": 300' in json.dumps(config_dump(gw)))
    wait_for(lambda: served_by(gw, 1) == {"llama-doomed": 1})  # its health check passed: it is routed
    doomed.kill()
    cluster = f"cluster.{POOL.key}"
    refused_before = envoy_counter(gw, f"{cluster}.upstream_cx_connect_fail")
    retried_before = envoy_counter(gw, f"{cluster}.upstream_rq_retry_success")
    seen = served_by(gw, 20)
    refused = envoy_counter(gw, f"{cluster}.upstream_cx_connect_fail") - refused_before
    retried = envoy_counter(gw, f"{cluster}.upstream_rq_retry_success") - retried_before
    assert refused >= 4, refused  # the dead engine was the first choice until it was ejected
    assert seen == {"llama-0": 20}, seen  # and every request's single retry went to the live engine
    assert retried == refused, (retried, refused)
