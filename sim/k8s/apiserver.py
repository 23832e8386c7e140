"""The simulated API server's listener: serve over TLS, and restart as a real kube-apiserver does.

A kube-apiserver that restarts (a crash, an upgrade, its control-plane node rebooting) looks like
this to every client: each open connection is reset at once (a watch breaks mid-stream, with no
clean end of the chunked body), new connections are refused until the new process listens, and the
new process serves from a fresh watch cache initialised at the current revision, so a watch that
resumes from an older resourceVersion gets ``410 Expired`` ("too old resource version") and the
client must re-list. ``KubeApiServer.restart(down_s)`` does exactly that; the world behind it
(the store, controllers, kubelets) keeps changing meanwhile, as a cluster does behind one
unreachable API server.

The port stays reserved through the outage by a bound socket that does not listen (both carry
``SO_REUSEPORT``): no other program can take the port meanwhile, and the kernel answers a
connection attempt with a reset, i.e. ``ECONNREFUSED``, as for any port nobody listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from sim.k8s.faults import ApiServerState
from sim.k8s.tls import ServingCerts
from sim.k8s.watch import WatchHub

log = logging.getLogger(__name__)

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]

# How long an idle client connection stays open. Longer than any client's own keep-alive expiry
# (httpx drops idle connections after 5 s; urllib3 keeps them until the server closes), so a
# client never sends on a connection the server is closing in that same instant. uvicorn's
# default, 5 s, equals httpx's and loses that race now and then ("Server disconnected without
# sending a response"). Used by the sim's control app as well.
IDLE_KEEPALIVE_S = 75


def _reserve(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` that may share the port with the other incarnation."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP. Without it a
    # response's body waited ~40 ms for the client's delayed ACK of its headers, on every request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _reset(connection: Any) -> None:
    """Drop a connection with a TCP reset (SO_LINGER 0), as a dying process's sockets go."""
    transport = getattr(connection, "transport", None)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class KubeApiServer:
    """The API server app on its HTTPS port; ``restart`` takes it down and brings it back."""

    def __init__(self, app: ASGIApp, watches: WatchHub, *, host: str, port: int, certs: ServingCerts) -> None:
        self._app = app
        self._watches = watches
        self.host = host
        self._requested_port = port
        self._certs = certs
        self.port = 0
        self.restarts = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._stopping = False
        self._ended = asyncio.Event()  # the server stopped serving for good (not a restart)

    def state(self) -> ApiServerState:
        return ApiServerState(
            serving=self.serving,
            restarts=self.restarts,
            open_watches=self._watches.open_streams,
            watch_cache_starts_at=self._watches.cache_start,
        )

    @property
    def serving(self) -> bool:
        return self._server is not None and self._server.started and not self._server.should_exit

    async def start(self) -> int:
        """Listen and serve; returns the bound port.

        The port is first bound without ``SO_REUSEPORT``, so a port another program (or another
        simulator) holds is refused here as "address already in use" rather than shared."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((self.host, self._requested_port))
            self.port = probe.getsockname()[1]
        await self._serve_on(_reserve(self.host, self.port))
        return self.port

    async def wait(self) -> None:
        """Return when the server has stopped serving other than by ``restart`` (e.g. a bind error)."""
        await self._ended.wait()

    def restart(self, down_s: float) -> bool:
        """Crash now (every connection reset, new ones refused); serve again after ``down_s`` wall
        seconds from a fresh watch cache. Returns at once; False when a restart is under way."""
        server, task = self._server, self._task
        if self._stopping or server is None or task is None:
            return False
        if self._restarting is not None and not self._restarting.done():
            return False
        placeholder = _reserve(self.host, self.port)  # keeps the port; does not listen: refused
        self._task = None  # the old process's end is not the server's end
        self.restarts += 1
        for listening in server.servers:
            listening.close()  # refuse from now on, not at uvicorn's next main-loop tick
        for connection in list(server.server_state.connections):
            _reset(connection)  # open watches break mid-stream
        self._watches.end_streams()
        server.should_exit = True
        log.info("API server restarting: connections reset, refused for %.1f s", down_s)
        self._restarting = asyncio.create_task(
            self._come_back(task, placeholder, down_s), name="kube-apiserver-restart"
        )
        return True

    async def stop(self) -> None:
        """Graceful shutdown: open watches end cleanly, then any idle keep-alive connection is dropped."""
        self._stopping = True
        if self._restarting is not None and not self._restarting.done():
            self._restarting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._restarting
        self._watches.close()
        server, task = self._server, self._task
        if server is None or task is None:
            return
        server.should_exit = True
        # An idle TLS keep-alive connection would hold shutdown until its close_notify times out
        # (clients' pools do not answer it): drop the connections now.
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()
        if not task.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5)

    # -- internals ---------------------------------------------------------------------------------

    def _config(self) -> uvicorn.Config:
        return uvicorn.Config(
            self._app,
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=str(self._certs.server_cert),
            ssl_keyfile=str(self._certs.server_key),
            timeout_graceful_shutdown=3,
            timeout_keep_alive=IDLE_KEEPALIVE_S,
        )

    async def _serve_on(self, listener: socket.socket) -> None:
        server = uvicorn.Server(self._config())
        task = asyncio.create_task(server.serve(sockets=[listener]), name="kube-apiserver")
        while not server.started:
            if task.done():
                await task  # re-raises the error
                raise RuntimeError(f"the simulated API server could not listen on {self.host}:{self.port}")
            await asyncio.sleep(0.01)
        self._server, self._task = server, task
        task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        if task is self._task and not self._stopping:
            self._ended.set()

    async def _come_back(self, old: asyncio.Task[None], placeholder: socket.socket, down_s: float) -> None:
        try:
            await asyncio.sleep(down_s)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(old), timeout=5)
            start = self._watches.restart_cache()
            await self._serve_on(_reserve(self.host, self.port))
            log.info("API server serving again; watch cache starts at resourceVersion %d", start)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("API server restart failed")
            self._ended.set()
            raise
        finally:
            placeholder.close()
