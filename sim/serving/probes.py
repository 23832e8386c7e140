"""The kubelet's readiness probe against each engine's ``/health``, as Kubernetes runs it.

Every ``periodSeconds`` the probe asks the engine's health; after
``failureThreshold`` consecutive failures the container is marked not ready (the
pod's Ready turns False, the EndpointSlice endpoint turns ``ready: false`` and a
gateway stops routing to it). One success restores readiness. A wedged engine
answers 200, so this probe never catches it — that is the point of fleetmend's
progress check. Pods on a lost node are not probed (their kubelet is gone).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fleet.vocabulary import MODEL_LABEL
from sim.serving.kubeview import KubeView, pod_is_terminating, pod_labels
from sim.serving.supervisor import EngineSupervisor, WorldPort, container_identity, is_leader

log = logging.getLogger(__name__)


@dataclass
class ProbeSettings:
    period_s: float = 10.0
    failure_threshold: int = 3


@dataclass
class _ProbeState:
    next_at: float
    failures: int = 0
    marked_unready: bool = False


class ReadinessProber:
    def __init__(
        self, world: WorldPort, kube: KubeView, supervisor: EngineSupervisor, defaults: ProbeSettings
    ) -> None:
        self.world = world
        self.kube = kube
        self.supervisor = supervisor
        self.defaults = defaults
        self._state: dict[str, _ProbeState] = {}
        # Skip a tick when neither the pods nor the engines changed and no probe is due yet.
        self._seen: tuple[int, int] | None = None
        self._next_due = 0.0

    def settings_for(self, pod: dict[str, Any]) -> ProbeSettings:
        containers = (pod.get("spec") or {}).get("containers") or [{}]
        probe = containers[0].get("readinessProbe") or {}
        return ProbeSettings(
            period_s=float(probe.get("periodSeconds", self.defaults.period_s)),
            failure_threshold=int(probe.get("failureThreshold", self.defaults.failure_threshold)),
        )

    def tick(self, now: float) -> None:
        seen = (self.kube.generation, self.supervisor.version)
        if seen == self._seen and now < self._next_due:
            return
        self._seen = seen
        self._next_due = float("inf")
        existing: set[str] = set()
        for pod in self.kube.pods():
            if MODEL_LABEL not in pod_labels(pod) or not is_leader(pod):
                continue
            key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            existing.add(key)
            running, _, _ = container_identity(pod)
            node = (pod.get("spec") or {}).get("nodeName")
            engine = self.supervisor.get(key)
            # Probes run only against a started engine process, and only while its kubelet is alive.
            if (
                engine is None
                or not running
                or pod_is_terminating(pod)
                or (node and self.world.is_node_lost(node))
            ):
                continue
            settings = self.settings_for(pod)
            state = self._state.get(key)
            if state is None:
                state = self._state[key] = _ProbeState(next_at=now + settings.period_s)
                self._next_due = min(self._next_due, state.next_at)
                continue
            if now < state.next_at:
                self._next_due = min(self._next_due, state.next_at)
                continue
            state.next_at = now + settings.period_s
            self._next_due = min(self._next_due, state.next_at)
            if engine.health_status() == 200:
                state.failures = 0
                if state.marked_unready:
                    state.marked_unready = False
                    self._set_ready(key, None)
                continue
            state.failures += 1
            if state.failures >= settings.failure_threshold and not state.marked_unready:
                state.marked_unready = True
                log.info("readiness probe failed %d times for %s: marking not ready", state.failures, key)
                self._set_ready(key, False)
        for key in list(self._state):
            if key not in existing:
                del self._state[key]

    def _set_ready(self, key: str, ready: bool | None) -> None:
        ns, name = key.split("/", 1)
        try:
            self.world.set_container_ready(ns, name, ready)
        except Exception:
            log.debug("could not set readiness of %s", key, exc_info=True)
