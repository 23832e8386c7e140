"""Start a whole simulator (API server + controllers) in a background thread.

Used by the ``fleetmend sim`` command's tests, the workflow tests and the demo::

    running = start_sim("sim/scenarios/gpu-node-loss.yaml", speed=50)
    api = kubernetes.config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    # kubectl --kubeconfig running.kubeconfig get pods -o wide   (the same file)
    ...
    running.stop()

Two servers bind free loopback ports by default (``port=0``, ``kube_port=0``): the
Kubernetes API over HTTPS (``RunningSim.kube_url``, with a CA generated at start) and the
rest of the simulated world over plain HTTP (``RunningSim.base_url``: engines'
metrics, notify, ``/sim/v1/...``). ``start_sim`` writes a kubeconfig (cluster, bearer-token
user and context all named ``sim``; the CA as ``certificate-authority-data``), points the API
server's audit log at ``audit.log`` next to it, and returns once both answer.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sim.app import BoundPorts, serve
from sim.k8s.tls import generate_serving_certs
from sim.scenario import Scenario, load_scenario
from sim.world import SimWorld

KUBECONFIG_CONTEXT = "sim"


def kubeconfig_document(
    server: str, token: str, namespace: str = "default", ca_pem: bytes | None = None
) -> dict[str, object]:
    cluster: dict[str, str] = {"server": server}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": KUBECONFIG_CONTEXT, "cluster": cluster}],
        "users": [{"name": KUBECONFIG_CONTEXT, "user": {"token": token}}],
        "contexts": [
            {
                "name": KUBECONFIG_CONTEXT,
                "context": {
                    "cluster": KUBECONFIG_CONTEXT,
                    "user": KUBECONFIG_CONTEXT,
                    "namespace": namespace,
                },
            }
        ],
        "current-context": KUBECONFIG_CONTEXT,
        "preferences": {},
    }


def write_kubeconfig(
    path: Path, server: str, token: str, namespace: str = "default", ca_pem: bytes | None = None
) -> Path:
    """Write a kubeconfig for the simulator (readable only by the owner: it holds the token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    document = kubeconfig_document(server, token, namespace, ca_pem)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    path.chmod(0o600)
    return path


@dataclass
class RunningSim:
    """A simulator serving in a background thread.

    ``base_url`` is the plain-HTTP world (engines' metrics, ``/sim/v1``); ``kube_url`` the
    Kubernetes API (HTTPS; trust ``ca_cert``); ``audit_log`` the API server's audit events.
    """

    world: SimWorld
    base_url: str
    port: int
    kubeconfig: Path
    _thread: threading.Thread
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event
    _tmpdir: tempfile.TemporaryDirectory[str] | None = field(default=None)
    kube_url: str = ""
    kube_port: int = 0
    ca_cert: Path | None = None
    audit_log: Path | None = None

    @property
    def token(self) -> str:
        return self.world.token

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None

    def __enter__(self) -> RunningSim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_sim(
    scenario: str | Path | Scenario,
    speed: float = 1.0,
    port: int = 0,
    *,
    host: str = "127.0.0.1",
    kube_port: int = 0,
    kubeconfig: Path | None = None,
    audit_log: Path | None = None,
    token: str | None = None,
    serving: bool = True,
    watch_history: int | None = None,
    startup_timeout: float = 30.0,
) -> RunningSim:
    """Serve ``scenario`` in a daemon thread; returns when both servers listen.

    ``port`` / ``kube_port``: 0 = a free port. ``kubeconfig``: where to write it (default: a
    temporary directory); the CA and serving certificate go to ``pki/`` beside it, and the audit
    log to ``audit_log`` (default ``audit.log`` beside it). ``serving=False`` serves the Kubernetes
    side only (no engines or load). ``watch_history``: watch events kept per resource.
    """
    loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    world = SimWorld(loaded, speed=speed, token=token, watch_history=watch_history)
    tmpdir = None
    if kubeconfig is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="fleetmend-sim-")
        kubeconfig = Path(tmpdir.name) / "kubeconfig"
    kubeconfig.parent.mkdir(parents=True, exist_ok=True)
    audit_path = audit_log if audit_log is not None else kubeconfig.parent / "audit.log"
    certs = generate_serving_certs(kubeconfig.parent / "pki")
    loop = asyncio.new_event_loop()
    bound: dict[str, BoundPorts] = {}
    started = threading.Event()
    failure: list[BaseException] = []
    stop = asyncio.Event()

    def on_ready(ports: BoundPorts) -> None:
        bound["ports"] = ports
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(
                serve(
                    world,
                    host,
                    port,
                    kube_port=kube_port,
                    certs=certs,
                    audit_log=audit_path,
                    ready=on_ready,
                    stop=stop,
                    serving=serving,
                )
            )
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # surfaced to the caller below
            failure.append(exc)
        finally:
            started.set()
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=run, name=f"fleetmend-sim-{loaded.name}", daemon=True)
    thread.start()
    if not started.wait(startup_timeout) or "ports" not in bound:
        detail = f": {failure[0]}" if failure else ""
        if tmpdir is not None:
            tmpdir.cleanup()
        raise RuntimeError(f"the simulator did not start on {host}:{port}/{kube_port}{detail}")
    ports = bound["ports"]
    base_url = f"http://{host}:{ports.port}"
    kube_url = f"https://{host}:{ports.kube_port}"
    write_kubeconfig(kubeconfig, kube_url, world.token, loaded.namespace, certs.ca_pem())
    return RunningSim(
        world,
        base_url,
        ports.port,
        kubeconfig,
        thread,
        loop,
        stop,
        tmpdir,
        kube_url=kube_url,
        kube_port=ports.kube_port,
        ca_cert=certs.ca_cert,
        audit_log=audit_path,
    )
