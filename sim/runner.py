"""Start a whole simulator (API server + controllers) in a background thread.

Used by the ``fleetmend sim`` command's tests, the workflow tests and the demo::

    running = start_sim("sim/scenarios/gpu-node-loss.yaml", speed=50)
    api = kubernetes.config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    ...
    running.stop()

The server binds a free loopback port by default (``port=0``), writes a
kubeconfig (cluster, bearer-token user and context all named ``sim``) and
returns once it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sim.app import serve
from sim.scenario import Scenario, load_scenario
from sim.world import SimWorld

KUBECONFIG_CONTEXT = "sim"


def kubeconfig_document(server: str, token: str, namespace: str = "default") -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": KUBECONFIG_CONTEXT, "cluster": {"server": server}}],
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


def write_kubeconfig(path: Path, server: str, token: str, namespace: str = "default") -> Path:
    """Write a kubeconfig for the simulator (readable only by the owner: it holds the token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(kubeconfig_document(server, token, namespace), sort_keys=False))
    path.chmod(0o600)
    return path


@dataclass
class RunningSim:
    """A simulator serving in a background thread."""

    world: SimWorld
    base_url: str
    port: int
    kubeconfig: Path
    _thread: threading.Thread
    _loop: asyncio.AbstractEventLoop
    _stop: asyncio.Event
    _tmpdir: tempfile.TemporaryDirectory[str] | None = field(default=None)

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
    kubeconfig: Path | None = None,
    token: str | None = None,
    serving: bool = True,
    startup_timeout: float = 30.0,
) -> RunningSim:
    """Serve ``scenario`` on ``host:port`` (0 = a free port) in a daemon thread; returns when it listens.

    ``serving=False`` serves the Kubernetes side only (no engines, router or load).
    """
    loaded = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    world = SimWorld(loaded, speed=speed, token=token)
    loop = asyncio.new_event_loop()
    bound: dict[str, int] = {}
    started = threading.Event()
    failure: list[BaseException] = []
    stop = asyncio.Event()

    def on_ready(actual_port: int) -> None:
        bound["port"] = actual_port
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve(world, host, port, ready=on_ready, stop=stop, serving=serving))
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
    if not started.wait(startup_timeout) or "port" not in bound:
        detail = f": {failure[0]}" if failure else ""
        raise RuntimeError(f"the simulator did not start on {host}:{port}{detail}")
    actual_port = bound["port"]
    base_url = f"http://{host}:{actual_port}"
    tmpdir = None
    if kubeconfig is None:
        tmpdir = tempfile.TemporaryDirectory(prefix="fleetmend-sim-")
        kubeconfig = Path(tmpdir.name) / "kubeconfig"
    write_kubeconfig(kubeconfig, base_url, world.token, loaded.namespace)
    return RunningSim(world, base_url, actual_port, kubeconfig, thread, loop, stop, tmpdir)
