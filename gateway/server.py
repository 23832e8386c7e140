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
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, json_format
from google.protobuf.message import Message

from gateway.outcomes import request_row
from gateway.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    PREVIOUS_HOSTS_PREDICATE,
    ROUTE_TYPE,
    DataPlaneSettings,
    PoolSnapshot,
    RoutedHost,
    cluster,
    load_assignment,
    route_configuration,
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
    """One consistent view: per type, its version and its resources by name (JSON form)."""

    versions: dict[str, str]
    resources: dict[str, dict[str, dict[str, Any]]]
    pools: tuple[PoolSnapshot, ...] = ()


def build_snapshot(
    hosts: dict[str, tuple[RoutedHost, ...]], policies: list[StoredPolicy], dp: DataPlaneSettings
) -> Snapshot:
    """The pools Kubernetes has, each with fleetmend's policy for it (or the defaults).

    A policy that cannot even be turned into Envoy's protos is left out (the pool keeps the default
    policy) and so is its revision: no Envoy ACK can then be mistaken for having applied it, and
    the adapter waiting for it reports it as not applied.
    """
    by_pool = {p.pool: p for p in policies}
    pools: list[PoolSnapshot] = []
    revision = 0
    for pool, routed in sorted(hosts.items()):
        stored = by_pool.get(pool)
        if stored is not None:
            candidate = PoolSnapshot(pool=pool, hosts=routed, policy=stored.policy)
            try:
                _packed(CLUSTER_TYPE, cluster(candidate, dp))
                _packed(ENDPOINT_TYPE, load_assignment(candidate))
                _packed(ROUTE_TYPE, {"name": "check", "virtual_hosts": [virtual_host(candidate, dp)]})
            except json_format.ParseError as err:
                log.warning(
                    "policy revision %s of %s cannot be rendered for Envoy: %s", stored.revision, pool, err
                )
            else:
                pools.append(candidate)
                revision = max(revision, stored.revision)
                continue
        pools.append(PoolSnapshot(pool=pool, hosts=routed))
    resources: dict[str, dict[str, dict[str, Any]]] = {
        CLUSTER_TYPE: {p.pool: cluster(p, dp) for p in pools},
        ENDPOINT_TYPE: {p.pool: load_assignment(p) for p in pools},
        ROUTE_TYPE: {},
    }
    routes = route_configuration(pools, dp)
    resources[ROUTE_TYPE][str(routes["name"])] = routes
    versions = {
        type_url: version_string(
            revision, hashlib.sha256(json.dumps(named, sort_keys=True).encode()).hexdigest()[:12]
        )
        for type_url, named in resources.items()
    }
    return Snapshot(versions=versions, resources=resources, pools=tuple(pools))


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
    """Holds the current snapshot, refreshes it from the world, and serves it to every Envoy."""

    def __init__(
        self,
        read_hosts: Callable[[], dict[str, tuple[RoutedHost, ...]]],
        store: GatewayStore,
        data_plane: DataPlaneSettings | None = None,
        refresh_s: float = 0.25,
    ) -> None:
        self._read_hosts = read_hosts
        self.store = store
        self.data_plane = data_plane or DataPlaneSettings()
        self.refresh_s = refresh_s
        self.snapshot: Snapshot | None = None
        self._changed = asyncio.Condition()
        self.refresh_errors = 0
        # "ip:port" -> (pool, pod) of every host seen since start: a stream cut by a host that has
        # since left the routing set is still attributed to it when Envoy reports the request.
        self.known_hosts: dict[str, tuple[str, str]] = {}
        self.request_retention_s = 6 * 3600.0
        self._last_prune = 0.0
        self._inputs: object = None

    async def refresh(self) -> Snapshot:
        """Rebuild from Kubernetes and Postgres; wakes every stream when a version moved."""
        hosts, policies = await asyncio.gather(
            asyncio.to_thread(self._read_hosts), asyncio.to_thread(self.store.all)
        )
        # Rendering (and checking every resource against Envoy's protos) only when an input moved:
        # most refreshes see the same routing set and the same policy revisions.
        inputs = (tuple(sorted(hosts.items())), tuple(sorted((p.pool, p.revision) for p in policies)))
        now = time.time()
        if now - self._last_prune > 60:
            self._last_prune = now
            await asyncio.to_thread(self.store.prune_requests, now - self.request_retention_s)
        if self.snapshot is not None and inputs == self._inputs:
            return self.snapshot
        self._inputs = inputs
        fresh = build_snapshot(hosts, policies, self.data_plane)
        for pool in fresh.pools:
            for h in pool.hosts:
                self.known_hosts[f"{h.address}:{h.port}"] = (pool.pool, h.pod)
        if len(self.known_hosts) > 100_000:  # bound the memory: keep the newest half
            self.known_hosts = dict(list(self.known_hosts.items())[-50_000:])
        if self.snapshot is None or fresh.versions != self.snapshot.versions:
            async with self._changed:
                self.snapshot = fresh
                self._changed.notify_all()
        return self.snapshot

    async def run_refresh(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as err:  # the API server or Postgres is away: keep serving the last snapshot
                self.refresh_errors += 1
                if self.refresh_errors in (1, 10) or self.refresh_errors % 100 == 0:
                    log.warning("xds refresh failed (%s): serving the last snapshot", err)
            await asyncio.sleep(self.refresh_s)

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
        state.sent_version, state.sent_names = version, state.names
        state.nonce = uuid.uuid4().hex[:16]
        return discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=type_url,
            nonce=state.nonce,
            resources=[_packed(type_url, body) for body in wanted.values()],
        )

    async def _on_request(self, stream: _Stream, req: discovery_pb2.DiscoveryRequest) -> None:
        if stream.node_id is None and req.node.id:
            stream.node_id = req.node.id
            admin = req.node.metadata.fields.get("admin_url")
            stream.admin_url = admin.string_value if admin is not None else None
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
                    await asyncio.to_thread(
                        self.store.record_answer, stream.node_id, req.type_url,
                        nacked=state.sent_version, error=req.error_detail.message, admin_url=stream.admin_url,
                    )  # fmt: skip
                else:
                    await asyncio.to_thread(
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
                log.info("envoy %s disconnected", stream.node_id)
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.store.mark_connected, stream.node_id, False)


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
