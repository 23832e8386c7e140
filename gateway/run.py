"""Running the control plane: as ``fleetmend gateway serve`` (its own process, a Deployment in a
cluster) or on a background thread of another process (the dev stack, tests, benches).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE
from gateway.resources import DataPlaneSettings, RoutedHost
from gateway.server import ControlPlane, serve
from gateway.store import GatewayStore
from gateway.world import RoutingWatch
from kube.client import kube_apis
from ledger.store import make_engine


@dataclass(frozen=True)
class _Cluster:
    kubeconfig: Path | None
    kube_context: str | None


def hosts_reader(
    kubeconfig: Path | None,
    kube_context: str | None,
    *,
    service_selector: str | None = None,
    router_label: str | None = None,
    router_label_value: str | None = None,
) -> RoutingWatch:
    """The routing set of the cluster the kubeconfig (or in-cluster config) names, kept current by
    watches (started here; ``stop()`` it, or let the control plane's stop do it)."""
    kube = kube_apis(_Cluster(kubeconfig, kube_context))
    return RoutingWatch(
        kube,
        service_selector=service_selector,
        router_label=router_label or ROUTER_LABEL,
        router_label_value=router_label_value or ROUTER_LABEL_VALUE,
    ).start()


async def run_forever(
    plane: ControlPlane,
    host: str,
    port: int,
    started: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until ``stop`` is set (or forever); the first snapshot is built before Envoy can connect."""
    await plane.refresh()
    server, bound = await serve(plane, host, port)
    if started is not None:
        started(bound)
    tasks = [asyncio.create_task(plane.run_refresh()), asyncio.create_task(plane.run_heartbeat())]
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await server.stop(grace=0.5)
        await plane.close_streams()


@dataclass
class ControlPlaneThread:
    """The control plane on its own thread and event loop; ``start()`` returns once it listens."""

    read_hosts: Callable[[], dict[str, tuple[RoutedHost, ...]]]
    database_url: str
    host: str = "127.0.0.1"
    port: int = 0
    data_plane: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    refresh_s: float = 0.1
    policy_check_s: float = 2.0
    plane: ControlPlane | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stop: asyncio.Event | None = None

    def start(self, timeout_s: float = 30.0) -> ControlPlaneThread:
        ready = threading.Event()
        failure: list[BaseException] = []
        store = GatewayStore(make_engine(self.database_url, pool_size=2, max_overflow=2))
        self.plane = ControlPlane(
            self.read_hosts, store, self.data_plane, self.refresh_s, self.policy_check_s
        )

        def bound(port: int) -> None:
            self.port = port
            ready.set()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            assert self.plane is not None
            self._stop = asyncio.Event()
            try:
                loop.run_until_complete(run_forever(self.plane, self.host, self.port, bound, self._stop))
            except BaseException as err:  # reported to start(), or ends a stopped plane
                failure.append(err)
                ready.set()
            finally:
                with contextlib.suppress(Exception):
                    loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

        self._thread = threading.Thread(target=main, name="fleetmend-xds", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            raise RuntimeError(
                f"the gateway control plane did not start: {failure[0] if failure else 'timeout'}"
            )
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        stop = self._stop
        if stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(stop.set)
        self._thread.join(15)
        stop_reader = getattr(self.read_hosts, "stop", None)
        if callable(stop_reader):
            stop_reader()
        if self.plane is not None:
            self.plane.store.engine.dispose()
        self._loop = self._thread = None
