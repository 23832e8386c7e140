"""The ADS server Envoy dials: state-of-the-world xDS over one gRPC stream per Envoy.

Why ADS over gRPC rather than Envoy's filesystem xDS: in a cluster the Envoys and fleetmend's
workers run in different pods; with ADS every Envoy dials one Service (the control plane, two
or more replicas), gets the same snapshot from any replica (it is rebuilt from Postgres and the
Kubernetes API, never held only in memory), and reports ACK / NACK on the same stream, which is
how a refused config becomes an effect failure with Envoy's own error text.

Protocol notes (Envoy's "xDS REST and gRPC protocol" doc): a response carries a version and a
nonce; Envoy answers with the version it now runs and that nonce (ACK), or with the previous
version and ``error_detail`` (NACK). CDS is requested with no names (wildcard), EDS and RDS with
the names Envoy needs. A response is sent when a type's version differs from what this stream
last sent, or when the requested names changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import logging
import math
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.upstreams.http.v3 import (  # noqa: F401  (registers the type a cluster's Any names)
    http_protocol_options_pb2,
)
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, json_format
from google.protobuf.message import Message

from gateway.outcomes import request_row
from gateway.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    PREVIOUS_HOSTS_PREDICATE,
    ROUTE_CONFIG_NAME,
    ROUTE_TYPE,
    DataPlaneSettings,
    PoolSnapshot,
    RoutedHost,
    cluster,
    load_assignment,
    virtual_host,
)
from gateway.store import GatewayStore, StoredPolicy, version_string

log = logging.getLogger("fleetmend.xds")


def _declare_previous_hosts_predicate() -> None:
    """Declare Envoy's ``PreviousHostsPredicate`` in protobuf's default pool.

    The route's retry policy names it (a retry goes to a host this request has not tried yet), but
    ``xds-protos`` 1.85 does not ship its module. The message has no fields, so declaring it here is
    the whole of its .proto; ``json_format`` then packs ``{"@type": ...}`` like any other Envoy type.
    A release of ``xds-protos`` that ships the module is used instead.
    """
    pool = descriptor_pool.Default()
    with contextlib.suppress(ImportError):
        importlib.import_module("envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2")
    try:
        pool.FindMessageTypeByName(PREVIOUS_HOSTS_PREDICATE)
    except KeyError:
        package, _, name = PREVIOUS_HOSTS_PREDICATE.rpartition(".")
        proto = descriptor_pb2.FileDescriptorProto(
            name=package.replace(".", "/") + "/previous_hosts.proto", package=package, syntax="proto3"
        )
        proto.message_type.add(name=name)
        pool.Add(proto)


_declare_previous_hosts_predicate()

_MESSAGES: dict[str, type[Message]] = {
    CLUSTER_TYPE: cluster_pb2.Cluster,
    ENDPOINT_TYPE: endpoint_pb2.ClusterLoadAssignment,
    ROUTE_TYPE: route_pb2.RouteConfiguration,
}


@dataclass(frozen=True)
class Snapshot:
    """One consistent view: per type, its version and its resources by name (JSON form), and the
    same resources packed for the wire (built once per snapshot, not once per Envoy)."""

    versions: dict[str, str]
    resources: dict[str, dict[str, dict[str, Any]]]
    pools: tuple[PoolSnapshot, ...] = ()
    packed: dict[str, dict[str, any_pb2.Any]] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class PoolBuild:
    """One pool's Envoy resources, rendered from its routed hosts and its policy row.

    ``hosts`` and ``stored_revision`` are the inputs it was rendered from: while both stay the same
    the pool is not rendered again. ``revision`` is the policy revision it carries (0 when it runs
    the defaults, including when its stored policy could not be rendered)."""

    pool: PoolSnapshot
    hosts: tuple[RoutedHost, ...]
    stored_revision: int | None
    revision: int
    cluster: dict[str, Any]
    load_assignment: dict[str, Any]
    virtual_host: dict[str, Any]
    packed_cluster: any_pb2.Any
    packed_load_assignment: any_pb2.Any
    virtual_host_message: route_components_pb2.VirtualHost
    digests: tuple[str, str, str]  # cluster, load assignment, virtual host


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _render(candidate: PoolSnapshot, dp: DataPlaneSettings) -> tuple[Any, ...]:
    body_cluster, body_cla, body_vhost = (
        cluster(candidate, dp),
        load_assignment(candidate),
        virtual_host(candidate, dp),
    )
    return (
        body_cluster,
        body_cla,
        body_vhost,
        _packed(CLUSTER_TYPE, body_cluster),
        _packed(ENDPOINT_TYPE, body_cla),
        json_format.ParseDict(body_vhost, route_components_pb2.VirtualHost()),
    )


def render_pool(
    pool: str, hosts: tuple[RoutedHost, ...], stored: StoredPolicy | None, dp: DataPlaneSettings
) -> PoolBuild:
    """One pool's resources: its policy if it renders for Envoy, else the default policy.

    A policy that cannot even be turned into Envoy's protos is left out (the pool keeps the default
    policy) and so is its revision: no Envoy ACK can then be mistaken for having applied it, and
    the adapter waiting for it reports it as not applied.
    """
    if stored is not None:
        candidate = PoolSnapshot(pool=pool, hosts=hosts, policy=stored.policy)
        try:
            rendered = _render(candidate, dp)
        except json_format.ParseError as err:
            log.warning(
                "policy revision %s of %s cannot be rendered for Envoy: %s", stored.revision, pool, err
            )
        else:
            return _build(candidate, hosts, stored.revision, stored.revision, rendered)
    candidate = PoolSnapshot(pool=pool, hosts=hosts)
    return _build(candidate, hosts, None if stored is None else stored.revision, 0, _render(candidate, dp))


def _build(
    candidate: PoolSnapshot,
    hosts: tuple[RoutedHost, ...],
    stored: int | None,
    revision: int,
    rendered: tuple[Any, ...],
) -> PoolBuild:
    body_cluster, body_cla, body_vhost, packed_cluster, packed_cla, vhost = rendered
    return PoolBuild(
        pool=candidate,
        hosts=hosts,
        stored_revision=stored,
        revision=revision,
        cluster=body_cluster,
        load_assignment=body_cla,
        virtual_host=body_vhost,
        packed_cluster=packed_cluster,
        packed_load_assignment=packed_cla,
        virtual_host_message=vhost,
        digests=(_digest(body_cluster), _digest(body_cla), _digest(body_vhost)),
    )


def assemble(builds: dict[str, PoolBuild]) -> Snapshot:
    """The snapshot of every pool from their rendered resources: O(pools), no rendering.

    A type's version is the highest policy revision any pool carries and a digest of its resources'
    own digests, so the same pools give the same versions on any replica of the control plane."""
    ordered = [builds[name] for name in sorted(builds)]
    revision = max((b.revision for b in ordered), default=0)
    route_body = {"name": ROUTE_CONFIG_NAME, "virtual_hosts": [b.virtual_host for b in ordered]}
    route_message = route_pb2.RouteConfiguration(
        name=ROUTE_CONFIG_NAME, virtual_hosts=[b.virtual_host_message for b in ordered]
    )
    packed_route = any_pb2.Any()
    packed_route.Pack(route_message)
    resources: dict[str, dict[str, dict[str, Any]]] = {
        CLUSTER_TYPE: {b.pool.pool: b.cluster for b in ordered},
        ENDPOINT_TYPE: {b.pool.pool: b.load_assignment for b in ordered},
        ROUTE_TYPE: {ROUTE_CONFIG_NAME: route_body},
    }
    packed: dict[str, dict[str, any_pb2.Any]] = {
        CLUSTER_TYPE: {b.pool.pool: b.packed_cluster for b in ordered},
        ENDPOINT_TYPE: {b.pool.pool: b.packed_load_assignment for b in ordered},
        ROUTE_TYPE: {ROUTE_CONFIG_NAME: packed_route},
    }
    versions = {}
    for type_url, index in ((CLUSTER_TYPE, 0), (ENDPOINT_TYPE, 1), (ROUTE_TYPE, 2)):
        joined = "\n".join(f"{b.pool.pool} {b.digests[index]}" for b in ordered)
        versions[type_url] = version_string(revision, hashlib.sha256(joined.encode()).hexdigest()[:12])
    return Snapshot(
        versions=versions, resources=resources, pools=tuple(b.pool for b in ordered), packed=packed
    )


def build_snapshot(
    hosts: dict[str, tuple[RoutedHost, ...]], policies: list[StoredPolicy], dp: DataPlaneSettings
) -> Snapshot:
    """The pools Kubernetes has, each with fleetmend's policy for it (or the defaults): every pool
    rendered afresh (``ControlPlane`` renders only the pools whose inputs moved)."""
    by_pool = {p.pool: p for p in policies}
    return assemble(
        {pool: render_pool(pool, routed, by_pool.get(pool), dp) for pool, routed in hosts.items()}
    )


def _packed(type_url: str, body: dict[str, Any]) -> any_pb2.Any:
    message = json_format.ParseDict(body, _MESSAGES[type_url]())
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


@dataclass
class _TypeState:
    names: frozenset[str] | None = None  # None: wildcard
    sent_version: str | None = None
    sent_names: frozenset[str] | None = None
    nonce: str | None = None


@dataclass
class _Stream:
    node_id: str | None = None
    admin_url: str | None = None
    types: dict[str, _TypeState] = field(default_factory=dict)


class ControlPlane:
    """Holds the current snapshot, refreshes it from the world, and serves it to every Envoy.

    The snapshot is rebuilt on change only. A routing source that can say it changed (``RoutingWatch``:
    a ``version`` that moves and ``subscribe``) wakes the refresh at once, and so does a policy write
    (Postgres NOTIFY, heard on a LISTEN connection); the policies' highest revision is also checked
    with one cheap query every ``policy_check_s``, in case a notification went unheard. A source that
    cannot say (a plain callable) is read every ``refresh_s``. A rebuild renders only the pools whose
    hosts or policy revision moved and reuses every other pool's resources; the snapshot is then put
    together in O(pools) and handed to every Envoy as one consistent version.
    """

    def __init__(
        self,
        read_hosts: Callable[[], dict[str, tuple[RoutedHost, ...]]],
        store: GatewayStore,
        data_plane: DataPlaneSettings | None = None,
        refresh_s: float = 0.25,
        policy_check_s: float = 2.0,
    ) -> None:
        self._read_hosts = read_hosts
        # Open streams per Envoy node id: an Envoy that reconnects opens its new stream before the old
        # one closes, and only the last one to close makes it disconnected.
        self.envoys: Counter[str] = Counter()
        # Envoys whose last stream closed and whose disconnect is not written yet: a shutdown that
        # cancels that write (the server stops its handlers) writes it instead, so a gone Envoy is not
        # left "connected" for ENVOY_LIVENESS_S, its admin still listed for routing-set reads.
        self._disconnecting: set[str] = set()
        # Every write about an Envoy's connection (ACK, NACK, heartbeat, disconnect) goes through one
        # thread, in the order the streams made them: an ACK still being written when its stream
        # closes can no longer land after the disconnect and leave a gone Envoy "connected".
        self._envoy_writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="xds-envoys")
        self.store = store
        self.data_plane = data_plane or DataPlaneSettings()
        self.refresh_s = refresh_s
        self.policy_check_s = policy_check_s
        self.snapshot: Snapshot | None = None
        self._changed = asyncio.Condition()
        self.refresh_errors = 0
        # "ip:port" -> (pool, pod) of every host seen since start: a stream cut by a host that has
        # since left the routing set is still attributed to it when Envoy reports the request.
        self.known_hosts: dict[str, tuple[str, str]] = {}
        self.request_retention_s = 6 * 3600.0
        self._last_prune = 0.0
        self._builds: dict[str, PoolBuild] = {}
        self._unassembled = False  # a pool was rendered since the snapshot was last put together
        self._hosts_seen: dict[str, tuple[RoutedHost, ...]] | None = None
        self._routing_version: int | None = None
        self._policy_mark: tuple[int, int] | None = None
        self._policies: dict[str, StoredPolicy] = {}
        # What the refreshes did, for benches and operators: refreshes run, snapshots built, pools rendered.
        self.refreshes = 0
        self.snapshots_built = 0
        self.pools_rendered = 0

    async def refresh(self, *, check_policies: bool = True) -> Snapshot:
        """Rebuild the pools whose inputs moved (Kubernetes, Postgres); wakes every stream when a
        version moved. Nothing moved: at most one query (``check_policies``), no rendering."""
        self.refreshes += 1
        # Read before the routing set: an event between the two is seen again at the next refresh.
        version = getattr(self._read_hosts, "version", None)
        hosts = self._hosts_seen
        if (
            hosts is None
            or self.snapshot is None
            or not isinstance(version, int)
            or version != self._routing_version
        ):
            hosts = await asyncio.to_thread(self._read_hosts)
        mark = self._policy_mark
        if check_policies or mark is None:
            mark = await asyncio.to_thread(self.store.policy_mark)
        policies_moved = mark != self._policy_mark
        policies = self._policies
        if policies_moved:
            policies = {p.pool: p for p in await asyncio.to_thread(self.store.all)}
        now = time.time()
        if now - self._last_prune > 60:
            self._last_prune = now
            await asyncio.to_thread(self.store.prune_requests, now - self.request_retention_s)
        if self.snapshot is not None and hosts is self._hosts_seen and not policies_moved:
            self._routing_version = version if isinstance(version, int) else None
            return self.snapshot
        if self._rebuild(hosts, policies):
            self._unassembled = True
        # The inputs count as seen only once rendered: a refresh that failed is done again in full.
        self._hosts_seen, self._policies, self._policy_mark = hosts, policies, mark
        self._routing_version = version if isinstance(version, int) else None
        if not self._unassembled and self.snapshot is not None:
            return self.snapshot
        fresh = assemble(self._builds)
        self._unassembled = False
        self.snapshots_built += 1
        if self.snapshot is None or fresh.versions != self.snapshot.versions:
            async with self._changed:
                self.snapshot = fresh
                self._changed.notify_all()
        return self.snapshot

    def _rebuild(self, hosts: dict[str, tuple[RoutedHost, ...]], policies: dict[str, StoredPolicy]) -> bool:
        """Render the pools whose hosts or policy revision moved; True when any pool changed."""
        changed = False
        for gone in set(self._builds) - set(hosts):
            del self._builds[gone]
            changed = True
        for pool, routed in hosts.items():
            stored = policies.get(pool)
            revision = None if stored is None else stored.revision
            built = self._builds.get(pool)
            if (
                built is not None
                and built.stored_revision == revision
                and (built.hosts is routed or built.hosts == routed)
            ):
                continue
            self._builds[pool] = render_pool(pool, routed, stored, self.data_plane)
            self.pools_rendered += 1
            changed = True
            for h in routed:
                self.known_hosts[f"{h.address}:{h.port}"] = (pool, h.pod)
        if len(self.known_hosts) > 100_000:  # bound the memory: keep the newest half
            self.known_hosts = dict(list(self.known_hosts.items())[-50_000:])
        return changed

    async def run_refresh(self) -> None:
        """Refresh whenever the routing set or a policy says it changed; check the policies every
        ``policy_check_s`` and read a routing source that cannot say every ``refresh_s``."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        policy_written = False

        def routing_changed() -> None:  # on a watch thread
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(wake.set)

        def policy_changed() -> None:  # on the listening thread
            def mark() -> None:
                nonlocal policy_written
                policy_written = True
                wake.set()

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(mark)

        subscribe = getattr(self._read_hosts, "subscribe", None)
        unsubscribe = subscribe(routing_changed) if callable(subscribe) else None
        poll_s = self.refresh_s if unsubscribe is None else math.inf
        stop_listening = threading.Event()
        listener = threading.Thread(
            target=self.store.listen, args=(policy_changed, stop_listening), name="xds-policies", daemon=True
        )
        listener.start()
        next_check = 0.0
        try:
            while True:
                wake.clear()
                check = policy_written or time.monotonic() >= next_check
                if check:
                    policy_written = False
                    next_check = time.monotonic() + self.policy_check_s
                try:
                    await self.refresh(check_policies=check)
                except Exception as err:  # the API server or Postgres is away: keep serving the last snapshot
                    self.refresh_errors += 1
                    policy_written = policy_written or check  # look again at the next pass
                    if self.refresh_errors in (1, 10) or self.refresh_errors % 100 == 0:
                        log.warning("xds refresh failed (%s): serving the last snapshot", err)
                    poll = min(poll_s, self.refresh_s)
                else:
                    poll = poll_s
                timeout = max(0.0, min(poll, next_check - time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout)
        finally:
            stop_listening.set()
            if callable(unsubscribe):
                unsubscribe()
            # Its connection closes within one listening timeout: gone before the plane's store is.
            await asyncio.to_thread(listener.join, 5.0)

    async def _in_order(self, write: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(self._envoy_writes, partial(write, *args, **kwargs))

    async def run_heartbeat(self) -> None:
        """Re-mark the Envoys streaming from this control plane as connected every third of
        ``store.liveness_s``: should this process die without closing their rows, they lapse."""
        while True:
            await asyncio.sleep(self.store.liveness_s / 3)
            try:
                await self._in_order(self.store.mark, list(self.envoys), connected=True)
            except Exception as err:  # Postgres away: the next beat tries again, the rows lapse meanwhile
                log.warning("xds heartbeat failed (%s): retrying in %.0f s", err, self.store.liveness_s / 3)

    async def close_streams(self) -> None:
        """Shutting down: every Envoy streaming from here is no longer connected (it will reconnect
        to another control plane, whose ACKs mark it connected again)."""
        gone, self.envoys = [*self.envoys, *self._disconnecting], Counter()
        with contextlib.suppress(Exception):
            await self._in_order(self.store.mark, gone, connected=False)

    async def _wait_for_change(self, seen: Snapshot | None) -> Snapshot:
        async with self._changed:
            await self._changed.wait_for(lambda: self.snapshot is not None and self.snapshot is not seen)
            assert self.snapshot is not None
            return self.snapshot

    def _response(
        self, stream: _Stream, type_url: str, snap: Snapshot
    ) -> discovery_pb2.DiscoveryResponse | None:
        state = stream.types[type_url]
        named = snap.resources.get(type_url)
        if named is None:
            return None
        version = snap.versions[type_url]
        if version == state.sent_version and state.names == state.sent_names:
            return None
        wanted = named if state.names is None else {n: r for n, r in named.items() if n in state.names}
        packed = snap.packed.get(type_url, {})
        state.sent_version, state.sent_names = version, state.names
        state.nonce = uuid.uuid4().hex[:16]
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=type_url,
            nonce=state.nonce,
            resources=[
                packed[name] if name in packed else _packed(type_url, body) for name, body in wanted.items()
            ],
        )

    async def _on_request(self, stream: _Stream, req: discovery_pb2.DiscoveryRequest) -> None:
        if stream.node_id is None and req.node.id:
            stream.node_id = req.node.id
            admin = req.node.metadata.fields.get("admin_url")
            stream.admin_url = admin.string_value if admin is not None else None
            self.envoys[stream.node_id] += 1
            log.info("envoy %s connected (admin %s)", stream.node_id, stream.admin_url or "unknown")
        state = stream.types.setdefault(req.type_url, _TypeState())
        if req.response_nonce:
            if req.response_nonce != state.nonce:
                return  # an answer to a response this stream already superseded
            if stream.node_id is not None:
                if req.HasField("error_detail"):
                    log.warning(
                        "envoy %s refused %s version %s: %s",
                        stream.node_id, req.type_url, state.sent_version, req.error_detail.message,
                    )  # fmt: skip
                    await self._in_order(
                        self.store.record_answer, stream.node_id, req.type_url,
                        nacked=state.sent_version, error=req.error_detail.message, admin_url=stream.admin_url,
                    )  # fmt: skip
                else:
                    await self._in_order(
                        self.store.record_answer, stream.node_id, req.type_url, acked=req.version_info,
                        admin_url=stream.admin_url,
                    )  # fmt: skip
        names = frozenset(req.resource_names)
        state.names = None if not names or req.type_url == CLUSTER_TYPE else names

    async def stream(
        self, requests: AsyncIterator[discovery_pb2.DiscoveryRequest]
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream = _Stream()
        incoming: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

        async def read() -> None:
            try:
                async for req in requests:
                    await incoming.put(req)
            finally:
                await incoming.put(None)

        reader = asyncio.create_task(read())
        seen: Snapshot | None = None
        waits: set[asyncio.Future[Any]] = set()
        try:
            while True:
                next_request = asyncio.ensure_future(incoming.get())
                changed = asyncio.ensure_future(self._wait_for_change(seen))
                waits = {next_request, changed}
                done, _ = await asyncio.wait({next_request, changed}, return_when=asyncio.FIRST_COMPLETED)
                if next_request in done:
                    changed.cancel()
                    req = next_request.result()
                    if req is None:
                        return
                    await self._on_request(stream, req)
                    snap = self.snapshot
                    if snap is not None:
                        response = self._response(stream, req.type_url, snap)
                        if response is not None:
                            yield response
                else:
                    next_request.cancel()
                    seen = changed.result()
                    for type_url in list(stream.types):
                        response = self._response(stream, type_url, seen)
                        if response is not None:
                            yield response
        finally:
            reader.cancel()
            for wait in waits:
                wait.cancel()
            if stream.node_id is not None:
                self.envoys[stream.node_id] -= 1
                if self.envoys[stream.node_id] <= 0:
                    del self.envoys[stream.node_id]
                    log.info("envoy %s disconnected", stream.node_id)
                    self._disconnecting.add(stream.node_id)
                    with contextlib.suppress(Exception):
                        await self._in_order(self.store.mark, [stream.node_id], connected=False)
                    self._disconnecting.discard(stream.node_id)


class _AccessLogs(als_pb2_grpc.AccessLogServiceServicer):
    """Envoy's access-log service: every finished request, stored for the in-flight record."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        envoy = ""
        async for message in request_iterator:
            if message.HasField("identifier") and message.identifier.node.id:
                envoy = message.identifier.node.id
            rows = [
                row
                for entry in message.http_logs.log_entry
                if (row := request_row(entry, envoy, self._plane.known_hosts)) is not None
            ]
            if rows:
                await asyncio.to_thread(self._plane.store.add_requests, rows)
        return als_pb2.StreamAccessLogsResponse()


class _Servicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane

    async def StreamAggregatedResources(
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        async for response in self._plane.stream(request_iterator):
            yield response


async def serve(plane: ControlPlane, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the ADS server on ``host:port`` (0: a free port); returns the server and its port."""
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(_Servicer(plane), server)  # type: ignore[no-untyped-call]
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(_AccessLogs(plane), server)  # type: ignore[no-untyped-call]
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
