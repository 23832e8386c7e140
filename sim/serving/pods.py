"""Every engine's own HTTP server, on its pod's IP, as vLLM's API server listens in a cluster.

While a replica's engine process runs (``EngineSupervisor.process_up``: from the end of
the weight load until the process exits), a real socket listens on
``{status.podIP}:{engine_port}`` and serves, for that engine only:

* ``POST /v1/completions`` — OpenAI completions; ``stream: true`` answers an SSE stream
  of ``data: {...}`` chunks ending ``data: [DONE]``, as vLLM does. The sim's body
  extensions ``prompt_tokens`` / ``output_tokens`` set simulated lengths (a real vLLM
  ignores unknown fields); otherwise the prompt's words and ``max_tokens`` do.
* ``GET /v1/models``, ``GET /metrics`` (vLLM's Prometheus text), ``GET /health``
  (200, or 503/500 once the engine is dead, by version).
* ``X-Request-Id`` is echoed on every answer.

Refusals answer as vLLM's ``ErrorResponse`` JSON: 400 bad body, 404 unknown model, 503
while the engine drains after SIGTERM (``--shutdown-timeout``: in-flight streams finish),
503 (500 before v0.11) from a dead engine whose server lingers (launcher watchdog). A
stream whose engine dies while its server still runs ends as vLLM's generator ends it:
an error chunk, then ``[DONE]``.

When the process is gone (node lost, OOM kill, exit after SIGTERM, the watchdog's exit,
pod deleted, container replaced) the server behaves like a dead process: the listening
socket closes (new connections are refused) and every open connection is aborted, so an
in-flight stream ends mid-body without ``[DONE]``. A restarted container listens again
on the same pod IP once its engine has loaded.

Design: one ASGI app shared by every socket picks the engine by the socket's local
address (``scope["server"]``); each pod socket is a plain ``asyncio`` server running
uvicorn's HTTP protocol (no ``uvicorn.Server`` per pod: no per-pod main loop), opened
and closed by the serving layer's tick (``EngineServers.sync``). Cost per pod: one
listening file descriptor and a few KB (``bench/engine_servers.py`` prints figures).

Health checks and scrapes are answered cheaply: a connection starts on a small protocol
(``_FastConnection``) that answers ``GET``/``HEAD /health`` and ``GET /metrics`` itself (the same
status, headers and body the app gives), with no HTTP framework per request. A gateway health-checks
every engine twice a second over kept-alive connections, so at fleet size these are nearly all the
requests the engines see. Any other request hands the connection to uvicorn for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from uvicorn.server import ServerState

from sim.serving.engine import Engine, EngineRefused, EngineRequest, EngineState
from sim.serving.streams import (
    StreamEvent,
    TokenStream,
    collect,
    completion_body,
    error_body,
    sse,
    sse_chunks,
)

if TYPE_CHECKING:
    from sim.serving.layer import ServingLayer

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROMETHEUS_TEXT = b"text/plain; version=0.0.4; charset=utf-8"
BACKLOG = 128
_REASONS = {200: b"OK", 500: b"Internal Server Error", 503: b"Service Unavailable"}
_MAX_HEAD = 16384  # a request head longer than this goes to uvicorn (which answers as it does)


class CompletionRequest(BaseModel):
    """OpenAI ``/v1/completions`` body as the engine reads it, plus the simulator's extensions
    ``prompt_tokens`` / ``output_tokens`` (simulated lengths; a real vLLM ignores unknown fields)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    prompt: str | list[str] = ""
    max_tokens: int = Field(default=16, ge=1, le=4096)
    stream: bool = False
    request_id: str | None = Field(default=None, min_length=1, max_length=200)
    prompt_tokens: int | None = Field(default=None, ge=1, le=1_000_000, description="simulated prompt length")
    output_tokens: int | None = Field(
        default=None, ge=1, le=4096, description="tokens the model will produce"
    )
    priority: int = Field(default=0, description="vLLM's request priority (lower first; --scheduling-policy)")


@dataclass(eq=False)
class _PodServer:
    replica: str
    address: str
    engine: Engine
    sock: socket.socket
    state: ServerState
    task: asyncio.Task[asyncio.Server] | None = None
    server: asyncio.Server | None = None
    opened_at: float = field(default_factory=time.monotonic)

    def close(self) -> int:
        """Stop listening and abort every connection, as a dying process does; returns how many were cut."""
        if self.server is not None:
            self.server.close()
        else:
            if self.task is not None:
                self.task.cancel()
            with contextlib.suppress(OSError):
                self.sock.close()
        cut = 0
        for protocol in list(self.state.connections):
            transport = getattr(protocol, "transport", None)
            if transport is not None and not transport.is_closing():
                transport.abort()
                cut += 1
        return cut


class _FastConnection(asyncio.Protocol):
    """One connection to an engine's socket. Answers health checks and scrapes itself; the first
    request it does not answer (a completion, a body, HTTP/1.0, a pipelined mix) and everything
    after it on this connection go to uvicorn's protocol, which takes the transport over."""

    __slots__ = ("buffer", "host", "make_inner", "servers", "state", "transport")

    def __init__(
        self, servers: EngineServers, state: ServerState, make_inner: Callable[[], asyncio.Protocol]
    ) -> None:
        self.servers = servers
        self.state = state
        self.make_inner = make_inner
        self.transport: asyncio.Transport | None = None
        self.host = ""
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sockname = transport.get_extra_info("sockname")
        self.host = sockname[0] if sockname else ""
        self.state.connections.add(self)  # type: ignore[arg-type]  # cut like uvicorn's when the process dies

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if transport is None:
            return
        buffer = self.buffer + data if self.buffer else data
        while buffer:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > _MAX_HEAD:
                    self._hand_over(buffer)
                else:
                    self.buffer = buffer
                return
            answer = self.servers.answer_quickly(self.host, buffer[:end])
            if answer is None:
                self._hand_over(buffer)
                return
            response, close = answer
            transport.write(response)
            buffer = buffer[end + 4 :]
            if close:
                transport.close()
                self.buffer = b""
                return
        self.buffer = b""

    def _hand_over(self, buffer: bytes) -> None:
        transport = self.transport
        assert transport is not None
        self.buffer = b""
        self.state.connections.discard(self)  # type: ignore[arg-type]
        inner = self.make_inner()
        transport.set_protocol(inner)
        inner.connection_made(transport)
        inner.data_received(buffer)  # type: ignore[attr-defined]


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Lift the soft RLIMIT_NOFILE towards the hard limit: every pod socket and every connection to it
    is a file descriptor of this one process (a default soft limit of 1024 would cap the fleet)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class EngineServers:
    """The pod-IP servers of one serving layer, kept in step with the running engine processes."""

    def __init__(self, layer: ServingLayer, port: int) -> None:
        raise_open_file_limit()
        self.layer = layer
        self.port = port
        self._servers: dict[str, _PodServer] = {}
        self._by_address: dict[str, str] = {}
        self._bind_failures: dict[str, str] = {}
        self.config = uvicorn.Config(
            self.app,
            interface="asgi3",
            lifespan="off",
            log_level="warning",
            access_log=False,
            http="h11",
            proxy_headers=False,
        )
        self.config.load()
        self.opened = 0
        self.closed = 0
        self.connections_cut = 0
        # Requests answered, by "METHOD path" and by (path, User-Agent): who reached the engines.
        self.served: Counter[str] = Counter()
        self.served_to: Counter[tuple[str, str]] = Counter()
        self.on_request: Callable[[], None] = lambda: None  # an engine took a request: tick it

    # ---- what is listening ---------------------------------------------------------------
    def address_of(self, replica: str) -> str | None:
        """``ip:port`` the replica's engine listens on now, or None."""
        server = self._servers.get(replica)
        return f"{server.address}:{self.port}" if server is not None else None

    def listening(self) -> dict[str, str]:
        return {key: f"{s.address}:{self.port}" for key, s in self._servers.items()}

    def sync(self) -> None:
        """Open a server for every engine process that runs, close the ones whose process is gone."""
        supervisor = self.layer.supervisor
        engines = supervisor.engines()
        for key, server in list(self._servers.items()):
            if engines.get(key) is not server.engine or not supervisor.process_up(key):
                self.close(key)
        for key, engine in engines.items():
            if key in self._servers or not supervisor.process_up(key):
                continue
            address = self._pod_ip(key)
            if address:
                self._open(key, address, engine)

    def _pod_ip(self, key: str) -> str | None:
        ns, name = key.split("/", 1)
        pod = self.layer.kube.pod(ns, name)
        return (pod.get("status") or {}).get("podIP") if pod is not None else None

    def _open(self, key: str, address: str, engine: Engine) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, self.port))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            message = f"engine of {key} cannot listen on {address}:{self.port}: {exc}"
            if self._bind_failures.get(key) != message:
                self._bind_failures[key] = message
                log.error("%s (another process holds the address?)", message)
            return
        self._bind_failures.pop(key, None)
        loop = asyncio.get_running_loop()
        state = ServerState()
        state.default_headers = [(b"server", b"uvicorn")]
        config = self.config

        def inner() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state={}, _loop=loop
            )

        def protocol() -> asyncio.Protocol:
            return _FastConnection(self, state, inner)

        server = _PodServer(key, address, engine, sock, state)
        server.task = loop.create_task(loop.create_server(protocol, sock=sock, backlog=BACKLOG))
        server.task.add_done_callback(partial(self._started, server))
        self._servers[key] = server
        self._by_address[address] = key
        self.opened += 1

    def _started(self, server: _PodServer, task: asyncio.Task[asyncio.Server]) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("engine server of %s did not start: %s", server.replica, task.exception())
            return
        server.server = task.result()
        if self._servers.get(server.replica) is not server:  # closed while starting
            server.server.close()

    def close(self, replica: str) -> None:
        server = self._servers.pop(replica, None)
        if server is None:
            return
        if self._by_address.get(server.address) == replica:
            del self._by_address[server.address]
        self.connections_cut += server.close()
        self.closed += 1

    async def aclose(self) -> None:
        for key in list(self._servers):
            self.close(key)
        await asyncio.sleep(0)

    # ---- health checks and scrapes, without the app ---------------------------------------------
    def answer_quickly(self, host: str, head: bytes) -> tuple[bytes, bool] | None:
        """The whole response to a request ``head`` (request line and headers) that is a health check
        or a scrape of a live engine, and whether to close the connection after it; None for any other
        request (the app answers it)."""
        line_end = head.find(b"\r\n")
        request_line = head if line_end < 0 else head[:line_end]
        parts = request_line.split(b" ")
        if len(parts) != 3 or parts[2] != b"HTTP/1.1":
            return None
        method, path = parts[0], parts[1]
        if not (path == b"/health" and method in (b"GET", b"HEAD")) and not (
            path == b"/metrics" and method == b"GET"
        ):
            return None
        key = self._by_address.get(host)
        server = self._servers.get(key) if key is not None else None
        if server is None:
            return None
        if path == b"/metrics" and self.layer.supervisor.sticky.get(server.replica, {}).get(
            "metrics_delay_s"
        ):
            return None  # the slow-metrics fault: the app answers, late
        user_agent = request_id = ""
        close = False
        if line_end >= 0:
            for header in head[line_end + 2 :].split(b"\r\n"):
                name, _, value = header.partition(b":")
                name = name.strip().lower()
                if name == b"user-agent":
                    user_agent = value.strip().decode("latin-1")
                elif name == b"x-request-id":
                    request_id = value.strip().decode("latin-1")
                elif name == b"connection":
                    close = b"close" in value.lower()
                elif name in (b"content-length", b"transfer-encoding", b"expect", b"upgrade"):
                    if name != b"content-length" or value.strip() != b"0":
                        return None
        text_path = path.decode()
        self.served[f"{method.decode()} {text_path}"] += 1
        self.served_to[(text_path, user_agent)] += 1
        engine = server.engine
        if path == b"/health":
            status, body, content_type = engine.health_status(), b"", b"application/json"
        else:
            status, body, content_type = 200, engine.render_metrics(), PROMETHEUS_TEXT
        head_out = [
            b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"")),
            b"server: uvicorn",
            b"content-type: " + content_type,
        ]
        if request_id:
            head_out.append(b"x-request-id: " + request_id.encode("latin-1", "replace"))
        head_out.append(b"content-length: %d" % len(body))
        if close:
            head_out.append(b"connection: close")
        response = b"\r\n".join(head_out) + b"\r\n\r\n"
        return (response if method == b"HEAD" else response + body), close

    # ---- the shared ASGI app ------------------------------------------------------------------
    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        host = (scope.get("server") or ("", 0))[0]
        key = self._by_address.get(host)
        server = self._servers.get(key) if key is not None else None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        request_id = headers.get("x-request-id")
        reply = _Reply(send, request_id)
        if server is None:  # the process is exiting: it no longer answers
            await reply.json(503, error_body(503, "ServiceUnavailableError", "the server is shutting down"))
            return
        engine = server.engine
        method, path = scope["method"], scope["path"]
        self.served[f"{method} {path}"] += 1
        self.served_to[(path, headers.get("user-agent", ""))] += 1
        if path == "/health" and method in ("GET", "HEAD"):
            await reply.raw(engine.health_status(), b"", b"application/json")
        elif path == "/metrics" and method == "GET":
            delay = self.layer.supervisor.sticky.get(server.replica, {}).get("metrics_delay_s")
            if delay:  # the slow-metrics fault: a server too busy to answer its scrapes in time
                await asyncio.sleep(delay)
            await reply.raw(200, engine.render_metrics(), PROMETHEUS_TEXT)
        elif path == "/v1/models" and method == "GET":
            await reply.json(200, self._models(engine))
        elif path == "/v1/completions" and method == "POST":
            await self._completions(server, receive, reply, request_id)
        elif path in ("/health", "/metrics", "/v1/models", "/v1/completions"):
            await reply.json(405, {"detail": "Method Not Allowed"})
        else:
            await reply.json(404, {"detail": "Not Found"})

    @staticmethod
    def _served_names(engine: Engine) -> list[str]:
        """vLLM ``--served-model-name``: the metrics name first, then the model's own name."""
        names = [engine.metrics_model_name]
        if engine.model_name not in names:
            names.append(engine.model_name)
        return names

    def _models(self, engine: Engine) -> dict[str, Any]:
        created = int(time.time())
        root = self._served_names(engine)[0]
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root}
                for name in self._served_names(engine)
            ],
        }

    async def _completions(
        self, server: _PodServer, receive: Receive, reply: _Reply, header_request_id: str | None
    ) -> None:
        engine = server.engine
        clock = self.layer.clock
        raw = await _read_body(receive)
        if raw is None:
            return  # the client went away before it finished sending
        try:
            body = CompletionRequest.model_validate(json.loads(raw or b"null"))
        except (ValueError, ValidationError) as exc:
            await reply.json(400, error_body(400, "BadRequestError", f"invalid completion request: {exc}"))
            return
        if body.model not in self._served_names(engine):
            message = f"The model `{body.model}` does not exist."
            await reply.json(404, error_body(404, "NotFoundError", message))
            return
        if body.priority != 0 and engine.spec.scheduling_policy != "priority":
            message = f"Got priority {body.priority} but Priority scheduling is not enabled."  # vLLM's words
            await reply.json(400, error_body(400, "BadRequestError", message))
            return
        request_id = header_request_id or body.request_id or f"cmpl-{uuid.uuid4().hex[:16]}"
        reply.request_id = request_id
        prompt_tokens = body.prompt_tokens or max(1, len(str(body.prompt).split()))
        output_tokens = min(body.output_tokens or body.max_tokens, body.max_tokens)
        stream = TokenStream()
        ereq = EngineRequest(
            request_id, prompt_tokens, output_tokens, body.max_tokens, stream, priority=body.priority
        )
        try:
            engine.submit(ereq, clock.now())
            self.on_request()
        except EngineRefused as refused:
            if engine.state is EngineState.DEAD:
                status = engine.health_status()
                await reply.json(status, error_body(status, "EngineDeadError", refused.message))
            else:
                await reply.json(503, error_body(503, "ServiceUnavailableError", refused.message))
            return
        # The model proposes its effect (if any) as it starts the request: a request the gateway
        # retries here from a failed replica proposes the same operation again (sim.serving.effects).
        await self.layer.effects.propose(request_id)
        events = stream.events(clock, engine, ereq, interval_s=self.layer.settings.stream_interval_s)

        def on_error(event: StreamEvent) -> bytes | None:
            if not self.layer.supervisor.process_up(server.replica):
                self.close(server.replica)  # the process is gone: cut every connection, send nothing
                return None
            # The engine died under a server that still runs: vLLM's generator ends the stream so.
            return sse(error_body(500, "EngineDeadError", event.message)) + sse(b"[DONE]")

        if body.stream:
            await reply.stream(sse_chunks(request_id, body.model, events, 0, on_error), receive)
            return
        tokens, finish, error = await collect(events)
        if error is not None:
            if not self.layer.supervisor.process_up(server.replica):
                self.close(server.replica)
                return
            await reply.json(500, error_body(500, "EngineDeadError", error.message))
            return
        await reply.json(200, completion_body(request_id, body.model, tokens, finish, prompt_tokens))


class _Reply:
    """Minimal ASGI responses (the app is on every engine socket: no framework per request)."""

    def __init__(self, send: Send, request_id: str | None) -> None:
        self._send = send
        self.request_id = request_id

    def _headers(self, content_type: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> list[Any]:
        out = [(b"content-type", content_type)]
        if self.request_id:
            out.append((b"x-request-id", self.request_id.encode("latin-1", "replace")))
        return out + (extra or [])

    async def raw(self, status: int, body: bytes, content_type: bytes) -> None:
        headers = self._headers(content_type, [(b"content-length", str(len(body)).encode())])
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    async def json(self, status: int, payload: Any) -> None:
        await self.raw(status, json.dumps(payload).encode(), b"application/json")

    async def stream(self, chunks: Any, receive: Receive) -> None:
        """Send ``chunks`` as they come; a client that disconnects stops the stream (and so aborts
        the engine request, as vLLM aborts a request whose client went away)."""
        headers = self._headers(b"text/event-stream; charset=utf-8", [(b"cache-control", b"no-cache")])
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            try:
                async for chunk in chunks:
                    await self._send({"type": "http.response.body", "body": chunk, "more_body": True})
                await self._send({"type": "http.response.body", "body": b""})
            finally:
                await chunks.aclose()

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({sending, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, watching):
                task.cancel()
            for task in (sending, watching):
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def _read_body(receive: Receive) -> bytes | None:
    """The request body; None if the client disconnected first."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts)
