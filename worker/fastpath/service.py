"""The fast path beside the alert path: watch the world directly and open the pool's incident in seconds.

Once per cluster (``LeaderElector`` on a Lease) the worker runs three informers
(Nodes; Pods of the managed pools, i.e. carrying the model label; EndpointSlices)
and reads the gateway's own view of the engines' health: every Envoy already
health-checks each engine and ejects outliers, and the fast path reads that
verdict through Envoy's admin API (``worker/fastpath/envoy.py``: a few figures per
cluster each ``fastpath_envoy_interval_s``, the hosts only when they moved). An
engine Envoy takes out of rotation, or whose EndpointSlice endpoint turns
not-ready, is a *suspect*: the fast path checks that engine's ``/health`` itself
(``health_url_template``; at most ``fastpath_confirm_concurrency`` checks in flight)
until ``fleet.detection`` settles it. Nothing is polled per pod while every engine
answers, and every informer handler costs O(1) per event (``worker/fastpath/index.py``).
The same Envoy reading carries each pool's admitted-requests counter; a few seconds of it
(``CounterHistory``) give every loss report the pool's arrival rate from before the loss.

Each observation becomes ``fleet.detection.Evidence``; the pure policy decides; a
confirmed loss is delivered through the ``AlertIntake`` the webhook uses too
(``worker/intake/``) — the same signal-with-start into the pool's ``FleetIncident`` —
with one report per affected replica group (resolved by the intake's ``PoolTopology``), so the
Alertmanager alert that arrives later names the same groups and is absorbed by
the open incident. A slow-but-present replica is recorded as not-a-loss
(logged and counted) and opens nothing.

A node that holds a managed pool's pod and turns not-Ready also gets its fence at once: one
``NodeFence`` run (``workflows/fence.py``) that cordons it, ahead of any incident's looks.
Deliveries and fence starts run beside the detector, so a burst's losses never wait on one
another's signal-with-start.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
from kubernetes import client as k8s
from sqlalchemy import Engine
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy

from fleet.arrivals import arrivals_before
from fleet.detection import Detection, DetectionPolicy, EntityState, Evidence, EvidenceKind, Verdict, observe
from fleet.fence import fence_workflow_id
from fleet.fleet_event import AttributeTally, NodeAttribute, NodeLoss, fleet_event_workflow_id
from fleet.incident import LossReport, PoolRef, Severity, incident_workflow_id
from fleet.qualification import gpu_problem_conditions
from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL, MODEL_LABEL
from gateway.store import GatewayStore, envoy_admin_urls
from kube.client import kube_apis
from kube.informer import Informer
from kube.lease import LeaderElector
from ledger.store import make_engine
from worker.config import Settings
from worker.fastpath.envoy import CounterHistory, EnvoyHealthView, GatewayChanges, HostHealth
from worker.fastpath.index import PodIndex
from worker.intake.intake import AlertIntake, Delivery
from worker.intake.metrics import WebhookMetrics
from worker.intake.routing import AlertRouter, RoutedReport
from worker.intake.rules import RuleAction, load_alert_rules
from worker.intake.topology import PodNotFound, PoolTopology
from workflows.fence import NodeFence, NodeFenceInput
from workflows.fleet_event import FleetEvent, FleetEventInput

log = logging.getLogger("fleetmend.fastpath")

FAST_PATH_ALERT = "FleetmendFastPathLoss"
EVIDENCE_LABEL = "fleetmend_evidence"
LEASE_USER_AGENT = "fleetmend-leader-election/0.1"
# The fast path's own /health checks of suspects, and its reads of Envoy's admin API, say who asks.
FASTPATH_USER_AGENT = "fleetmend-fastpath/0.1"
# An address Envoy reports that no pod has (yet): looked up again each reading for this long
# (the pods watch may deliver the pod's IP a moment after Envoy added the host).
UNMAPPED_RETRY_S = 30.0

Deliver = Callable[[list[RoutedReport]], Awaitable[list[Delivery | None]]]
# Start the fence of a node confirmed lost: (node, its managed pools, the evidence, when it was first
# seen, its topology domains: label -> value, its node-level attributes with the fleet's share of each).
Fence = Callable[[str, list[PoolRef], str, float, dict[str, str], dict[str, NodeAttribute]], Awaitable[None]]


def default_identity() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class FastPath:
    def __init__(
        self,
        settings: Settings,
        deliver: Deliver,
        topology: PoolTopology,
        *,
        identity: str | None = None,
        policy: DetectionPolicy | None = None,
        fence: Fence | None = None,
    ) -> None:
        self.settings = settings
        self._deliver = deliver
        self._fence = fence
        self._fenced: set[str] = set()  # nodes whose fence started in this spell of not-Ready (nodes thread)
        # The fleet's node-level attributes (driver, kernel, instance type), from node events (nodes thread).
        self._attributes = AttributeTally(settings.fleet_event_node_labels)
        self._tasks: set[asyncio.Task[None]] = set()  # deliveries and fence starts in flight
        self._topology = topology
        self.identity = identity or settings.fastpath_identity or default_identity()
        self.policy = policy or DetectionPolicy(
            failures_to_confirm=settings.fastpath_failures_to_confirm,
            slow_health_s=settings.fastpath_slow_health_s,
        )
        self._coordination: k8s.CoordinationV1Api | None = None
        self.elector = LeaderElector(
            self._coordination_api,
            namespace=settings.fastpath_lease_namespace,
            name=settings.fastpath_lease_name,
            identity=self.identity,
            lease_duration_s=settings.fastpath_lease_duration_s,
            renew_deadline_s=settings.fastpath_renew_deadline_s,
            retry_period_s=settings.fastpath_retry_period_s,
        )
        self._states: dict[str, EntityState] = {}
        self._gone: dict[str, dict[str, Any]] = {}  # routed pods deleted, by ns/name (their last state)
        self._restarts: dict[str, int] = {}  # container restarts seen per rank pod uid (pods informer thread)
        self.index = PodIndex(self._routed)  # kept by the pods informer's handler
        self.detections: list[Detection] = []  # the record of every loss / not-a-loss verdict
        self.counts: Counter[str] = Counter()
        self.informers: list[Informer] = []
        self.gateway: EnvoyHealthView | None = None  # Envoy's health view, while leading
        # Each pool's admitted-requests counter over the last seconds: a report's pre-loss arrivals.
        self.counters = CounterHistory()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Evidence] | None = None
        self._http: httpx.AsyncClient | None = None
        self._checks: dict[str, asyncio.Task[None]] = {}  # suspects being checked directly, by entity
        self._checked_at: dict[str, float] = {}  # when each entity's last direct check round ended
        # The GPU problem conditions last checked per node (nodes informer thread): one check per spell.
        self._gpu_checked: dict[str, tuple[str, ...]] = {}
        self._check_slots: asyncio.Semaphore | None = None  # made on the loop that leads
        self._unmapped: dict[tuple[str, str, int], tuple[HostHealth, bool, float]] = {}
        self._store_engine: Engine | None = None
        self._admins: list[str] | None = None
        self._admins_read_at = -math.inf

    def _coordination_api(self) -> k8s.CoordinationV1Api:
        """The Lease client: its own user agent, so ledger reconcile does not take lease renewals for
        unledgered actions on the world (they are fleetmend's coordination, like client-go's)."""
        if self._coordination is None:
            api = k8s.ApiClient(kube_apis(self.settings).core.api_client.configuration)
            api.user_agent = LEASE_USER_AGENT
            self._coordination = k8s.CoordinationV1Api(api)
        return self._coordination

    def state(self, entity: str) -> EntityState | None:
        """What the detector holds about ``entity`` (``pod:<ns>/<name>`` or ``node:<name>``)."""
        return self._states.get(entity)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Campaign for the Lease; lead (watch + read Envoy's view) while holding it."""
        log.info("fast path: campaigning", extra={"identity": self.identity})
        try:
            await self.elector.run(stop, self._lead)
        finally:
            if self._store_engine is not None:
                self._store_engine.dispose()
                self._store_engine = None

    async def _lead(self, lost: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        self._states.clear()
        self._checked_at.clear()
        self._unmapped.clear()
        self._fenced.clear()
        self._attributes = AttributeTally(self.settings.fleet_event_node_labels)
        self._gpu_checked.clear()
        self._check_slots = asyncio.Semaphore(self.settings.fastpath_confirm_concurrency)
        self.index = PodIndex(self._routed)
        core = kube_apis(self.settings).core
        discovery = kube_apis(self.settings).discovery
        timeout = self.settings.fastpath_watch_timeout_s
        pods = Informer(
            "pods",
            core.list_pod_for_all_namespaces,
            self._on_pod,
            label_selector=MODEL_LABEL,
            watch_timeout_s=timeout,
        )
        self.informers = [
            Informer("nodes", core.list_node, self._on_node, watch_timeout_s=timeout),
            pods,
            Informer(
                "endpointslices",
                discovery.list_endpoint_slice_for_all_namespaces,
                self._on_slice,
                watch_timeout_s=timeout,
            ),
        ]
        halt = threading.Event()
        threads = [
            threading.Thread(target=i.run, args=(halt,), name=f"fastpath-{i.name}", daemon=True)
            for i in self.informers
        ]
        for t in threads:
            t.start()
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(self.settings.fastpath_health_timeout_s),
            headers={"User-Agent": FASTPATH_USER_AGENT},
        )
        tasks = [
            asyncio.create_task(self._consume(), name="fastpath-detect"),
            asyncio.create_task(self._read_gateway(lost, pods), name="fastpath-gateway"),
            asyncio.create_task(self._say_when_watching(), name="fastpath-synced"),
        ]
        try:
            await lost.wait()
        finally:
            halt.set()
            for i in self.informers:
                i.stop()
            running = [*tasks, *self._checks.values(), *self._tasks]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self._checks.clear()
            await self._http.aclose()
            self._http = None
            self.gateway = None

    # -- informer handlers (informer threads) -------------------------------------------------

    async def _say_when_watching(self) -> None:
        """Log once every informer holds its first snapshot: from then on no loss goes unseen (a
        leader that just took over says when it is actually watching)."""
        while not all(i.synced for i in self.informers):
            await asyncio.sleep(0.1)
        log.info("fast path: watching", extra={"identity": self.identity})

    def _push(self, evidence: Evidence) -> None:
        loop, queue = self._loop, self._queue
        if loop is not None and queue is not None:
            loop.call_soon_threadsafe(queue.put_nowait, evidence)

    def _routed(self, pod: dict[str, Any]) -> bool:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return bool(labels.get(self.settings.router_label) == self.settings.router_label_value)

    def _on_node(self, kind: str, node: dict[str, Any]) -> None:
        name = (node.get("metadata") or {}).get("name") or ""
        conditions = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type")]
        ready = next((c for c in conditions if c["type"] == "Ready"), None)
        status = ready.get("status") if ready else "Unknown"
        at = time.time()
        labels = (node.get("metadata") or {}).get("labels") or {}
        problems = gpu_problem_conditions({c["type"]: str(c.get("status")) for c in conditions})
        self._attributes.update(name, None if kind == "DELETED" else labels, down=status != "True")
        self._fence_if_lost(name, kind, status, ready, labels, problems, conditions)
        if not self.index.serves_on(name):
            return  # no routed pod of a managed pool there
        if kind != "DELETED" and status == "True":
            if problems:
                if self._gpu_checked.get(name) == tuple(problems):
                    return  # this spell of the condition was checked already
                self._gpu_checked[name] = tuple(problems)
                detail = condition_words(conditions, problems)
                loop = self._loop
                if loop is not None:
                    loop.call_soon_threadsafe(self._spawn_gpu_check, name, detail, at)
                return
            self._gpu_checked.pop(name, None)
            self._push(Evidence(entity=f"node:{name}", kind=EvidenceKind.NODE_READY, at=at))
            return
        detail = "node deleted" if kind == "DELETED" else f"Ready={status}: {(ready or {}).get('reason', '')}"
        self._push(Evidence(entity=f"node:{name}", kind=EvidenceKind.NODE_NOT_READY, at=at, detail=detail))

    def _fence_if_lost(
        self,
        name: str,
        kind: str,
        status: str | None,
        ready: dict[str, Any] | None,
        labels: dict[str, str],
        problems: list[str],
        conditions: list[dict[str, Any]],
    ) -> None:
        """Start the node's fence once per spell of not-Ready or of a GPU problem condition, when a
        managed pool has a pod on it (routed or not: a node whose replicas were already derouted is
        still no place for a new one).

        Only a not-Ready node joins its failure domains' fleet events: a GPU condition on a Ready node
        is a signal about the node, not a loss, and a wrong one on many nodes at once (a bad health
        check) is what the removal breaker holds, not a rack's common cause."""
        if self._fence is None:
            return
        if kind != "DELETED" and status == "True" and not problems:
            self._fenced.discard(name)
            return
        if kind == "DELETED" or name in self._fenced or not self.index.hosts(name):
            return
        self._fenced.add(name)
        loop = self._loop
        if loop is None:
            return
        attributes: dict[str, NodeAttribute] = {}
        if status == "True":
            evidence = condition_words(conditions, problems)
            domains: dict[str, str] = {}
        else:
            evidence = f"Ready={status}: {(ready or {}).get('reason', '')}".strip()
            domains = {
                label: str(value)
                for label in self.settings.fleet_event_topology_labels
                if (value := labels.get(label))
            }
            attributes = self._attributes.attributes(name)
        fence = self._start_fence(name, evidence, time.time(), domains, attributes)
        loop.call_soon_threadsafe(self._spawn, fence, f"fence-{name}")

    def _spawn_gpu_check(self, node: str, detail: str, at: float) -> None:
        self._spawn(self._check_gpu_fault(node, detail, at), f"gpu-{node}")

    async def _check_gpu_fault(self, node: str, detail: str, at: float) -> None:
        """A GPU problem condition on a Ready node is a loss of the node only if an engine there fails
        its own ``/health`` twice, an interval apart (one slow answer under load is no death). A
        condition on a node whose engines all answer is a signal about the node (its fence asks the
        removal breaker), not a lost replica: a bad health check on most of the fleet opens no
        incident at all. Without a way to probe (not leading), it is a loss at once and the recovery
        confirms it."""
        evidence = Evidence(entity=f"node:{node}", kind=EvidenceKind.NODE_GPU_FAULT, at=at, detail=detail)
        pods = self.index.routed_on(node)
        slots = self._check_slots
        if self._http is None or slots is None or not pods:
            self._queue_put(evidence)
            return

        async def probe(pod: dict[str, Any]) -> Evidence:
            async with slots:
                return await self._probe(pod)

        checks = await asyncio.gather(*(probe(p) for p in pods))
        self.counts["health_checks"] += len(checks)
        failed = [c for c in checks if c.kind is EvidenceKind.HEALTH_FAILED]
        if failed:  # as for any suspect, a failure counts once confirmed: look again an interval later
            await asyncio.sleep(self.settings.fastpath_health_interval_s)
            again = {c.entity.partition(":")[2] for c in failed}
            second = await asyncio.gather(
                *(probe(p) for p in pods if f"{p['metadata']['namespace']}/{p['metadata']['name']}" in again)
            )
            self.counts["health_checks"] += len(second)
            failed = [c for c in second if c.kind is EvidenceKind.HEALTH_FAILED]
            checks = [*checks, *second]
        if failed:
            named = ", ".join(f"{c.entity.partition(':')[2]} ({c.detail})" for c in failed)
            self._queue_put(evidence.model_copy(update={"detail": f"{detail}; failing /health: {named}"}))
            return
        detection = Detection(
            entity=evidence.entity,
            verdict=Verdict.NOT_A_LOSS,
            reason=f"{evidence.entity}: {detail}, but all {len(pods)} engine(s) there answer /health: "
            "a signal about the node, not a lost replica (its fence asks the removal breaker)",
            evidence=(evidence, *checks),
        )
        self.detections.append(detection)
        self.counts[detection.verdict.value] += 1
        log.info("fast path: not-a-loss", extra={"entity": detection.entity, "reason": detection.reason})

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run ``work`` beside the detector (a delivery, a fence start); cancelled when leadership ends."""
        task = asyncio.get_running_loop().create_task(work, name=f"fastpath-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        self.index.update(kind, pod)
        meta = pod.get("metadata") or {}
        if kind != "DELETED":
            self._rank_restart(pod)
            return
        self._restarts.pop(str(meta.get("uid") or ""), None)
        if not self._routed(pod):
            return
        self._gone[f"{meta.get('namespace')}/{meta.get('name')}"] = pod
        node = (pod.get("spec") or {}).get("nodeName") or ""
        grace = meta.get("deletionGracePeriodSeconds") or 0
        self._push(
            Evidence(
                entity=f"pod:{meta.get('namespace')}/{meta.get('name')}",
                # Deleted with a grace period: planned unless it was failing (fleet.detection decides).
                kind=EvidenceKind.POD_TERMINATED if grace > 0 else EvidenceKind.POD_GONE,
                at=time.time(),
                detail=(f"deleted after a {grace} s grace period" if grace > 0 else "force-deleted")
                + f" while carrying {self.settings.router_label}"
                + (f" on {node}" if node else ""),
            )
        )

    def _rank_restart(self, pod: dict[str, Any]) -> None:
        """A worker rank of a multi-node group (LeaderWorkerSet worker-index > 0) whose container
        restarted: the group's communicator is broken, so it is evidence about the group's routed
        leader. Restarts are counted per pod uid from the first sight (a re-list after a broken watch
        reports a restart it missed; a restart from before fleetmend looked is history, not news)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        index = labels.get(LWS_WORKER_INDEX_LABEL)
        if index in (None, "0"):
            return
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
        uid = str(meta.get("uid") or "")
        seen = self._restarts.get(uid)
        self._restarts[uid] = restarts
        if seen is None or restarts <= seen:
            return
        namespace, group = str(meta.get("namespace") or ""), labels.get(LWS_GROUP_KEY_LABEL)
        leader = self.index.leader(namespace, group) if group is not None else None
        if leader is None or not self._routed(leader):
            return
        ended = (
            next(
                (
                    c.get("lastState", {}).get("terminated")
                    for c in statuses
                    if c.get("lastState", {}).get("terminated")
                ),
                None,
            )
            or {}
        )
        self._push(
            Evidence(
                entity=f"pod:{namespace}/{leader['metadata']['name']}",
                kind=EvidenceKind.RANK_FAILED,
                at=time.time(),
                detail=f"rank {meta.get('name')} (worker {index}) restarted: {ended.get('reason', '?')} "
                f"exit {ended.get('exitCode', '?')}: {ended.get('message', '')}".strip(),
            )
        )

    def _on_slice(self, kind: str, eps: dict[str, Any]) -> None:
        if kind == "DELETED":
            return
        namespace = (eps.get("metadata") or {}).get("namespace")
        for ep in eps.get("endpoints") or []:
            ref = ep.get("targetRef") or {}
            conditions = ep.get("conditions") or {}
            if ref.get("kind") != "Pod" or conditions.get("ready") is not False:
                continue
            key = f"{ref.get('namespace') or namespace}/{ref.get('name')}"
            if not self.index.routed(key):
                continue
            terminating = bool(conditions.get("terminating"))
            self._push(
                Evidence(
                    entity=f"pod:{key}",
                    kind=EvidenceKind.POD_TERMINATED if terminating else EvidenceKind.ENDPOINT_NOT_READY,
                    at=time.time(),
                    detail="EndpointSlice endpoint terminating"
                    if terminating
                    else "EndpointSlice endpoint ready=false",
                )
            )

    # -- the gateway's view ----------------------------------------------------------------------

    async def _admin_urls(self) -> list[str]:
        """The Envoys to read (``gateway.store.envoy_admin_urls``: configured, else announced to the
        control plane), re-read every ``fastpath_envoy_discovery_s``."""
        now = time.monotonic()
        if self._admins is None or now - self._admins_read_at >= self.settings.fastpath_envoy_discovery_s:
            configured = self.settings.gateway_admin_urls
            store = None if configured else self._store()
            found = await asyncio.to_thread(envoy_admin_urls, configured, store)
            if not found and self._admins != found:
                log.warning(
                    "fast path: no Envoy to read (FLEETMEND_GATEWAY_ADMIN_URLS is unset and no Envoy is "
                    "connected to the control plane): engines are watched through Kubernetes only"
                )
            self._admins, self._admins_read_at = found, now
        return self._admins

    def _store(self) -> GatewayStore | None:
        url = self.settings.database_url_value()
        if not url:
            return None
        if self._store_engine is None:
            self._store_engine = make_engine(url, pool_size=1, max_overflow=1, pre_ping=True)
        return GatewayStore(self._store_engine)

    async def _read_gateway(self, lost: asyncio.Event, pods: Informer) -> None:
        """Read Envoy's health view every ``fastpath_envoy_interval_s`` once the pods are listed (an
        address is mapped to its pod through their index)."""
        while not pods.lists and not lost.is_set():
            await asyncio.sleep(0.05)
        assert self._http is not None
        view = EnvoyHealthView(self._http, self._admin_urls)
        self.gateway = view
        self.counters = CounterHistory()  # a count from before this leadership says nothing about now
        interval = self.settings.fastpath_envoy_interval_s
        while not lost.is_set():
            started = time.monotonic()
            try:
                changes = await view.poll()
            except Exception as err:  # the control plane's record unreadable: try again next time
                log.warning("fast path: reading Envoy's view failed", extra={"error": str(err)[:300]})
                self._admins = None
            else:
                if view.first_attempts is not None:
                    self.counters.record(
                        view.first_attempts_at, view.first_attempts, view.first_attempts_from
                    )
                self._on_gateway(changes)
            self.counts["gateway_readings"] += 1
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _on_gateway(self, changes: GatewayChanges) -> None:
        """Evidence from what moved in Envoy's view: a host that turned healthy has answered; a host
        Envoy fails is a suspect (again after ``fastpath_reconfirm_s`` while Envoy keeps failing it
        and its own /health answers)."""
        now, at = time.monotonic(), time.time()
        fresh = {(h.admin, h.address, h.port) for h in [*changes.healthy, *(h for h, _ in changes.failing)]}
        retry = [v for k, v in self._unmapped.items() if k not in fresh and now - v[2] < UNMAPPED_RETRY_S]
        self._unmapped.clear()
        seen: set[tuple[str, bool]] = set()
        for host, new, first in [
            *((h, True, now) for h in changes.healthy),
            *((h, new, now) for h, new in changes.failing),
            *retry,
        ]:
            key = self.index.by_ip(host.address)
            if key is None:
                self._unmapped[(host.admin, host.address, host.port)] = (host, new, first)
                continue
            entity, failing = f"pod:{key}", bool(host.failed)
            if not self.index.routed(key) or (entity, failing) in seen:
                continue
            seen.add((entity, failing))
            if not failing:
                kind = EvidenceKind.GATEWAY_HEALTHY
            elif new or (
                entity not in self._checks
                and now - self._checked_at.get(entity, -math.inf) >= self.settings.fastpath_reconfirm_s
            ):
                kind = EvidenceKind.GATEWAY_UNHEALTHY
            else:
                continue
            self._queue_put(Evidence(entity=entity, kind=kind, at=at, detail=host.describe()))

    # -- direct /health checks of suspects -------------------------------------------------------

    def _probed(self, pod: dict[str, Any]) -> bool:
        """Routed, running, not terminating. Ready or not: an engine that answered once and then
        stops answering (a crashed container restarting in place) is failing, while one that never
        answered is starting, and fleet.detection does not count those failures."""
        if not self._routed(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
            return False
        return bool((pod.get("status") or {}).get("phase") == "Running")

    async def _check(self, entity: str) -> None:
        """Check a suspect's /health every ``fastpath_health_interval_s`` until the detector no longer
        asks for it (a loss reported, the suspicion cleared, a reported engine re-armed), at most
        ``failures_to_confirm + successes_to_clear`` times; at most ``fastpath_confirm_concurrency``
        checks are in flight across suspects."""
        key = entity.partition(":")[2]
        budget = self.policy.failures_to_confirm + self.policy.successes_to_clear
        try:
            for n in range(budget):
                if n:
                    await asyncio.sleep(self.settings.fastpath_health_interval_s)
                state = self._states.get(entity)
                pod = self.index.pod(key)
                if state is None or not state.confirming:
                    return
                if pod is None or not self._probed(pod):
                    return  # gone or terminating: the pods and EndpointSlices watches say what it was
                assert self._check_slots is not None
                async with self._check_slots:
                    evidence = await self._probe(pod)
                self.counts["health_checks"] += 1
                await self._handle(evidence)
        finally:
            self._checks.pop(entity, None)
            self._checked_at[entity] = time.monotonic()
            state = self._states.get(entity)
            if state is not None and state.confirming:  # the round is over; the gateway may ask again
                self._states[entity] = state.model_copy(update={"confirming": False})

    async def _probe(self, pod: dict[str, Any]) -> Evidence:
        meta = pod.get("metadata") or {}
        ns, name = meta.get("namespace") or "", meta.get("name") or ""
        ip = (pod.get("status") or {}).get("podIP") or ""
        entity = f"pod:{ns}/{name}"
        at = time.time()
        if not ip and "{pod_ip}" in self.settings.health_url_template:
            return Evidence(entity=entity, kind=EvidenceKind.HEALTH_FAILED, at=at, detail="no pod IP")
        url = self.settings.health_url_template.format(pod_ip=ip, namespace=ns, pod=name)
        assert self._http is not None
        started = time.monotonic()
        try:
            r = await self._http.get(url)
        except httpx.HTTPError as err:
            return Evidence(entity=entity, kind=EvidenceKind.HEALTH_FAILED, at=at, detail=type(err).__name__)
        took = time.monotonic() - started
        if r.status_code == 200:
            return Evidence(entity=entity, kind=EvidenceKind.HEALTH_OK, at=at, latency_s=took)
        return Evidence(
            entity=entity, kind=EvidenceKind.HEALTH_FAILED, at=at, detail=f"/health HTTP {r.status_code}"
        )

    def _queue_put(self, evidence: Evidence) -> None:
        if self._queue is not None:
            self._queue.put_nowait(evidence)

    # -- detection and delivery ----------------------------------------------------------------

    async def _consume(self) -> None:
        assert self._queue is not None
        while True:
            await self._handle(await self._queue.get())

    async def _handle(self, evidence: Evidence) -> None:
        state, detection = observe(self._states.get(evidence.entity), evidence, self.policy)
        self._states[evidence.entity] = state
        if state.confirming and evidence.entity not in self._checks and evidence.entity.startswith("pod:"):
            self._checks[evidence.entity] = asyncio.create_task(
                self._check(evidence.entity), name=f"fastpath-check-{evidence.entity}"
            )
        if detection.verdict is Verdict.WAIT:
            return
        self.detections.append(detection)
        self.counts[detection.verdict.value] += 1
        log.info(
            f"fast path: {detection.verdict.value}",
            extra={"entity": detection.entity, "reason": detection.reason},
        )
        if detection.loss:
            # Delivered beside the next evidence, not before it: in a burst one slow signal-with-start
            # must not hold every later loss (the intake bounds the signals in flight).
            self._spawn(self._report_or_rearm(detection), f"report-{detection.entity}")

    async def _report_or_rearm(self, detection: Detection) -> None:
        """Report the loss; when it could not be delivered, or routed to any pool, re-arm the entity so
        its next evidence reports it (the alert path still opens the incident meanwhile)."""
        try:
            routed = await self._report(detection)
        except Exception as err:
            self.counts["reports_failed"] += 1
            log.warning(
                "fast path: delivery failed",
                extra={"entity": detection.entity, "error": str(err)[:300]},
            )
            routed = False
        if routed:
            return
        current = self._states.get(detection.entity)
        if current is not None:
            self._states[detection.entity] = current.model_copy(update={"reported": False})

    async def _report(self, detection: Detection) -> bool:
        """Deliver the loss to every pool it hits; False when it hit none that could be found."""
        kind, _, name = detection.entity.partition(":")
        # When this spell of failing evidence began: the report's start (an alert's startsAt), and the
        # pre-loss count ends before it. Not the first evidence kept, which can be a healthy reading from
        # long before the loss (and would change the report's identity as old evidence ages out).
        spell_at = detection.spell_started_at or time.time()
        # (pool, replica group or None, node, pod) for every affected group.
        targets: list[tuple[PoolRef, str | None, str | None, str | None]] = []
        if kind == "node":
            for g in await self._topology.groups_on_node(name):
                targets.append((g.pool, g.replica_group, name, g.pods[0] if len(g.pods) == 1 else None))
        else:
            ns, _, pod = name.partition("/")
            try:
                groups = await self._topology.groups_of_pod(ns, pod)
            except PodNotFound:
                groups = []
            for g in groups:
                targets.append((g.pool, g.replica_group, g.nodes[0] if len(g.nodes) == 1 else None, pod))
            if not groups:  # deleted: no group to resolve any more; the pod and its node name the loss
                targets.extend(await asyncio.to_thread(self._gone_pod_pools, ns, pod))
        routed = []
        for pool, group, node, pod_name in targets:
            report = LossReport(
                pool=pool,
                fingerprint=f"fastpath/{detection.entity}/{group or ''}"[:200],
                alert_name=FAST_PATH_ALERT,
                severity=Severity.CRITICAL,
                node=node,
                pod=pod_name,
                replica_group=group,
                about="node" if kind == "node" else "pod",
                observed_at=spell_at,
                source="fastpath",
                labels={EVIDENCE_LABEL: detection.reason[:500]},
                arrivals_before=arrivals_before(self.counters.readings(pool.key), spell_at),
            )
            routed.append(RoutedReport(incident_workflow_id(pool), RuleAction.START_INCIDENT, report))
        if not routed:
            # A pod the API no longer has, whose deletion the watch has not brought yet (the group's
            # controller deleted it between the evidence and this lookup): re-armed, the deletion
            # event that follows is evidence that reports it, with the pod's last labels.
            self.counts["reports_unrouted"] += 1
            log.info("fast path: the lost entity serves no managed pool", extra={"entity": detection.entity})
            return False
        await self._deliver(routed)
        self.counts["reports_delivered"] += len(routed)
        return True

    async def _start_fence(
        self,
        node: str,
        evidence: str,
        at: float,
        domains: dict[str, str],
        attributes: dict[str, NodeAttribute],
    ) -> None:
        """The node's fence at detection (``fleet.fence``), for the pools with a pod on it. If it cannot
        start, each recovery's own fence step still cordons the node (later): logged, not retried here."""
        assert self._fence is not None
        try:
            groups = await self._topology.groups_on_node(node)
            pools = sorted({g.pool for g in groups}, key=lambda p: p.key)
            if pools:
                await self._fence(node, pools, evidence, at, domains, attributes)
                self.counts["fences_started"] += 1
                log.info(
                    "fast path: fence started", extra={"node": node, "after_s": round(time.time() - at, 3)}
                )
        except Exception as err:
            log.warning("fast path: fence not started", extra={"node": node, "error": str(err)[:300]})
            self._fenced.discard(node)  # the node's next event tries again

    def _gone_pod_pools(
        self, namespace: str, pod: str
    ) -> list[tuple[PoolRef, str | None, str | None, str | None]]:
        """A deleted pod's pools: the Services whose selector its last labels match."""
        gone = self._gone.pop(f"{namespace}/{pod}", None)
        if gone is None:
            return []
        labels = (gone.get("metadata") or {}).get("labels") or {}
        node = (gone.get("spec") or {}).get("nodeName") or None
        services = kube_apis(self.settings).core.list_namespaced_service(namespace, _request_timeout=5.0)
        out: list[tuple[PoolRef, str | None, str | None, str | None]] = []
        for svc in services.items:
            selector = (svc.spec.selector if svc.spec else None) or {}
            name = svc.metadata.name if svc.metadata else None
            if name and selector and all(labels.get(k) == v for k, v in selector.items()):
                out.append((PoolRef(namespace=namespace, service=name), None, node, pod))
        return out


def condition_words(conditions: list[dict[str, Any]], problems: list[str]) -> str:
    """The GPU problem conditions in their own words: ``GpuXid=True: XidError Xid 79 on GPU 0 ...``."""
    return "; ".join(
        f"{c['type']}=True: {c.get('reason', '')} {c.get('message', '')}".strip()
        for c in conditions
        if c["type"] in problems
    )


def build_fast_path(
    settings: Settings, client_factory: Callable[[], Awaitable[Any]], *, identity: str | None = None
) -> FastPath:
    """The fast path wired like the webhook: the intake's topology, rules and signal-with-start."""
    topology = PoolTopology.from_settings(settings)
    intake = AlertIntake(
        settings,
        AlertRouter(load_alert_rules(settings.alert_rules_file), topology),
        client_factory,
        WebhookMetrics(),
    )
    fence = fence_starter(settings, client_factory) if settings.fence_at_detection else None
    return FastPath(settings, intake.deliver, topology, identity=identity, fence=fence)


def fence_starter(settings: Settings, client_factory: Callable[[], Awaitable[Any]]) -> Fence:
    """Start ``NodeFence`` under ``fence/<node>``: a second start while one runs joins it (USE_EXISTING);
    one that has ended lets a later loss of the node start a new run, which finds it cordoned."""

    async def fence(
        node: str,
        pools: list[PoolRef],
        evidence: str,
        detected_at: float,
        domains: dict[str, str],
        attributes: dict[str, NodeAttribute],
    ) -> None:
        client = await client_factory()
        await client.start_workflow(
            NodeFence.run,
            NodeFenceInput(
                node=node,
                pools=pools,
                evidence=evidence[:500],
                detected_at=detected_at,
                timings=settings.recovery_timings,
                breaker=settings.removal_breaker,
                dry_run=settings.dry_run,
            ),
            id=fence_workflow_id(node),
            task_queue=settings.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            static_summary=f"Fence {node} at detection (cordon): {evidence[:200]}",
        )
        # The node joins the fleet event of each of its failure domains and of each of its node-level
        # attributes (fleet.fleet_event).
        loss = NodeLoss(
            node=node,
            pools=pools,
            evidence=evidence[:500],
            at=detected_at,
            domains=domains,
            attributes=attributes,
        )
        order = settings.fleet_event_topology_labels  # narrowest first
        events = [(label, domains[label], order[:i]) for i, label in enumerate(order) if label in domains]
        # A node-level attribute's event defers to any topology domain that holds every loss; a value
        # every node carries can never be named (fleet.fleet_event), so it starts no event at all.
        events += [
            (label, attr.value, list(order))
            for label, attr in attributes.items()
            if attr.holding < attr.carrying
        ]
        for label, value, narrower in events:
            await client.start_workflow(
                FleetEvent.run,
                FleetEventInput(
                    label=label,
                    value=value,
                    narrower=narrower,
                    first_pool=pools[0],
                    timings=settings.recovery_timings,
                    dry_run=settings.dry_run,
                ),
                id=fleet_event_workflow_id(label, value),
                task_queue=settings.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                start_signal="node_lost",
                start_signal_args=[loss],
                static_summary=f"Fleet event: node losses in {label}={value}",
            )

    return fence
