"""Which engine processes exist, kept in step with the pods the cluster runs.

An engine starts (cold) when a serving pod's container is running, and is
replaced by a fresh cold one when the container restarts. Pod deletion sends
SIGTERM (the engine honours its model's ``--shutdown-timeout``) and the pod
finishes terminating as soon as the engine has exited. A pod on a lost node
loses its process at once. For a multi-node group only the leader runs an
engine, and the loss of any rank kills it (a broken NCCL communicator).

An engine that dies of a fault keeps its API server up for ``watchdog_s``
(``/health`` answers 503), then the process exits and the kubelet sees the
container crash (vLLM's launcher watchdog, reference §1.4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.vocabulary import LWS_GROUP_KEY_LABEL, LWS_WORKER_INDEX_LABEL, MODEL_LABEL
from sim.clock import parse_timestamp
from sim.serving.engine import Engine, EngineSpec, EngineState
from sim.serving.kubeview import KubeView, pod_is_terminating, pod_labels

log = logging.getLogger(__name__)
Obj = dict[str, Any]


class WorldPort(Protocol):
    """The part of ``sim.world.SimWorld`` the serving layer acts through."""

    def is_node_lost(self, name: str) -> bool: ...
    def set_container_state(self, namespace: str, pod: str, state: Any, message: str = "") -> None: ...
    def set_container_ready(self, namespace: str, pod: str, ready: bool | None) -> None: ...
    def finish_termination(self, namespace: str, pod: str) -> None: ...
    def model_for_pod(self, pod: Obj) -> Any: ...
    def revision_for_pod(self, pod: Obj) -> Any: ...


def engine_spec_for(model: Any, revision: Any, overrides: dict[str, Any] | None = None) -> EngineSpec:
    """Engine parameters from a scenario model (+ revision) and the scenario's ``load.engine`` overrides."""
    values: dict[str, Any] = {
        "served_model_name": model.served_name,
        "version": revision.engine_version if revision is not None else "0.12.0",
        "warm_tokens_per_s": model.warm_rate_tokens_per_s,
        "cold_fraction": model.cold_rate_fraction,
        "warmup_s": model.warm_up_s,
        "kv_capacity_tokens": model.kv_capacity_tokens,
        "max_num_seqs": model.max_num_seqs,
        "shutdown_timeout_s": model.shutdown_timeout_s,
    }
    values.update(overrides or {})
    return EngineSpec(**values)


def container_identity(pod: Obj) -> tuple[bool, int, str]:
    """(running, restartCount, started-at) of the pod's main container."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return False, 0, ""
    st = statuses[0]
    running = st.get("state", {}).get("running")
    return running is not None, int(st.get("restartCount", 0)), (running or {}).get("startedAt", "")


def started_at(pod: Obj) -> float:
    """When the main container's current incarnation started (sim epoch seconds)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    stamp = ((statuses[0].get("state") or {}).get("running") or {}).get("startedAt") if statuses else None
    return parse_timestamp(stamp) if stamp else 0.0


def load_seconds(model: Any) -> float:
    """Weight load (+ distributed init for multi-node groups) after the container starts."""
    init = model.distributed_init_s if getattr(model, "pods_per_replica", 1) > 1 else 0.0
    return float(model.weight_load_s) + float(init)


def is_leader(pod: Obj) -> bool:
    index = pod_labels(pod).get(LWS_WORKER_INDEX_LABEL)
    return index is None or index == "0"


@dataclass
class _Tracked:
    engine: Engine
    identity: tuple[int, str]
    uid: str
    sigterm_sent: bool = False
    exit_reported: bool = False
    faults: set[str] = field(default_factory=set)


class EngineSupervisor:
    """Engines by ``namespace/pod``, reconciled from the cluster each tick."""

    def __init__(
        self, world: WorldPort, kube: KubeView, engine_overrides: dict[str, Any] | None = None
    ) -> None:
        self.world = world
        self.kube = kube
        self.engine_overrides = engine_overrides or {}
        self._tracked: dict[str, _Tracked] = {}
        # Faults that outlive a process restart: per replica (slow factor, keep-alive) and, through
        # ``start_blocker``/``node_factor``, per node (a broken GPU, thermal throttling).
        self.sticky: dict[str, dict[str, Any]] = {}
        self.start_blocker: Callable[[Obj], str | None] = lambda pod: None
        self.node_factor: Callable[[str | None], float] = lambda node: 1.0
        self._seen_generation = -1
        self._loading = False
        self.version = 0  # bumped whenever an engine process starts or is dropped

    def get(self, replica: str) -> Engine | None:
        tracked = self._tracked.get(replica)
        return tracked.engine if tracked is not None else None

    def engines(self) -> dict[str, Engine]:
        return {k: t.engine for k, t in self._tracked.items()}

    def process_up(self, replica: str) -> bool:
        """Is the replica's engine process (its API server) running? True from the end of the weight
        load until the process exits: a dead engine's server lingers for ``watchdog_s`` (or for good
        with keep-alive) answering 503; a lost node, an OOM kill, an exit after SIGTERM end it."""
        tracked = self._tracked.get(replica)
        if tracked is None:
            return False
        engine = tracked.engine
        if engine.node and self.world.is_node_lost(engine.node):
            return False
        return not (engine.state is EngineState.DEAD and tracked.exit_reported)

    def reconcile(self, now: float, force: bool = False) -> None:
        # Re-read the pods when the cluster changed, or while an engine is due to finish loading
        # (a time-based transition that writes nothing to the store).
        if not force and self.kube.generation == self._seen_generation and not self._loading:
            self._exit_dead(now)
            return
        self._seen_generation = self.kube.generation
        self._loading = False
        pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in self.kube.pods()}
        for key in list(self._tracked):
            if key not in pods:
                self._tracked.pop(key).engine.kill("pod deleted", now)
                self.version += 1
        groups_broken = self._broken_groups(pods)
        for key, pod in pods.items():
            labels = pod_labels(pod)
            if MODEL_LABEL not in labels or not is_leader(pod):
                continue
            self._reconcile_pod(key, pod, now, groups_broken)
        self._exit_dead(now)

    def _broken_groups(self, pods: dict[str, Obj]) -> set[tuple[str, str]]:
        """Groups (namespace, group-key) with a rank that is down: its leader's engine cannot run."""
        broken: set[tuple[str, str]] = set()
        for pod in pods.values():
            labels = pod_labels(pod)
            group = labels.get(LWS_GROUP_KEY_LABEL)
            if group is None or is_leader(pod):
                continue
            running, _, _ = container_identity(pod)
            node = (pod.get("spec") or {}).get("nodeName")
            if not running or pod_is_terminating(pod) or (node and self.world.is_node_lost(node)):
                broken.add((pod["metadata"]["namespace"], group))
        return broken

    def _reconcile_pod(self, key: str, pod: Obj, now: float, groups_broken: set[tuple[str, str]]) -> None:
        ns, _name = key.split("/", 1)
        running, restarts, started = container_identity(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        uid = pod["metadata"].get("uid", "")
        tracked = self._tracked.get(key)
        if tracked is not None and (
            tracked.uid != uid or (running and tracked.identity != (restarts, started))
        ):
            # A new process (container restart) or a new pod with the same name (StatefulSet/LWS).
            tracked.engine.kill("process replaced", now)
            self._tracked.pop(key)
            self.version += 1
            tracked = None
        if tracked is None:
            if not running or pod_is_terminating(pod) or (node and self.world.is_node_lost(node)):
                return
            model = self.world.model_for_pod(pod)
            if model is None:
                return
            group = pod_labels(pod).get(LWS_GROUP_KEY_LABEL)
            if now < started_at(pod) + load_seconds(model) or (
                group is not None and (ns, group) in groups_broken
            ):
                self._loading = True
                return  # the API server answers once the weights are loaded on every rank
            revision = self.world.revision_for_pod(pod)
            if getattr(revision, "defect", "none") in ("crash-on-start", "oom-on-start"):
                return  # this build dies as it finishes loading: its API server never answers
            spec = engine_spec_for(model, revision, self.engine_overrides)
            engine = Engine(replica=key, spec=spec, model_name=model.name, started_at=now, node=node)
            if revision is not None and getattr(revision, "defect", "none") == "slow":
                engine.slow_factor = 0.3
            sticky = self.sticky.get(key, {})
            engine.slow_factor = sticky.get("slow_factor", engine.slow_factor) * self.node_factor(node)
            tracked = _Tracked(engine, (restarts, started), uid)
            self._tracked[key] = tracked
            self.version += 1
            blocker = self.start_blocker(pod)
            if blocker is not None:
                engine.kill(f"CUDA error at start-up: {blocker}", now)
            log.debug("engine started for %s on %s", key, node)
            return
        engine = tracked.engine
        if not running and engine.alive:
            # The kubelet saw the container exit (a start-up defect, or killed from outside).
            engine.kill("container exited", now)
            tracked.exit_reported = True
            return
        if node and self.world.is_node_lost(node):
            engine.kill(f"node {node} lost", now)
            tracked.exit_reported = True  # nobody is left to report the exit
            return
        group = pod_labels(pod).get(LWS_GROUP_KEY_LABEL)
        if group is not None and (ns, group) in groups_broken:
            engine.kill("NCCL communicator aborted: a rank of the replica group is gone", now)
        if pod_is_terminating(pod) and not tracked.sigterm_sent:
            tracked.sigterm_sent = True
            grace = pod["metadata"].get("deletionGracePeriodSeconds")
            engine.sigterm(now, float(grace) if grace is not None else None)
            if engine.state is EngineState.DEAD:
                self._report_exit(key, tracked)

    def _exit_dead(self, now: float) -> None:
        for key, tracked in list(self._tracked.items()):
            engine = tracked.engine
            if engine.state is not EngineState.DEAD or tracked.exit_reported:
                continue
            if tracked.sigterm_sent:
                self._report_exit(key, tracked)
            elif engine.died_at is not None and now - engine.died_at >= engine.spec.watchdog_s:
                if self.sticky.get(key, {}).get("keep_alive"):
                    continue  # VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: the server stays up answering 503
                tracked.exit_reported = True
                ns, name = key.split("/", 1)
                state = "oomkilled" if "OOM" in engine.death_reason else "crashed"
                try:
                    self.world.set_container_state(ns, name, state, message=engine.death_reason)
                except Exception:  # the pod may be gone already
                    log.debug("could not report container exit of %s", key, exc_info=True)

    def _report_exit(self, key: str, tracked: _Tracked) -> None:
        tracked.exit_reported = True
        ns, name = key.split("/", 1)
        try:
            self.world.finish_termination(ns, name)
        except Exception:
            log.debug("could not finish termination of %s", key, exc_info=True)

    def mark_exit_reported(self, key: str) -> None:
        """The caller reports this process's exit to the kubelet itself (e.g. an OOM kill)."""
        tracked = self._tracked.get(key)
        if tracked is not None:
            tracked.exit_reported = True

    def busy(self) -> bool:
        """Is an engine loading, serving requests, draining, or dead with its exit not yet seen?"""
        if self._loading:
            return True
        for tracked in self._tracked.values():
            engine = tracked.engine
            if engine.running or engine.waiting or engine.state is EngineState.DRAINING:
                return True
            if engine.state is EngineState.DEAD and not tracked.exit_reported:
                return True
        return False

    def advance(self, now: float) -> None:
        for tracked in self._tracked.values():
            engine = tracked.engine
            if engine.alive and engine.node and self.world.is_node_lost(engine.node):
                engine.kill(f"node {engine.node} lost", now)
                tracked.exit_reported = True
            engine.advance(now)
