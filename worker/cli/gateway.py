"""``fleetmend gateway``: the Envoy control plane, and the bootstrap for the Envoys that dial it.

::

    fleetmend gateway serve                       # ADS on FLEETMEND_XDS_HOST:FLEETMEND_XDS_PORT
    fleetmend gateway bootstrap --node-id envoy-0 --xds-host fleetmend-xds > envoy.json
    envoy -c envoy.json
"""

from __future__ import annotations

import asyncio
import json
import logging

import typer

from worker.cli.common import UNAVAILABLE, fail
from worker.config import load_settings

app = typer.Typer(no_args_is_help=True)


@app.command("serve")
def serve_command() -> None:
    """Serve xDS to every Envoy of the gateway: pools from Kubernetes, policies from the ledger database."""
    from gateway.run import hosts_reader, run_forever
    from gateway.server import ControlPlane
    from gateway.store import GatewayStore
    from ledger.store import make_engine

    settings = load_settings()
    url = settings.database_url_value()
    if not url:
        raise fail(
            "fleetmend gateway serve needs the ledger database: set FLEETMEND_DATABASE_URL "
            "(the same database the workers use)",
            UNAVAILABLE,
        )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    read = hosts_reader(
        settings.kubeconfig,
        settings.kube_context,
        service_selector=settings.gateway_service_selector,
        router_label=settings.router_label,
        router_label_value=settings.router_label_value,
    )
    plane = ControlPlane(read, GatewayStore(make_engine(url, pool_size=2)), refresh_s=settings.xds_refresh_s)

    def started(port: int) -> None:
        typer.echo(f"fleetmend gateway control plane: ADS on {settings.xds_host}:{port}", err=True)

    asyncio.run(run_forever(plane, settings.xds_host, settings.xds_port, started))


@app.command("bootstrap")
def bootstrap_command(
    node_id: str = typer.Option(..., "--node-id", help="This Envoy's name (its ACKs are recorded under it)."),
    xds_host: str = typer.Option(..., "--xds-host", help="The control plane's address (a Service name)."),
    xds_port: int = typer.Option(18000, "--xds-port"),
    listen_port: int = typer.Option(8080, "--listen-port", help="Where Envoy takes user traffic."),
    admin_address: str = typer.Option("127.0.0.1", "--admin-address", help="Envoy admin bind address."),
    admin_port: int = typer.Option(9901, "--admin-port"),
    access_log: str = typer.Option("/dev/stdout", "--access-log", help="JSON access log path."),
) -> None:
    """Print an Envoy bootstrap (JSON) that takes everything else from `fleetmend gateway serve`."""
    from gateway.bootstrap import BootstrapSettings, bootstrap

    settings = BootstrapSettings(
        node_id=node_id, xds_host=xds_host, xds_port=xds_port, listen_port=listen_port,
        admin_address=admin_address, admin_port=admin_port, access_log_path=access_log,
    )  # fmt: skip
    typer.echo(json.dumps(bootstrap(settings), indent=2))
