"""The worker's probe endpoints (``FLEETMEND_WORKER_HEALTH_PORT``), for Kubernetes and the like.

* ``GET /healthz`` — liveness: the worker's event loop answers. It answers from
  process start, so a slow start-up check is never mistaken for a hung process.
* ``GET /readyz`` — readiness: the worker passed its start-up checks and polls,
  and right now both Temporal (gRPC health) and the ledger database (``SELECT 1``)
  answer. A rolling update counts a new pod as available only from here on, and a
  worker that lost either dependency stops counting, which is what the pod's
  Ready condition should say.

Deliberately tiny (asyncio streams, no framework): it serves two GET routes to the
kubelet and nothing else, carries no data, and needs no token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from temporalio.client import Client

from worker.config import Settings

log = logging.getLogger("fleetmend.worker.health")

CHECK_TIMEOUT_S = 3.0


class HealthServer:
    def __init__(self, settings: Settings, host: str = "0.0.0.0") -> None:
        self._host = host
        self._port = settings.worker_health_port
        self._server: asyncio.Server | None = None
        self._client: Client | None = None
        self._database_url: str | None = None
        self._engine: Engine | None = None
        self._stopping = False

    @property
    def port(self) -> int:
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self._host, self._port)

    def polling(self, client: Client, database_url: str | None) -> None:
        """From now on /readyz checks Temporal and the ledger."""
        self._client, self._database_url = client, database_url

    def stopping(self) -> None:
        """Shutting down: not ready (no new work should wait on this pod)."""
        self._stopping = True

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        if self._engine is not None:
            self._engine.dispose()

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        if self._stopping:
            return False, {"worker": "stopping"}
        if self._client is None:
            return False, {"worker": "starting (start-up checks, not polling yet)"}
        checks = dict(
            zip(
                ("temporal", "database"),
                await asyncio.gather(self._check(self._temporal()), self._check(self._database())),
                strict=True,
            )
        )
        return all(v == "ok" for v in checks.values()), {"worker": "polling", **checks}

    async def _temporal(self) -> None:
        assert self._client is not None
        await self._client.service_client.check_health()

    async def _database(self) -> None:
        if not self._database_url:
            return  # a worker without a ledger (smoke) has none to lose
        url = self._database_url

        def select_one() -> None:
            if self._engine is None:
                self._engine = create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 3})
            with self._engine.connect() as conn:
                conn.execute(text("SELECT 1"))

        await asyncio.to_thread(select_one)

    @staticmethod
    async def _check(probe: Awaitable[None]) -> str:
        try:
            await asyncio.wait_for(probe, timeout=CHECK_TIMEOUT_S)
        except Exception as err:
            first = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            return f"unreachable: {first}"
        return "ok"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), timeout=5.0)
            while (await asyncio.wait_for(reader.readline(), timeout=5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing in them matters here
            parts = request.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            status: int
            body: dict[str, Any]
            if method != "GET":
                status, body = 405, {"error": "only GET"}
            elif path == "/healthz":
                status, body = 200, {"status": "ok"}
            elif path == "/readyz":
                ready, checks = await self.readiness()
                status, body = (200 if ready else 503), {"ready": ready, "checks": checks}
            else:
                status, body = 404, {"error": "not found: /healthz and /readyz only"}
            payload = json.dumps(body).encode()
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
            writer.write(
                f"HTTP/1.1 {status} {reason[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
