"""``SimWorld``: the whole simulated cluster in one object.

It owns the clock (real time x ``speed``; every duration is in sim seconds),
the object store, the control plane (controllers, scheduler, node lifecycle,
kubelet), the action log, the API fault knobs and the scenario it was built
from. The API server (``sim.app``) and the serving layer (``sim.serving``)
both act on it.

Stable interface for the serving layer (all thread-safe, all return copies):

Reading the cluster
    world.clock.now() -> float                 sim epoch seconds; world.clock.speed; await world.clock.sleep(s)
    world.pods(namespace=None, label_selector=None) -> list[dict]
    world.pod(namespace, name) -> dict | None
    world.nodes() -> list[dict]
    world.services(namespace=None) -> list[dict]
    world.endpointslices(namespace=None, service=None) -> list[dict]
    world.model_for_pod(pod) -> ModelSpec | None      (from the fleetmend.io/model label)
    world.revision_for_pod(pod) -> ModelRevision | None
    world.is_node_lost(name) -> bool
    world.store.watch(callback) -> unsubscribe         callback(WatchEvent(type, resource, object))
    world.store.list_view(plural, ns, label_selector)  the stored objects without copies: READ-ONLY
    world.control.runtime(ns, pod) -> PodRuntime | None   the kubelet's view (ip, restarts, started_at)
    world.serving                          the serving layer once ``sim.serving.attach`` ran (else None)
    world.actions / world.api_faults       action log and API fault knobs (also over HTTP, see sim.app)
    world.audit                            the API server's audit log (sim.k8s.audit), while it serves

Acting on it (what faults do)
    world.lose_node(name)                 kubelet stops reporting: Unknown -> tainted -> pods deleted
    world.restore_node(name)              kubelet reports again
    world.set_container_state(ns, pod, "crashed" | "oomkilled", message="")
                                          container dies: restartCount+1, CrashLoopBackOff, restarts
    world.set_container_ready(ns, pod, ready: bool | None)
                                          readiness probe result override (None = follow start-up)
    world.set_pod_condition(ns, pod, type, status, reason="", message="")
    world.finish_termination(ns, pod)     the engine drained and exited before the grace period ended
    world.register_fault_handler(kind, handler)   handler(FaultRequest) for faults this module does not own
    world.inject_fault(FaultRequest)      node-lost is handled here, other kinds by registered handlers
    world.kick()                          run the controllers now (after a change they do not see in the store)

Lifecycle
    task = world.start()    on a running asyncio loop (or: await world.run())
    await world.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from fleet.vocabulary import MODEL_LABEL, REVISION_LABEL, SERVING_READY_CONDITION, FaultKind
from sim.actionlog import ActionLog
from sim.clock import SimClock, set_from_any_thread
from sim.control import FaultRequest
from sim.k8s.controlplane import ControlPlane, StartupProfile
from sim.k8s.faults import ApiFaults
from sim.k8s.manifests import build_objects, rollout_patch
from sim.k8s.podips import DEFAULT_ENGINE_PORT
from sim.k8s.store import ObjectStore, WatchEvent
from sim.scenario import ModelRevision, ModelSpec, Scenario

log = logging.getLogger(__name__)

FaultHandler = Callable[[FaultRequest], None]
# Longest a running world goes without a whole reconcile pass (wall seconds): a backstop only, every
# timer a controller needs is set with ``ControlPlane.wake_at``.
FULL_PASS_EVERY_S = 30.0
# Writes no controller reacts to: they do not wake the controllers (lease heartbeats, events, config).
QUIET_RESOURCES = frozenset({"leases", "events", "configmaps"})


def engine_port_of(scenario: Scenario) -> int:
    """The port every engine listens on at its pod IP (the scenario's ``load.engine_port``, default 8000)."""
    value = (scenario.load or {}).get("engine_port", DEFAULT_ENGINE_PORT)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ValueError(f"load.engine_port must be a TCP port number 1-65535 (got {value!r})")
    return value


class SimWorld:
    """The simulated cluster built from a scenario, running at ``speed`` x real time."""

    def __init__(
        self,
        scenario: Scenario,
        *,
        speed: float = 1.0,
        token: str | None = None,
        watch_history: int | None = None,
    ) -> None:
        self.scenario = scenario
        self.clock = SimClock(speed)
        self.started_at = self.clock.now()
        self.store = (
            ObjectStore(self.clock)
            if watch_history is None
            else ObjectStore(self.clock, watch_history=watch_history)
        )
        self.actions = ActionLog()
        self.api_faults = ApiFaults(seed=scenario.seed)
        self.token = token or secrets.token_urlsafe(24)
        self.control = ControlPlane(
            self.store,
            self.clock,
            scenario.timings,
            self._startup_profile,
            seed=scenario.seed,
            engine_port=engine_port_of(scenario),
            scoring=scenario.scheduler.scoring,
        )
        self.control.gates_set_on_first_ready.add(SERVING_READY_CONDITION)
        self._fault_handlers: dict[FaultKind, FaultHandler] = {}
        self._pending_faults = sorted(scenario.faults, key=lambda f: f.at_s)
        self._pending_rollouts = sorted(
            ((w.rollout.at_s, w) for w in scenario.workloads if w.rollout is not None),
            key=lambda item: item[0],
        )
        self.serving: Any = None  # the ServingLayer, once sim.serving.attach() ran
        # Called (on the caller's thread) as a node is lost: the serving layer ends its engines at once.
        self.node_loss_listeners: list[Callable[[str], None]] = []
        self.audit: Any = None  # the API server's sim.k8s.audit.AuditLog, once it serves
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._changed = True  # a whole reconcile is due (a change, or the start)
        self.passes = 0  # whole reconcile passes run (for benches and tests of idleness)
        for plural, obj in build_objects(scenario):
            self.store.create(plural, obj)
        # The scenario starts in steady state: pods already pulled, loaded and Ready.
        self.control.instant_start = True
        self.control.settle()
        self.control.instant_start = False
        self.store.watch(self._on_change)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> asyncio.Task[None]:
        """Run the controllers as a task on the running loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-world")
        return self._task

    async def run(self) -> None:
        """Reconcile after every change, and run each controller's timers when they come due, until
        ``stop``. An idle world (no writes, no timer due) runs nothing."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = False
        self._changed = True
        last_full = time.monotonic()
        while not self._stopping:
            self._wake.clear()
            try:
                self._apply_due_scenario_events()
                if self._changed or time.monotonic() - last_full >= FULL_PASS_EVERY_S:
                    self._changed = False
                    last_full = time.monotonic()
                    self.passes += 1
                    self.control.reconcile()
                else:
                    self.control.reconcile_due()
            except Exception:  # a controller bug must not freeze the whole world
                log.exception("sim controllers failed; retrying shortly")
                self._changed = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._idle_seconds())
            # let a burst of API writes land before reconciling
            await asyncio.sleep(0.002)

    def _idle_seconds(self) -> float:
        """Wall seconds until the next timer (a controller's, a scheduled fault or rollout), at least
        ``tick_real_seconds`` after a failed pass, at most ``FULL_PASS_EVERY_S``."""
        if self._changed:
            return self.tick_real_seconds()
        due = self.control.next_due()
        if self._pending_faults:
            due = min(due, self.started_at + self._pending_faults[0].at_s)
        if self._pending_rollouts:
            due = min(due, self.started_at + self._pending_rollouts[0][0])
        # Look again at least every sim second (cheap: only due timers run), so a timer set meanwhile
        # by a path that does not kick (e.g. from another thread) is never late by more than that.
        longest = max(self.tick_real_seconds(), min(FULL_PASS_EVERY_S, self.clock.real_seconds(1.0)))
        if math.isinf(due):
            return longest
        return min(longest, max(0.001, self.clock.real_seconds(due - self.clock.now())))

    async def stop(self) -> None:
        self._stopping = True
        self.kick()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout=5)
            self._task = None

    def tick_real_seconds(self) -> float:
        """Wall seconds before a pass that failed is retried: half a sim second, clamped to [20 ms, 100 ms]."""
        return min(0.1, max(0.02, self.clock.real_seconds(0.5)))

    def kick(self) -> None:
        """Run every controller now (safe from any thread)."""
        self._changed = True
        set_from_any_thread(self._loop, self._wake)

    def _on_change(self, event: WatchEvent) -> None:
        if event.resource not in QUIET_RESOURCES:
            self.kick()

    # ------------------------------------------------------------- reading
    def pods(self, namespace: str | None = None, label_selector: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("pods", namespace, label_selector)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.store.find("pods", namespace, name)

    def nodes(self) -> list[dict[str, Any]]:
        return self.store.list("nodes")

    def services(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("services", namespace)

    def endpointslices(
        self, namespace: str | None = None, service: str | None = None
    ) -> list[dict[str, Any]]:
        selector = f"kubernetes.io/service-name={service}" if service else None
        return self.store.list("endpointslices", namespace, selector)

    def model_for_pod(self, pod: dict[str, Any]) -> ModelSpec | None:
        name = (pod.get("metadata", {}).get("labels") or {}).get(MODEL_LABEL)
        if name is None:
            return None
        try:
            return self.scenario.model(name)
        except KeyError:
            return None

    def revision_for_pod(self, pod: dict[str, Any]) -> ModelRevision | None:
        model = self.model_for_pod(pod)
        revision = (pod.get("metadata", {}).get("labels") or {}).get(REVISION_LABEL)
        if model is None or revision is None:
            return None
        try:
            return model.revision(revision)
        except KeyError:
            return None

    def is_node_lost(self, name: str) -> bool:
        """The machine is down: its engines stop answering (a partitioned node's keep serving)."""
        return self.control.is_machine_down(name)

    # -------------------------------------------------------------- acting
    def lose_node(self, name: str, *, partition: bool = False) -> None:
        """The node's kubelet stops reporting (power loss, kernel panic). ``partition``: only the API
        server loses it (a top-of-rack switch partition): the kubelet is silent, the engines still serve
        through the gateway."""
        self.control.lose_node(name, partition=partition)
        self.kick()
        if not partition:
            for listener in list(self.node_loss_listeners):
                listener(name)

    def restore_node(self, name: str) -> None:
        self.control.restore_node(name)
        self.kick()

    def set_container_state(
        self, namespace: str, pod: str, state: Literal["crashed", "oomkilled"], message: str = ""
    ) -> None:
        self.control.kill_container(namespace, pod, oom=state == "oomkilled", message=message)
        self.kick()

    def set_container_ready(self, namespace: str, pod: str, ready: bool | None) -> None:
        self.control.set_container_ready(namespace, pod, ready)
        self.kick()

    def set_pod_condition(
        self, namespace: str, pod: str, condition_type: str, status: str, reason: str = "", message: str = ""
    ) -> None:
        self.control.set_pod_condition(namespace, pod, condition_type, status, reason, message)
        self.kick()

    def finish_termination(self, namespace: str, pod: str) -> None:
        self.control.finish_termination(namespace, pod)
        self.kick()

    def register_fault_handler(self, kind: FaultKind, handler: FaultHandler) -> None:
        self._fault_handlers[kind] = handler

    def inject_fault(self, fault: FaultRequest) -> None:
        """Apply a fault now. ``node-lost`` is built in; other kinds need a registered handler."""
        if fault.kind == FaultKind.NODE_LOST:
            if self.store.find("nodes", "", fault.target) is None:
                raise KeyError(f"no node named {fault.target!r}")
            self.lose_node(fault.target)
            return
        handler = self._fault_handlers.get(fault.kind)
        if handler is None:
            raise LookupError(f"no handler registered for fault kind {fault.kind.value!r}")
        handler(fault)
        self.kick()

    def _startup_profile(self, pod: dict[str, Any]) -> StartupProfile | None:
        model = self.model_for_pod(pod)
        if model is None:
            return None
        revision = self.revision_for_pod(pod)
        multi = model.pods_per_replica > 1
        return StartupProfile(
            image_pull_s=model.image_pull_s,
            weight_load_s=model.weight_load_s,
            distributed_init_s=model.distributed_init_s if multi else 0.0,
            defect=revision.defect if revision is not None else "none",
        )

    def _apply_due_scenario_events(self) -> None:
        elapsed = self.clock.now() - self.started_at
        while self._pending_faults and self._pending_faults[0].at_s <= elapsed:
            scheduled = self._pending_faults.pop(0)
            try:
                self.inject_fault(
                    FaultRequest(kind=scheduled.kind, target=scheduled.target, params=scheduled.params)
                )
            except (KeyError, LookupError):
                log.exception(
                    "scheduled fault %s on %s could not be applied", scheduled.kind, scheduled.target
                )
        while self._pending_rollouts and self._pending_rollouts[0][0] <= elapsed:
            _, workload = self._pending_rollouts.pop(0)
            plural, namespace, name, change = rollout_patch(self.scenario, workload)
            self.store.mutate(plural, namespace, name, change)
