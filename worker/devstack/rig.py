"""A running fleet to recover: the simulator, a fleetmend worker wired to it, and helpers to drive both.

``FleetRig`` is what ``fleetmend demo`` and the integration tests share: given a
Temporal client and a migrated ledger database, it serves a scenario, runs a
real worker (thread-pool activities, the registry's workflows) whose settings
point every adapter at the simulator over HTTP, and offers the operator's moves
— start load, inject a fault, deliver an alert — plus the facts an SRE checks
afterwards (the gateway policy in Envoy, Envoy's request outcomes, the action log vs
the ledger). Every rig puts a real Envoy, configured by fleetmend's xDS control plane, in the
users' data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.envoy_gateway import EnvoyGateway
from fleet.gateway import JournalEntry, Outcome
from fleet.incident import (
    FLEET_INCIDENT_WORKFLOW,
    REPORT_LOSS_SIGNAL,
    LossReport,
    PoolRef,
    incident_workflow_id,
)
from fleet.recovery import IncidentInput, RecoveryTimings
from fleet.vocabulary import FaultKind
from gateway.resources import UPSTREAM_HEADER
from gateway.store import GatewayStore
from ledger.store import make_engine
from sim.control import FaultRequest
from sim.k8s.rbac import SA_PREFIX
from worker.config import Settings, load_settings
from worker.devstack.gateway import LocalGateway
from worker.devstack.rbac_wiring import AUDIT_DIR_ENV, component_settings, grant_components
from worker.devstack.sim_wiring import settings_for_running_sim
from worker.fastpath.service import FastPath, build_fast_path
from worker.worker import activity_threads, build_worker

# The procedure's waits in a compressed world (``compressed_scenario``: the sim at real speed, start-up and
# warm-up in seconds): a whole recovery takes tens of seconds. The demo and the tests both start from these;
# each names what it changes and why (the demo waits longer for an approval, the tests retry a killed
# worker's activity on a tighter budget).
FAST_TIMINGS = RecoveryTimings(
    correlation_window_s=5,
    poll_interval_s=0.5,
    deroute_timeout_s=10,
    replacement_timeout_s=60,
    ramp_interval_s=2,
    admission_interval_s=1,
    ramp_max_s=60,
    verify_timeout_s=60,
    approval_timeout_s=120,
    cooldown_s=1,
    qualification_timeout_s=20,
)
ROUTED_POLL_S = 0.3  # how often pool_ready re-reads Envoy's routing set


@dataclass
class FleetRig:
    client: Client
    settings: Settings
    sim: Any  # worker.devstack.sim_process.SimProcess, or sim.runner.RunningSim (in_process_sim)
    http: httpx.AsyncClient
    gateway: LocalGateway  # the Envoy the users' requests go through, and its control plane
    worker: Worker | None = None
    scenario: Any = None  # the sim.scenario.Scenario being served
    # component -> its ServiceAccount's kubeconfig (worker, webhook, gateway; rbac_wiring.COMPONENTS)
    kubeconfigs: dict[str, Path] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)  # unix seconds this rig was made
    _tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    _envoy: EnvoyGateway | None = None
    _core: Any = None  # kubernetes.client.CoreV1Api on the sim's kubeconfig, made on first use

    @property
    def base_url(self) -> str:
        return str(self.sim.base_url)

    async def start_load(self, rate: float, duration_s: float, seed: int = 1, **options: Any) -> str:
        body = {"rate": rate, "duration_s": duration_s, "seed": seed, **options}
        r = await self.http.post("/sim/v1/load", json=body)
        r.raise_for_status()
        return str(r.json()["id"])

    async def load_report(
        self, run_id: str, since_s: float = 0.0, until_s: float | None = None
    ) -> dict[str, Any]:
        """The load run's report over the requests that arrived from ``since_s`` to ``until_s`` (run seconds)."""
        params = {"since_s": since_s, **({} if until_s is None else {"until_s": until_s})}
        r = await self.http.get(f"/sim/v1/load/{run_id}", params=params)
        r.raise_for_status()
        return dict(r.json())

    async def load_grade(self, run_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The finished run graded by the world (``sim.serving.grade``), waiting for its last request."""
        deadline = time.monotonic() + timeout_s
        while True:
            r = await self.http.get(f"/sim/v1/load/{run_id}/grade")
            if r.status_code != 409 or time.monotonic() > deadline:
                r.raise_for_status()
                return dict(r.json())
            await asyncio.sleep(0.5)

    @contextlib.asynccontextmanager
    async def effect_api(self, token: str) -> AsyncIterator[str]:
        """fleetmend's effect API (``POST /v1/effects``, bearer ``token``) over this rig's ledger, opening
        tickets in the simulator's Jira: the routes the webhook serves, on a free loopback port in this
        event loop. Yields its base URL (agents post to ``<url>/v1/effects``)."""
        import uvicorn
        from fastapi import FastAPI
        from pydantic import SecretStr

        from activities.effects import JiraProject, default_registry
        from ledger import EffectLedger
        from worker.webhook.effects_api import effects_router

        ledger = EffectLedger(self.settings.database_url_value() or "")
        tickets = JiraProject(base_url=self.base_url, token=SecretStr("rig"))
        with httpx.Client(timeout=5) as http:
            app = FastAPI()
            registry = default_registry(http, tickets=tickets, notifier_url=None)
            app.include_router(
                effects_router(lambda: ledger, registry, effects_token=SecretStr(token), ledger_token=None)
            )
            server = uvicorn.Server(
                uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, access_log=False)
            )
            task = asyncio.create_task(server.serve(), name="rig-effect-api")
            try:
                while not server.started:
                    if task.done():
                        task.result()
                        raise RuntimeError("the effect API stopped during start-up")
                    await asyncio.sleep(0.02)
                port = server.servers[0].sockets[0].getsockname()[1]
                yield f"http://127.0.0.1:{port}"
            finally:
                server.should_exit = True
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
                ledger.close()

    async def inject(self, kind: FaultKind, target: str, **params: Any) -> dict[str, Any]:
        fault = FaultRequest(kind=kind, target=target, params=params)
        r = await self.http.post("/sim/v1/faults", json=fault.model_dump(mode="json"))
        r.raise_for_status()
        return dict(r.json()) if r.content else {}

    async def refuse(self, *rules: dict[str, Any]) -> None:
        """Make the simulated API server refuse requests (``sim.k8s.faults.ApiFaultRule``); none = lift."""
        r = await self.http.put("/sim/v1/api-faults", json={"rules": list(rules)})
        r.raise_for_status()

    async def report_loss(
        self, report: LossReport, config: IncidentInput | None = None
    ) -> WorkflowHandle[Any, Any]:
        """What the webhook does for a firing alert: signal-with-start into the pool's incident."""
        return await self.client.start_workflow(
            FLEET_INCIDENT_WORKFLOW,
            report.pool if config is None else config,
            id=incident_workflow_id(report.pool),
            task_queue=self.settings.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal=REPORT_LOSS_SIGNAL,
            start_signal_args=[report],
        )

    async def sim_now(self) -> float:
        r = await self.http.get("/sim/v1/clock")
        r.raise_for_status()
        return float(r.json()["now"])

    async def actions(self) -> list[dict[str, Any]]:
        r = await self.http.get("/sim/v1/actions")
        r.raise_for_status()
        return list(r.json())

    async def notifications(self) -> list[dict[str, Any]]:
        r = await self.http.get("/sim/v1/notify")
        r.raise_for_status()
        return list(r.json())

    @property
    def gateway_adapter(self) -> EnvoyGateway:
        """The gateway adapter, as the worker's activities use it."""
        if self._envoy is None:
            self._envoy = EnvoyGateway(
                GatewayStore(
                    make_engine(self.settings.database_url_value() or "", pool_size=2, pre_ping=True)
                )
            )
        return self._envoy

    async def routing_set(self, pool: PoolRef) -> list[str]:
        """The pods Envoy would send a new request of the pool to, now."""
        return [e.pod for e in (await asyncio.to_thread(self.gateway_adapter.routing_set, pool)).endpoints]

    async def pool_ready(
        self, pool: PoolRef | None = None, replicas: int | None = None, timeout_s: float = 60.0
    ) -> list[str]:
        """Wait until Envoy routes ``replicas`` replicas of ``pool`` (default: as many as the scenario
        declares serving; without ``pool``, every pool of the scenario); returns the routed pods, sorted.

        A world is served before its pods have started: this is the moment its pools can take traffic (and
        lose a replica) the way a steady production pool does.
        """
        declared = self._declared_pools()
        pools = list(declared) if pool is None else [pool]
        wanted = {p: replicas if replicas is not None else declared.get(p) for p in pools}
        unknown = sorted(p.key for p, n in wanted.items() if n is None)
        if unknown:
            raise ValueError(
                f"pool_ready: {unknown} is not in the scenario; say how many replicas to wait for"
            )
        deadline = time.monotonic() + timeout_s
        while True:
            routed = {p: await self.routing_set(p) for p in wanted}
            short = {
                p.key: f"{len(routed[p])} of {n}" for p, n in wanted.items() if len(routed[p]) < (n or 0)
            }
            if not short:
                return sorted(pod for pods in routed.values() for pod in pods)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Envoy did not route every replica within {timeout_s:g} s (routed: {short})"
                )
            await asyncio.sleep(ROUTED_POLL_S)

    def _declared_pools(self) -> dict[PoolRef, int | None]:
        """Each pool of the scenario with its serving replicas (warm spares are not routed)."""
        if self.scenario is None:
            return {}
        return {
            PoolRef(namespace=w.namespace or self.scenario.namespace, service=w.name): w.replicas
            for w in self.scenario.workloads
        }

    @property
    def core(self) -> Any:
        """``kubernetes.client.CoreV1Api`` on the simulated cluster's kubeconfig (made on first use)."""
        if self._core is None:
            from kubernetes import client as kclient
            from kubernetes import config as kconfig

            cfg = kclient.Configuration()
            kconfig.load_kube_config(config_file=str(self.sim.kubeconfig), client_configuration=cfg)
            self._core = kclient.CoreV1Api(kclient.ApiClient(cfg))
        return self._core

    def engine_url(self, namespace: str, pod: str) -> str:
        """``http://{podIP}:{engine port}``: where the pod's engine listens, as fleetmend reaches it
        (the pod's IP from the Kubernetes API)."""
        from kubernetes import client as kclient

        try:
            ip = self.core.read_namespaced_pod(pod, namespace).status.pod_ip
        except kclient.ApiException as exc:
            raise LookupError(f"pod {namespace}/{pod}: {exc.reason}") from exc
        if not ip:
            raise LookupError(f"pod {namespace}/{pod} has no IP (not bound to a node, or gone)")
        port = getattr(self.sim, "engine_port", None) or self.sim.world.serving.settings.engine_port
        return f"http://{ip}:{port}"

    async def engine_get(self, namespace: str, pod: str, path: str) -> httpx.Response:
        """GET ``path`` (``/health``, ``/metrics``) from the pod's own engine at its pod IP."""
        return await self.http.get(self.engine_url(namespace, pod) + path)

    @contextlib.asynccontextmanager
    async def fast_path(self, identity: str = "fastpath-a", ready_s: float = 20.0) -> AsyncIterator[FastPath]:
        """Run fleetmend's fast path (Lease, informers, /health probes) against this world, as the
        worker process does; yields once it leads and every informer has listed."""
        client = self.client

        async def same_client() -> Client:
            return client

        fast = build_fast_path(self.settings, same_client, identity=identity)
        stop = asyncio.Event()
        task = asyncio.create_task(fast.run(stop))
        try:
            deadline = time.monotonic() + ready_s
            while not (fast.elector.leading and all(i.lists for i in fast.informers)):
                if task.done():
                    task.result()  # raises what stopped it
                    raise RuntimeError("the fast path stopped before it led")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fast path did not lead and list within {ready_s:g} s")
                await asyncio.sleep(0.1)
            yield fast
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)

    async def request_outcomes(self, pool: PoolRef, replica: str | None = None) -> list[JournalEntry]:
        """Every request Envoy served for ``pool`` (one entry per attempt), as the worker reads them:
        Envoy's access log through the control plane."""
        # Envoy's record lives in the shared database and outlives this world (a test may serve two
        # worlds with the same pod names on one ledger): only this world's requests count.
        return await asyncio.to_thread(
            self.gateway_adapter.request_outcomes, pool, replica=replica, since=self.started_at
        )

    async def cut_streams(self, pool: PoolRef, pods: list[str]) -> int:
        """Streams Envoy recorded as cut on ``pods``: a terminal error after the first byte, the
        failure a user sees as a truncated answer (never retried: the response had started)."""
        cut = 0
        for pod in pods:
            entries = await self.request_outcomes(pool, replica=pod)
            cut += sum(1 for e in entries if e.outcome == Outcome.TERMINAL_ERROR and e.truncated)
        return cut

    async def gateway_policy(self, pool: PoolRef) -> dict[str, Any]:
        """The pool's gateway policy (weights, admission, retry) as fleetmend last set it in Envoy."""
        return (await asyncio.to_thread(self.gateway_adapter.policy, pool)).model_dump(mode="json")


@contextlib.asynccontextmanager
async def fleet_rig(
    client: Client,
    *,
    scenario: Any,
    database_url: str,
    task_queue: str,
    speed: float = 1.0,
    run_worker: bool = True,
    in_process_sim: bool = False,
    rbac_objects: list[dict[str, Any]] | None = None,
    **overrides: Any,
) -> AsyncIterator[FleetRig]:
    """Serve ``scenario`` (a path, a shipped scenario's name or a ``sim.scenario.Scenario``) and run
    a worker wired to it.

    The simulator runs in a child process of its own (``fleetmend sim``: a core to itself, as in
    the dev stack); ``in_process_sim`` serves it on a thread of this process instead, for a test
    that reaches into the simulated world's objects (``rig.sim.world``).
    Users' requests go through a real Envoy that fleetmend configures (the control plane on a
    thread, Envoy a child process), and the worker acts on it.
    The worker (with its fast path) and the gateway control plane talk to the simulated API server
    as their ServiceAccounts under deploy/k8s's RBAC (``worker.devstack.rbac_wiring``;
    ``rbac_objects``: other RBAC objects instead, e.g. a Role with a rule removed); ``rig.kubeconfigs``
    has each component's kubeconfig, ``rig.sim.kubeconfig`` stays the unrestricted admin's.
    """
    import tempfile

    from sim.runner import start_sim
    from sim.scenario import Scenario, load_scenario
    from worker.devstack.sim_process import scenario_file, start_sim_process

    home = Path(tempfile.mkdtemp(prefix="fleetmend-rig-"))
    served = scenario if isinstance(scenario, Scenario) else load_scenario(scenario_file(scenario, home))
    sim: Any
    if in_process_sim:
        sim = await asyncio.to_thread(start_sim, scenario, speed, kubeconfig=home / "sim" / "kubeconfig")
    else:
        sim = await start_sim_process(scenario_file(scenario, home), home / "sim", speed=speed)
    gateway: LocalGateway | None = None
    rig: FleetRig | None = None
    try:
        # Each process acts as its own ServiceAccount under deploy/k8s's RBAC (the sim enforces it).
        kubeconfigs = await asyncio.to_thread(grant_components, Path(sim.kubeconfig), rbac_objects)
        gateway = LocalGateway(
            kubeconfig=kubeconfigs["gateway"],
            database_url=database_url,
            workdir=Path(sim.kubeconfig).parent / "gateway",
        )
        await asyncio.to_thread(gateway.start)
        settings = load_settings(
            temporal_address=client.service_client.config.target_host,
            temporal_namespace=client.namespace,
            task_queue=task_queue,
            database_url=database_url,
            worker_metrics_port=0,
            **{
                **settings_for_running_sim(sim),
                **gateway.settings_for_clients(),
                **component_settings(kubeconfigs),
                **overrides,
            },
        )
        async with httpx.AsyncClient(base_url=sim.base_url, timeout=10.0) as http:
            reply = await http.put(
                "/sim/v1/gateway", json={"url": gateway.url, "upstream_header": UPSTREAM_HEADER}
            )
            reply.raise_for_status()
            rig = FleetRig(
                client=client,
                settings=settings,
                sim=sim,
                http=http,
                gateway=gateway,
                scenario=served,
                kubeconfigs=kubeconfigs,
            )
            if not run_worker:
                yield rig
                return
            with activity_threads(settings) as pool:
                worker = build_worker(client, settings, activity_executor=pool)
                async with worker:
                    rig.worker = worker
                    yield rig
    finally:
        if rig is not None and rig._envoy is not None:
            rig._envoy.store.engine.dispose()
        if gateway is not None:
            await asyncio.to_thread(gateway.stop)
        await asyncio.to_thread(sim.stop)
        keep_audit_events(getattr(sim, "audit_log", None))
        shutil.rmtree(home, ignore_errors=True)


def keep_audit_events(audit_log: Path | None) -> None:
    """Copy fleetmend's ServiceAccounts' audit events of this run to ``$FLEETMEND_RBAC_AUDIT_DIR``
    (when set: the test suite's RBAC report, tests/deploy/rbac_audit.py, derives the grants used)."""
    target = os.environ.get(AUDIT_DIR_ENV)
    if not target or audit_log is None or not Path(audit_log).is_file():
        return
    Path(target).mkdir(parents=True, exist_ok=True)
    mine = f'"username":"{SA_PREFIX}fleetmend:'
    kept = []
    with Path(audit_log).open(encoding="utf-8") as source:
        for line in source:
            if mine not in line:
                continue
            event = json.loads(line)
            status = event.get("responseStatus") or {}
            kept.append(  # only what the report reads: who, what, the answer
                {
                    "user": {"username": event["user"]["username"]},
                    "verb": event.get("verb"),
                    "objectRef": event.get("objectRef"),
                    "responseStatus": {k: status[k] for k in ("code", "message") if k in status},
                }
            )
    text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in kept)
    (Path(target) / f"{uuid.uuid4().hex}.jsonl").write_text(text, encoding="utf-8")


def compressed_scenario(
    name_or_path: str | Path,
    *,
    startup_s: float = 6.0,
    warm_up_s: float = 15.0,
    warm_rate_tokens_per_s: float | None = 400.0,
    rollout_at_s: float | None = 5.0,
    node_monitor_grace_s: float | None = None,
) -> Any:
    """A shipped scenario with its slow parts shortened, so a whole recovery runs in tens of seconds.

    The simulator then runs at real speed (speed factor 1): fleetmend measures
    rates and durations in wall-clock seconds, exactly as in production, and the
    world's seconds are the same seconds. Image pull + weight load + init take
    ``startup_s`` in total, the prefix cache warms in ``warm_up_s``, and the
    per-replica rate is lowered so a loaded demo fleet fits a 2-core machine.
    ``node_monitor_grace_s`` shortens how long a silent kubelet's node stays Ready (None keeps
    Kubernetes' 50 s, for the procedures that must act before the node turns NotReady).
    """
    from sim.scenario import SCENARIO_DIR, load_scenario

    path = Path(name_or_path)
    if not path.suffix:
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
    scenario = load_scenario(path)
    models = []
    for m in scenario.models:
        total = m.image_pull_s + m.weight_load_s + m.distributed_init_s or 1.0
        share = startup_s / total
        update: dict[str, Any] = {
            "image_pull_s": round(m.image_pull_s * share, 2),
            "weight_load_s": round(m.weight_load_s * share, 2),
            "distributed_init_s": round(m.distributed_init_s * share, 2),
            "warm_up_s": warm_up_s,
            # vLLM's --shutdown-timeout and the pod's grace period, shortened in the same spirit.
            "shutdown_timeout_s": min(m.shutdown_timeout_s, 10.0),
            "termination_grace_s": min(m.termination_grace_s, 15),
        }
        if warm_rate_tokens_per_s is not None:
            update["warm_rate_tokens_per_s"] = warm_rate_tokens_per_s
        models.append(m.model_copy(update=update))
    workloads = []
    for w in scenario.workloads:
        if w.rollout is not None and rollout_at_s is not None:
            w = w.model_copy(update={"rollout": w.rollout.model_copy(update={"at_s": rollout_at_s})})
        workloads.append(w)
    changes: dict[str, Any] = {"models": models, "workloads": workloads}
    if node_monitor_grace_s is not None:
        changes["timings"] = scenario.timings.model_copy(
            update={"node_monitor_grace_s": node_monitor_grace_s}
        )
    return scenario.model_copy(update=changes)
