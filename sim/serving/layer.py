"""The serving layer of one simulated world: engines, telemetry, faults, load, sinks.

The simulator has no gateway: users' requests (``/sim/v1/load``) go through the one set with
``PUT /sim/v1/gateway`` (a real Envoy that fleetmend's control plane configures, in the dev
stack, the demo and the tests) to the engines on their pod IPs.

``ServingLayer(world)`` wires everything to the world's clock and object store;
``start()`` runs the single tick loop (engines advance on the sim clock, probes,
scheduled faults); ``stop()`` ends it. The loop ticks fast while something is under way (a
request in flight, an engine loading, draining or dying, a fault due) and otherwise sleeps until
something happens (a cluster change, a request, a fault, a node lost) or ``IDLE_TICK_S`` passes:
an idle fleet costs next to nothing however many engines it has. ``sim.serving.attach``
builds one and mounts its HTTP API on the simulator's app.

Settings come from the scenario's free-form ``load`` section (``ServingSettings``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fleet.vocabulary import FaultKind, Tier
from sim.clock import set_from_any_thread
from sim.control import FaultRequest, NotifyMessage
from sim.k8s.podips import DEFAULT_ENGINE_PORT
from sim.serving.diagnostics import diagnostic_program
from sim.serving.effects import EffectProposer, EffectsConfig
from sim.serving.engine import EngineSpec
from sim.serving.faults import FaultError, FaultInjector
from sim.serving.grade import CapacityRecord
from sim.serving.kubeview import KubeView, served_models
from sim.serving.loadgen import GatewayTarget, LoadRun, LoadSpec
from sim.serving.pods import EngineServers
from sim.serving.probes import ProbeSettings, ReadinessProber
from sim.serving.supervisor import EngineSupervisor, engine_spec_for
from sim.serving.telemetry import NodeTelemetry, gpu_assignment, node_gpu_count, node_gpu_product

log = logging.getLogger(__name__)
# Longest an idle serving layer sleeps between ticks (wall seconds; shorter in a fast world: at most
# one sim second), so the kubelets' readiness probes still run on their period.
IDLE_TICK_S = 0.5
# Sim seconds between samples of the world's true capacity. A change is recorded up to this late
# (and in 0.5 % steps): a death late errs towards more capacity (the optimum high), a restart or
# warm-up step late towards less (the optimum low, by at most that capacity for this long).
CAPACITY_SAMPLE_S = 0.25


class NoGateway(LookupError):
    """Load was asked for while no gateway is set (the simulator routes nothing itself)."""


class TrafficSpec(BaseModel):
    """Background load the simulator sends through its gateway by itself, from the moment one is set."""

    model_config = ConfigDict(extra="forbid")

    rate: float = Field(gt=0, description="requests per sim second")
    duration_s: float = Field(default=3600.0, gt=0)
    seed: int = 0
    tiers: dict[Tier, float] = Field(
        default_factory=lambda: {Tier.CRITICAL: 0.2, Tier.STANDARD: 0.5, Tier.SHEDDABLE: 0.3}
    )
    model: str | None = None


class ServingSettings(BaseModel):
    """The scenario's ``load`` section."""

    model_config = ConfigDict(extra="forbid")

    engine: dict[str, Any] = Field(default_factory=dict, description="EngineSpec overrides for every model")
    effects: EffectsConfig = Field(
        default_factory=lambda: EffectsConfig(),
        description="effects the model proposes (sim.serving.effects)",
    )
    probe_period_s: float = Field(default=10.0, gt=0)
    probe_failure_threshold: int = Field(default=3, ge=1)
    qualification_s: float = Field(
        default=120.0, ge=0, description="how long a DCGM diagnostic takes at level 2 (dcgmi diag -r 2)"
    )
    tick_s: float = Field(default=0.05, gt=0, description="engine tick in sim seconds (at least 5 ms wall)")
    stream_interval_s: float = Field(
        default=0.25,
        ge=0,
        description="an engine's SSE stream sends at most one chunk per this many sim seconds (tokens "
        "made meanwhile ride in the next chunk; the first token and the end are never held). A "
        "simulator economy: every chunk costs CPU in the engine, Envoy and the load generator. 0: a "
        "chunk per tick",
    )
    engine_port: int = Field(
        default=DEFAULT_ENGINE_PORT,
        ge=1,
        le=65535,
        description="port every engine listens on at its pod IP (vLLM's --port)",
    )
    serve_engines: bool = Field(
        default=True, description="run each engine's HTTP server on its pod IP (off: in-process only)"
    )
    traffic: TrafficSpec | None = None


def settings_from_scenario(load: dict[str, Any]) -> ServingSettings:
    try:
        return ServingSettings.model_validate(load or {})
    except ValidationError as exc:
        problems = "; ".join(f"load.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid serving settings in the scenario: {problems}") from None


def warm_group_capacity_rps(scenario: Any, load: LoadSpec) -> float:
    """Requests/s one warm replica group of the scenario's first model really serves of ``load``: its
    engine's decode budget over the mean work of one request (``EngineSpec.request_work``, the
    accounting the world's grade uses). What a load test of one replica would find; the incident bench
    (``--load-of-world``) sets its load against it and tells fleetmend it."""
    spec = engine_spec_for(scenario.models[0], None, settings_from_scenario(scenario.load or {}).engine)
    mean = spec.request_work(sum(load.output_tokens) / 2, sum(load.prompt_tokens) / 2)
    return spec.warm_tokens_per_s / mean


class ServingLayer:
    def __init__(self, world: Any, settings: ServingSettings | None = None) -> None:
        self.world = world
        self.clock = world.clock
        scenario = getattr(world, "scenario", None)
        self.settings = settings or settings_from_scenario(getattr(scenario, "load", {}) or {})
        self.default_namespace: str = getattr(scenario, "namespace", "default")
        self.kube = KubeView(world.store, getattr(getattr(world, "control", None), "devices", None))
        self.kube.devices.broken = self._gpu_broken
        self.supervisor = EngineSupervisor(world, self.kube, self.settings.engine)
        self.effects = EffectProposer(self.settings.effects.model_copy())
        self.faults = FaultInjector(self)
        self.prober = ReadinessProber(
            world,
            self.kube,
            self.supervisor,
            ProbeSettings(self.settings.probe_period_s, self.settings.probe_failure_threshold),
        )
        self.engine_servers = EngineServers(self, self.settings.engine_port)
        control = getattr(world, "control", None)
        if control is not None:  # pod IPs are checked free on the port the engines will listen on
            control.pod_ips.port = self.settings.engine_port
        self.telemetry: dict[str, NodeTelemetry] = {}
        self.thermal_nodes: dict[str, float] = {}
        self.notifications: list[dict[str, Any]] = []
        self.issues: list[dict[str, Any]] = []  # the world's Jira (sim.serving.jira)
        self.capacity = CapacityRecord()  # the world's true serving capacity (sim.serving.grade)
        self._capacity_at = -math.inf
        self._scheduled: list[FaultRequest] = []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.background_load: Any = None
        self.gateway: GatewayTarget | None = None
        self._served_cache: tuple[tuple[int, int], dict[str, str]] | None = None
        self.supervisor.start_blocker = self._start_blocker
        self.supervisor.node_factor = lambda node: self.thermal_nodes.get(node or "", 1.0)
        control = getattr(world, "control", None)
        if control is not None:
            # Pods that run `dcgmi diag` (qualification Jobs) run the diagnostic on the node's GPUs.
            control.program_for = lambda pod: diagnostic_program(
                pod, self.settings.qualification_s, self.node_telemetry, self.kube.devices.pod_indices
            )
        register = getattr(world, "register_fault_handler", None)
        if register is not None:
            for kind in FaultKind:
                if kind != FaultKind.NODE_LOST:
                    register(kind, self._world_fault_handler)
        self.supervisor.reconcile(self.clock.now(), force=True)
        self._wake: asyncio.Event | None = None
        self.kube.on_change = self.wake
        self.engine_servers.on_request = self.wake
        listeners = getattr(world, "node_loss_listeners", None)
        if listeners is not None:
            listeners.append(lambda node: self.wake())

    def wake(self) -> None:
        """Tick now (safe from any thread): something changed that the engines must act on."""
        set_from_any_thread(self._loop, self._wake)

    def busy(self) -> bool:
        """Is anything under way that the tick must advance (not merely wait for)?"""
        if self._scheduled or self.supervisor.busy():
            return True
        return False

    # ---- the gateway users' requests go through --------------------------------------------
    def use_gateway(self, url: str | None, upstream_header: str | None = None) -> None:
        """Send load (``/sim/v1/load``, the scenario's ``traffic``) through the gateway at ``url``
        (e.g. Envoy); None: no gateway, and load is refused until one is set."""
        self.gateway = (
            None
            if url is None
            else GatewayTarget(
                url.rstrip("/"),
                upstream_header=upstream_header,
                host_for=self._pool_host,
                replica_of=self.pod_at,
            )
        )
        if self.gateway is not None and self._loop is not None:
            self._start_traffic()

    def load_target(self) -> GatewayTarget:
        if self.gateway is None:
            raise NoGateway(
                "the simulator has no gateway of its own: PUT /sim/v1/gateway with the URL of the gateway "
                "in front of the engines (e.g. the Envoy fleetmend configures) before sending load"
            )
        return self.gateway

    def served_models(self) -> dict[str, str]:
        """Model names -> pool ``namespace/service`` (``kubeview.served_models``)."""

        # Asked per request sent (its Host): engines start without a cluster change, so the scan is
        # kept at most a wall second.
        generation = (self.kube.generation, int(time.monotonic()))
        if self._served_cache is not None and self._served_cache[0] == generation:
            return self._served_cache[1]

        def names(key: str) -> list[str]:
            engine = self.supervisor.get(key)
            return [engine.metrics_model_name] if engine is not None else []

        out = served_models(self.kube, names)
        if out:
            self._served_cache = (generation, out)
        return out

    def _pool_host(self, model: str) -> str | None:
        """The Host a user sends for ``model``: its pool Service's name, as cluster DNS spells it."""
        pool = self.served_models().get(model)
        if pool is None:
            return None
        namespace, _, service = pool.partition("/")
        return f"{service}.{namespace}"

    def pod_at(self, upstream: str) -> str | None:
        """The pod whose IP a gateway named as a request's upstream ("ip:port")."""
        ip = upstream.rsplit(":", 1)[0]
        for pod in self.kube.pods():
            if (pod.get("status") or {}).get("podIP") == ip:
                return str(pod["metadata"]["name"])
        return None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> asyncio.Task[None]:
        if self._task is None or self._task.done():
            self._stopping = False
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._task = self._loop.create_task(self._run(), name="sim-serving")
            self._start_traffic()
        return self._task

    def _start_traffic(self) -> None:
        """The scenario's background traffic, once there is a gateway to send it through."""
        t = self.settings.traffic
        if t is None or self.background_load is not None or self.gateway is None:
            return
        self.background_load = LoadRun(
            self.gateway,
            LoadSpec(rate=t.rate, duration_s=t.duration_s, seed=t.seed, tiers=t.tiers, model=t.model),
            world=self,
        ).start()

    async def stop(self) -> None:
        self._stopping = True
        if self.background_load is not None:
            await self.background_load.stop()
            self.background_load = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.engine_servers.aclose()
        await self.effects.aclose()

    def tick_real_seconds(self) -> float:
        return min(0.05, max(0.005, self.clock.real_seconds(self.settings.tick_s)))

    def idle_real_seconds(self) -> float:
        return max(self.tick_real_seconds(), min(IDLE_TICK_S, self.clock.real_seconds(1.0)))

    async def _run(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            self._wake.clear()
            busy = True
            try:
                self.tick()
                busy = self.busy()
            except Exception:  # one bad tick must not stop the fleet
                log.exception("serving tick failed")
            if busy:
                await asyncio.sleep(self.tick_real_seconds())
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=self.idle_real_seconds())

    def tick(self) -> None:
        now = self.clock.now()
        self.supervisor.reconcile(now)
        self.supervisor.advance(now)
        self.supervisor.reconcile(now)
        self.prober.tick(now)
        self._apply_due_faults(now)
        self.sync_engine_servers()
        if now - self._capacity_at >= CAPACITY_SAMPLE_S:
            self._capacity_at = now
            self.capacity.sample(now, self.true_capacity(now))

    def engine_spec_for_model(self, model: str | None) -> EngineSpec:
        """The engine figures of a served model (its first engine's), or the defaults when none runs."""
        for engine in self.supervisor.engines().values():
            if model in (engine.metrics_model_name, engine.model_name):
                return engine.spec
        return EngineSpec()

    def true_capacity(self, now: float) -> dict[str, float]:
        """Per model, the decode budget (tokens/s) its live engines could deliver now:
        the world's ground truth, routed or not (``sim.serving.grade``)."""
        out: dict[str, float] = {}
        for key, engine in self.supervisor.engines().items():
            up = engine.alive and not engine.wedged and self.supervisor.process_up(key)
            # Under the served name and the scenario's (users ask for either).
            for model in {engine.metrics_model_name, engine.model_name}:
                out[model] = out.get(model, 0.0) + (engine.rate(now) if up else 0.0)
        return out

    # ---- faults ---------------------------------------------------------------------------
    def _world_fault_handler(self, fault: FaultRequest) -> None:
        """``world.inject_fault`` for the serving-layer kinds; callable from any thread."""
        try:
            self.faults.validate(fault)
        except FaultError as exc:
            raise KeyError(exc.message) if exc.status == 404 else ValueError(exc.message) from None
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is not None and running is not loop and not loop.is_closed():
            # Engines and streams live on the serving loop: apply the fault there.
            loop.call_soon_threadsafe(self._apply_logged, fault)
        else:
            self.faults.apply(fault)
            self.wake()

    def _apply_logged(self, fault: FaultRequest) -> None:
        try:
            self.faults.apply(fault)
            self.sync_engine_servers()
            self.wake()
        except Exception:
            log.exception("fault %s on %s failed", fault.kind.value, fault.target)

    def sync_engine_servers(self) -> None:
        """Open/close the engines' pod-IP servers now (a fault's effect on them is immediate)."""
        if not self.settings.serve_engines or self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is self._loop:
            self.engine_servers.sync()

    def submit_fault(self, fault: FaultRequest) -> dict[str, Any]:
        """Validate now; apply now or at ``fault.at`` (sim time). Raises FaultError on bad input."""
        self.faults.validate(fault)
        now = self.clock.now()
        if fault.at is not None and fault.at > now:
            self._scheduled.append(fault)
            self._scheduled.sort(key=lambda f: f.at or 0.0)
            return {
                "accepted": True,
                "scheduled_at": fault.at,
                "kind": fault.kind.value,
                "target": fault.target,
            }
        self.faults.apply(fault)
        self.kick_world()
        self.sync_engine_servers()
        self.wake()
        return {"accepted": True, "applied_at": now, "kind": fault.kind.value, "target": fault.target}

    def _apply_due_faults(self, now: float) -> None:
        while self._scheduled and (self._scheduled[0].at or 0.0) <= now:
            fault = self._scheduled.pop(0)
            try:
                self.faults.apply(fault)
                self.kick_world()
            except FaultError:
                log.exception("scheduled fault %s on %s failed", fault.kind, fault.target)

    def kick_world(self) -> None:
        kick = getattr(self.world, "kick", None)
        if kick is not None:
            kick()

    # ---- node telemetry ---------------------------------------------------------------------
    def node_telemetry(self, node: str) -> NodeTelemetry:
        tel = self.telemetry.get(node)
        if tel is None:
            obj = self.kube.node(node)
            if obj is None:
                raise KeyError(f"no node named {node!r}")
            tel = NodeTelemetry.for_node(node, node_gpu_count(obj), node_gpu_product(obj))
            self.telemetry[node] = tel
        return tel

    def _gpu_broken(self, node: str, index: int) -> bool:
        """The GPU ledger's health hook: a GPU left broken by a hardware fault (``GpuState.broken``)."""
        tel = self.telemetry.get(node)
        return tel is not None and 0 <= index < len(tel.gpus) and tel.gpus[index].broken is not None

    def _start_blocker(self, pod: dict[str, Any]) -> str | None:
        node = (pod.get("spec") or {}).get("nodeName")
        tel = self.telemetry.get(node or "")
        if tel is None:
            return None
        holders = gpu_assignment(self.kube, node or "")
        uid = pod["metadata"].get("uid")
        for index, holder in holders.items():
            gpu = tel.gpus[index] if index < len(tel.gpus) else None
            if gpu is not None and gpu.broken and holder["metadata"].get("uid") == uid:
                return f"GPU {index} of {node}: {gpu.broken}"
        return None

    def gpu_utilisation(self, node: str) -> dict[int, float]:
        out: dict[int, float] = {}
        for index, pod in gpu_assignment(self.kube, node).items():
            engine = self.supervisor.get(f"{pod['metadata']['namespace']}/{pod['metadata']['name']}")
            if engine is not None and engine.alive:
                out[index] = min(1.0, 0.1 + engine.num_running / max(1, engine.spec.max_num_seqs) * 4)
        return out

    # ---- incident channel and Jira issues ---------------------------------------------------------
    def notify(self, message: NotifyMessage) -> None:
        self.notifications.append({"received_at": self.clock.now(), **message.model_dump()})

    def create_issue(
        self, *, project: str, issue_type: str, summary: str, description: str, labels: list[str]
    ) -> dict[str, Any]:
        """A new Jira issue (``sim.serving.jira``). Jira takes no idempotency key: every create is a new issue."""
        number = len(self.issues) + 1
        issue = {
            "id": str(10000 + number),
            "key": f"{project}-{number}",
            "fields": {
                "project": {"key": project},
                "issuetype": {"name": issue_type},
                "summary": summary,
                "description": description,
                "labels": labels,
                "created": self.clock.now(),
            },
        }
        self.issues.append(issue)
        return issue
