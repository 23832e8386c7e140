"""The simulator's HTTP servers: the Kubernetes API over TLS, and plain HTTP for everything else.

``build_kube_app(world, kube)`` is the API server (HTTPS, its own port, like a real
kube-apiserver): ``/version``, ``/healthz``, ``/livez``, ``/readyz``, ``/api``, ``/apis``,
``/openapi/v2``, ``/openapi/v3``; bearer token required (see ``sim.k8s.api``). It writes every
request to the audit log (``sim.k8s.audit``) and every mutation to the action log.

``build_app(world)`` is the rest of the world on plain HTTP (what in production are other
services: the gateway's admin API, the engines' metrics, the incident channel):

* ``GET  /sim/v1/clock`` -> ``sim.control.ClockReading``;
  ``POST /sim/v1/clock/advance`` ``{"seconds": S}`` jumps sim time ahead;
* ``GET  /sim/v1/actions?since_seq=N`` -> ``list[fleet.actionlog.ActionLogEntry]``: every
  mutating request (POST/PUT/PATCH/DELETE) either server received, on any path but inference
  (the Kubernetes API's own record is its audit log; this one is the simulator's, for tests);
* ``GET|PUT /sim/v1/api-faults`` ``{"rules": [ApiFaultRule...]}``: error rates on chosen verbs;
* ``POST /sim/v1/nodes/{node}/lose`` and ``/restore``: node loss on demand;
* ``POST /sim/v1/api-server/restart`` ``{"down_s": S}``: the API server restarts (open connections
  reset, refused for S s, then a fresh watch cache: old resourceVersions get 410);
  ``GET /sim/v1/api-server`` -> ``ApiServerState``;
* whatever ``sim.serving.attach(world, app)`` adds (engines' metrics, faults, load, notify),
  when the ``sim.serving`` package is installed.

``serve(world, host, port, kube_port=...)`` runs both with uvicorn on the current loop, with the
world's controllers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import logging
import tempfile
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Query
from pydantic import BaseModel, ConfigDict, Field

from fleet.actionlog import ActionLogEntry
from sim.actionlog import MUTATING_VERBS
from sim.control import ClockReading
from sim.k8s.api import KubeApi
from sim.k8s.api import build_kube_app as build_kube_routes
from sim.k8s.apiserver import IDLE_KEEPALIVE_S, KubeApiServer
from sim.k8s.audit import AuditLog, AuditMiddleware, User
from sim.k8s.faults import ApiFaultRuleSet, ApiServerRestart, ApiServerState
from sim.k8s.tls import ServingCerts, generate_serving_certs
from sim.world import SimWorld

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# Inference traffic is the data plane, not an action on the world: it stays out of the action log.
DATA_PLANE_PATHS = ("/v1/completions", "/v1/chat/completions")


class ActionLogMiddleware:
    """Records every mutating HTTP request (after it was answered) in ``world.actions``.

    Everything except inference requests (``DATA_PLANE_PATHS``): Kubernetes writes, faults,
    load and gateway settings, notifications, Jira issues. Callers may name themselves with an
    ``X-Fleetmend-Client`` header (e.g. the workflow and step); otherwise the User-Agent is used.
    """

    def __init__(
        self,
        app: ASGIApp,
        world: SimWorld,
        authenticate: Callable[[dict[str, str]], User | None] | None = None,
    ) -> None:
        self.app = app
        self.world = world
        self.authenticate = authenticate  # the API server's (ServiceAccounts too); else the admin token only

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in MUTATING_VERBS
            or scope["path"] in DATA_PLANE_PATHS
        ):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        status = {"code": 500}

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope.get("headers", [])}
            self.world.actions.record(
                time=self.world.clock.now(),
                verb=scope["method"],
                path=scope["path"]
                + (f"?{scope['query_string'].decode()}" if scope.get("query_string") else ""),
                body=b"".join(chunks),
                client=client_identity(headers, self.world.token, self.authenticate),
                status=status["code"],
            )


def client_identity(
    headers: dict[str, str], token: str, authenticate: Callable[[dict[str, str]], User | None] | None = None
) -> str:
    """Who sent a request: the user its token names (the kubeconfig's admin, a ServiceAccount), plus
    the user agent."""
    agent = headers.get("x-fleetmend-client") or headers.get("user-agent", "unknown")
    known = authenticate(headers) if authenticate is not None else None
    if known is not None:
        return f"{known.username}/{agent}"
    user = "sim-admin" if headers.get("authorization") == f"Bearer {token}" else "anonymous"
    return f"{user}/{agent}"


def build_kube_app(world: SimWorld, kube: KubeApi, audit: AuditLog) -> ASGIApp:
    """The Kubernetes API server app, audited and action-logged."""
    app: ASGIApp = build_kube_routes(kube)
    app = ActionLogMiddleware(app, world, kube.authenticate)
    return AuditMiddleware(app, audit, world.clock, kube.authenticate)


class ClockAdvance(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seconds: float = Field(gt=0, le=7 * 24 * 3600)


def build_app(world: SimWorld, *, serving: bool = True, api_server: KubeApiServer | None = None) -> FastAPI:
    """The whole simulator as one ASGI app (see the module docstring for the routes).

    ``serving=False`` leaves the serving layer out (the Kubernetes semantics alone: no
    engines drain and exit on SIGTERM, so terminating pods last their full grace period).
    ``api_server``: the API server the restart fault acts on (none: that route answers 404).
    """
    app = FastAPI(
        title="fleetmend simulator",
        description="Simulated GPU inference cluster",
        docs_url="/sim/docs",
        openapi_url="/sim/openapi.json",
    )
    app.state.world = world

    @app.get("/sim/v1/clock", response_model=ClockReading)
    async def clock() -> ClockReading:
        return ClockReading(now=world.clock.now(), speed=world.clock.speed)

    @app.post("/sim/v1/clock/advance", response_model=ClockReading)
    async def advance(body: ClockAdvance) -> ClockReading:
        world.clock.advance(body.seconds)
        world.kick()
        return ClockReading(now=world.clock.now(), speed=world.clock.speed)

    @app.get("/sim/v1/actions", response_model=list[ActionLogEntry])
    async def actions(since_seq: int = Query(0, ge=0)) -> list[ActionLogEntry]:
        return world.actions.since(since_seq)

    @app.get("/sim/v1/api-faults", response_model=ApiFaultRuleSet)
    async def get_api_faults() -> ApiFaultRuleSet:
        return ApiFaultRuleSet(rules=world.api_faults.rules())

    @app.put("/sim/v1/api-faults", response_model=ApiFaultRuleSet)
    async def put_api_faults(body: ApiFaultRuleSet) -> ApiFaultRuleSet:
        world.api_faults.set_rules(body.rules)
        return body

    @app.post("/sim/v1/nodes/{node}/lose", status_code=202)
    async def lose(node: str, partition: bool = False) -> dict[str, str]:
        """The node is lost; ``?partition=true``: to the API server only (its engines keep serving)."""
        try:
            world.lose_node(node, partition=partition)
        except KeyError as exc:
            raise HTTPException(404, f"no node named {node!r}; list nodes with GET /api/v1/nodes") from exc
        return {"node": node, "state": "partitioned" if partition else "lost"}

    @app.post("/sim/v1/nodes/{node}/restore", status_code=202)
    async def restore(node: str) -> dict[str, str]:
        world.restore_node(node)
        return {"node": node, "state": "restored"}

    add_api_server_routes(app, api_server)
    if serving:
        attach_serving_layer(world, app)
    app.add_middleware(ActionLogMiddleware, world=world)
    return app


def add_api_server_routes(app: FastAPI, api_server: KubeApiServer | None) -> None:
    """The API server restart fault (``sim.k8s.apiserver``) and its state."""

    def running() -> KubeApiServer:
        if api_server is None:
            raise HTTPException(404, "this simulator app serves no API server to restart (see sim.app.serve)")
        return api_server

    @app.get("/sim/v1/api-server", response_model=ApiServerState)
    async def api_server_state() -> ApiServerState:
        return running().state()

    @app.post("/sim/v1/api-server/restart", status_code=202, response_model=ApiServerState)
    async def restart_api_server(body: ApiServerRestart) -> ApiServerState:
        server = running()
        if not server.restart(body.down_s):
            raise HTTPException(
                409, "the API server is already restarting; wait until GET /sim/v1/api-server says serving"
            )
        return server.state()


def attach_serving_layer(world: SimWorld, app: FastAPI) -> bool:
    """Let ``sim.serving`` (engines, load, faults) add its routes, if it is present."""
    if importlib.util.find_spec("sim.serving") is None:
        return False
    serving = importlib.import_module("sim.serving")
    attach = getattr(serving, "attach", None)
    if attach is None:
        log.warning("sim.serving has no attach(world, app); serving layer not attached")
        return False
    attach(world, app)
    return True


@dataclass(frozen=True)
class BoundPorts:
    """Where the two servers listen (the real ports when 0 was asked for)."""

    port: int  # plain HTTP: simulator control, engines' metrics, notify
    kube_port: int  # HTTPS: the Kubernetes API


async def serve(
    world: SimWorld,
    host: str = "127.0.0.1",
    port: int = 8480,
    *,
    kube_port: int = 0,
    certs: ServingCerts | None = None,
    audit_log: Path | None = None,
    ready: Callable[[BoundPorts], None] | None = None,
    stop: asyncio.Event | None = None,
    serving: bool = True,
) -> None:
    """Run both servers and the world's controllers on this loop until ``stop`` is set (or cancelled).

    ``certs``: the API server's CA and serving certificate (generated in a temporary directory when
    not given). ``audit_log``: where the API server writes its audit events (none: not written).
    ``ready(BoundPorts)`` is called once both sockets listen.
    Shutdown is graceful: open watches end, the app's lifespan (and the serving layer's) completes.
    """
    scratch = None
    if certs is None:
        scratch = tempfile.TemporaryDirectory(prefix="fleetmend-sim-pki-")
        certs = generate_serving_certs(Path(scratch.name))
    kube = KubeApi(world.control, world.api_faults, world.token)
    kube.watches.bind(asyncio.get_running_loop())
    audit = AuditLog(audit_log)
    world.audit = audit
    api_server = KubeApiServer(
        build_kube_app(world, kube, audit), kube.watches, host=host, port=kube_port, certs=certs
    )
    app = build_app(world, serving=serving, api_server=api_server)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=IDLE_KEEPALIVE_S,
    )
    server = uvicorn.Server(config)
    world.start()
    serve_task = asyncio.create_task(server.serve())
    kube_ended = asyncio.create_task(api_server.wait())
    tasks = {serve_task, kube_ended}
    try:
        bound_kube_port = await api_server.start()
        while not server.started:
            if serve_task.done():
                await serve_task  # re-raises the bind error
                raise RuntimeError(f"the simulator's HTTP server could not listen on {host}:{port}")
            await asyncio.sleep(0.01)
        bound = BoundPorts(port=server.servers[0].sockets[0].getsockname()[1], kube_port=bound_kube_port)
        if ready is not None:
            ready(bound)
        waiters: set[asyncio.Future[Any]] = set(tasks)
        stopper = asyncio.create_task(stop.wait()) if stop is not None else None
        if stopper is not None:
            waiters.add(stopper)
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if stopper is not None:
            stopper.cancel()
    finally:
        kube_ended.cancel()
        server.should_exit = True
        await api_server.stop()
        if not serve_task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(serve_task), timeout=5)
        await world.stop()
        audit.close()
        if scratch is not None:
            scratch.cleanup()
