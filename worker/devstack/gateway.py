"""The gateway of a local fleet: fleetmend's control plane and a real Envoy, in front of the sim.

``LocalGateway`` is what ``fleetmend dev``, ``fleetmend demo`` and the integration tests put in the
data path: user traffic goes load generator → Envoy (``url``, a virtual host per pool, the pool's
Service names in ``Host``) → the engines on their pod IPs. The control plane runs on a thread of
this process and reads the routing set from the sim's Kubernetes API, exactly as
``fleetmend gateway serve`` reads a real cluster's; Envoy is a child process.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from gateway.bootstrap import BootstrapSettings
from gateway.resources import UPSTREAM_HEADER, DataPlaneSettings
from gateway.run import ControlPlaneThread, hosts_reader
from worker.devstack.envoy import EnvoyProcess
from worker.processes import StackError, free_port


@dataclass
class LocalGateway:
    kubeconfig: Path
    database_url: str
    workdir: Path
    listen_port: int = 0
    admin_port: int = 0
    xds_port: int = 0
    data_plane: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    plane: ControlPlaneThread | None = None
    envoy: EnvoyProcess | None = None

    @property
    def access_log(self) -> Path:
        return self.workdir / "envoy-access.log"

    @property
    def url(self) -> str:
        assert self.envoy is not None, "the gateway is not started"
        return self.envoy.url

    @property
    def admin_url(self) -> str:
        assert self.envoy is not None, "the gateway is not started"
        return self.envoy.admin_url

    def start(self) -> LocalGateway:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.plane = ControlPlaneThread(
            hosts_reader(self.kubeconfig, None),
            self.database_url,
            port=self.xds_port,
            data_plane=self.data_plane,
        ).start()
        # Ports the caller left to us are picked free, and another process can take one before
        # Envoy binds it ("Address already in use"): Envoy is then started again on fresh ports,
        # three times. Ports the caller chose are used as given, and a taken one is an error.
        chosen = bool(self.listen_port and self.admin_port)
        for attempt in range(1 if chosen else 3):
            self.envoy = EnvoyProcess(
                BootstrapSettings(
                    node_id=f"envoy-{uuid.uuid4().hex[:6]}",
                    listen_address="127.0.0.1",
                    listen_port=self.listen_port or free_port(),
                    admin_port=self.admin_port or free_port(),
                    xds_host="127.0.0.1",
                    xds_port=self.plane.port,
                    access_log_path=str(self.access_log),
                ),
                self.workdir,
            )
            try:
                self.envoy.start()
                break
            except StackError as err:
                self.envoy.stop()
                if chosen or attempt == 2 or "already in use" not in str(err):
                    self.plane.stop()
                    raise
            except BaseException:
                self.envoy.stop()
                self.plane.stop()
                raise
        return self

    def restart_envoy(self, *, crash: bool = True) -> None:
        """Kill (or stop) Envoy and start it again with the same bootstrap: it starts with nothing."""
        assert self.envoy is not None
        if crash:
            self.envoy.kill()
        else:
            self.envoy.stop()
        self.envoy.start()

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        if self.plane is not None:
            self.plane.stop()

    def settings_for_clients(self) -> dict[str, Any]:
        """What the worker needs: the Envoy adapter (admin URLs and outcomes come through the control plane)."""
        return {"gateway": "envoy", "gateway_admin_urls": []}


@contextlib.asynccontextmanager
async def gateway_in_front(
    sim_url: str,
    kubeconfig: Path,
    database_url: str,
    workdir: Path,
    data_plane: DataPlaneSettings | None = None,
) -> AsyncIterator[LocalGateway]:
    """Envoy and fleetmend's control plane in front of the simulator at ``sim_url``, and the
    simulator told to send its users' load there (``PUT /sim/v1/gateway``), for as long as the
    block runs. ``database_url``: a migrated ledger database (the control plane keeps the policy
    there). For a simulator served in this event loop: starting and stopping Envoy block, so they
    run on a thread."""
    gateway = LocalGateway(
        kubeconfig=kubeconfig,
        database_url=database_url,
        workdir=workdir,
        data_plane=data_plane or DataPlaneSettings(),
    )
    await asyncio.to_thread(gateway.start)
    try:
        async with httpx.AsyncClient(base_url=sim_url, timeout=10.0) as http:
            reply = await http.put(
                "/sim/v1/gateway", json={"url": gateway.url, "upstream_header": UPSTREAM_HEADER}
            )
            reply.raise_for_status()
        yield gateway
    finally:
        await asyncio.to_thread(gateway.stop)


@contextlib.asynccontextmanager
async def serve_behind_envoy(
    world: Any, database_url: str, workdir: Path, data_plane: DataPlaneSettings | None = None
) -> AsyncIterator[tuple[str, LocalGateway]]:
    """Serve ``world`` (a ``sim.world.SimWorld``) in this event loop, its Kubernetes API over TLS
    with a kubeconfig under ``workdir``, and Envoy with fleetmend's control plane in front of its
    engines (``gateway_in_front``); yields the simulator's base URL and the gateway. For benches
    that reach into the world in-process while users' requests go through Envoy."""
    from sim.app import BoundPorts, serve
    from sim.k8s.tls import generate_serving_certs
    from sim.runner import write_kubeconfig

    certs = generate_serving_certs(workdir / "pki")
    stop = asyncio.Event()
    bound: asyncio.Future[BoundPorts] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(world, "127.0.0.1", 0, certs=certs, ready=bound.set_result, stop=stop))
    try:
        ports = await asyncio.wait_for(bound, 30)
        base_url = f"http://127.0.0.1:{ports.port}"
        kubeconfig = write_kubeconfig(
            workdir / "kubeconfig",
            f"https://127.0.0.1:{ports.kube_port}",
            world.token,
            world.scenario.namespace,
            certs.ca_pem(),
        )
        async with gateway_in_front(
            base_url, kubeconfig, database_url, workdir / "gateway", data_plane
        ) as gateway:
            yield base_url, gateway
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
