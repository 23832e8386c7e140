"""``fleetmend sim``: serve a simulated GPU cluster from a scenario file.

The simulator speaks the Kubernetes REST API over TLS on one loopback port (a CA
generated at start, in the kubeconfig), the serving layer's router, metrics and
fault APIs over plain HTTP on another, writes a kubeconfig and the API server's
audit log, and prints their paths, so ``kubectl`` / the official client /
fleetmend's worker can point at it::

    fleetmend sim --scenario sim/scenarios/gpu-node-loss.yaml --speed 10
    export KUBECONFIG=<printed path>
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import typer

from worker.cli.common import UNAVAILABLE, fail
from worker.config import load_settings


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""

    @app.command("sim")
    def sim_command(
        scenario: Path = typer.Option(..., "--scenario", "-s", help="Scenario YAML (see sim/scenarios/)."),
        port: int | None = typer.Option(
            None, "--port", "-p", help="Port to listen on (default FLEETMEND_SIM_PORT; 0 = any free port)."
        ),
        speed: float = typer.Option(
            1.0,
            "--speed",
            help="Sim seconds per wall second (e.g. 10 makes a 300 s toleration pass in 30 s).",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
        kubeconfig: Path | None = typer.Option(
            None, "--kubeconfig", help="Where to write the kubeconfig (default <state_dir>/sim-kubeconfig)."
        ),
        kube_port: int = typer.Option(
            0, "--kube-port", help="Port of the Kubernetes API (HTTPS; default 0 = any free port)."
        ),
        audit_log_path: Path | None = typer.Option(
            None,
            "--audit-log",
            help="Where the API server writes its audit log (default beside the kubeconfig).",
        ),
        tls_san: list[str] = typer.Option(
            [],
            "--tls-san",
            help="Another name (or IP) the API server's certificate names, e.g. a service name.",
        ),
    ) -> None:
        """Serve a simulated Kubernetes cluster + inference fleet; prints the kubeconfig path."""
        from sim.app import BoundPorts, serve
        from sim.k8s.tls import generate_serving_certs
        from sim.runner import write_kubeconfig
        from sim.scenario import ScenarioError, load_scenario
        from sim.world import SimWorld

        settings = load_settings()
        if speed <= 0:
            raise fail(f"--speed must be greater than 0 (got {speed}); use 1 for real time.")
        try:
            loaded = load_scenario(scenario)
        except ScenarioError as exc:
            raise fail(str(exc)) from None
        listen_port = settings.sim_port if port is None else port
        config_path = (kubeconfig or settings.state_dir / "sim-kubeconfig").resolve()
        world = SimWorld(loaded, speed=speed)
        import ipaddress

        def is_ip(value: str) -> bool:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                return False
            return True

        certs = generate_serving_certs(
            config_path.parent / f"{config_path.name}.pki",
            extra_ips=tuple(v for v in tls_san if is_ip(v)),
            extra_names=tuple(v for v in tls_san if not is_ip(v)),
        )
        audit_log = audit_log_path or config_path.parent / f"{config_path.name}.audit.log"

        def ready(bound: BoundPorts) -> None:
            url = f"http://{host}:{bound.port}"
            api = f"https://{host}:{bound.kube_port}"
            write_kubeconfig(config_path, api, world.token, loaded.namespace, certs.ca_pem())
            typer.echo(
                f"fleetmend sim: scenario {loaded.name!r}: Kubernetes API {api}, router and sim API {url} "
                f"(speed x{speed:g}); Ctrl-C stops it"
            )
            typer.echo(f"kubeconfig: {config_path}", color=False)
            typer.echo(f"audit log: {audit_log}", color=False)
            typer.echo(f"export KUBECONFIG={config_path}")

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(NotImplementedError):
                    loop.add_signal_handler(sig, stop.set)
            await serve(
                world,
                host,
                listen_port,
                kube_port=kube_port,
                certs=certs,
                audit_log=audit_log,
                ready=ready,
                stop=stop,
            )

        try:
            asyncio.run(main())
        except OSError as exc:
            raise fail(
                f"cannot listen on {host}:{listen_port} ({exc.strerror}); pick another --port or use --port 0.",
                UNAVAILABLE,
            ) from None
        except SystemExit as exc:  # uvicorn exits when the port is taken
            if exc.code not in (0, None):
                raise fail(
                    f"cannot listen on {host}:{listen_port}; pick another --port or use --port 0.",
                    UNAVAILABLE,
                ) from None


def main() -> None:
    """``python -m worker.cli.sim --scenario ...``: ``fleetmend sim`` without loading the rest of the command
    line (Temporal's client, the ledger's database layer). The test rig and the dev stack start a simulator
    per world, and this halves each one's start-up CPU."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    register(app)
    app()


if __name__ == "__main__":
    main()
