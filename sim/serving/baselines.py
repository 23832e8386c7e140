"""The policies fleetmend is measured against, as runnable sim policies.

* **Kubernetes default path** — what a fleet gets with no recovery procedure:
  the kubelet's readiness probe (``periodSeconds`` x ``failureThreshold``, default
  10 s x 3) is the only thing that takes a dead-but-running replica out of the
  Service's EndpointSlice; a lost node needs the node-monitor grace period
  before its pods turn not-ready and the 300 s ``unreachable`` toleration before
  they are evicted and replaced; the gateway routes equal shares to every Ready
  endpoint the moment it is Ready (cold or not) and does not retry.
* **Naive scale-down** — delete the pod and let vLLM's default
  ``--shutdown-timeout=0`` abort whatever is streaming.

``measure_deroute`` and ``naive_scale_down`` return the figures ``bench/sim_baselines.py`` prints.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fleet.protocol import (
    Admission,
    AdmissionChange,
    FaultRequest,
    Outcome,
    RetryPolicy,
    RetryPolicyChange,
    WeightsChange,
)
from sim.serving.layer import ServingLayer


@dataclass(frozen=True)
class KubernetesDefaults:
    probe_period_s: float = 10.0
    probe_failure_threshold: int = 3
    node_monitor_grace_s: float = 40.0
    unreachable_toleration_s: float = 300.0

    @property
    def probe_deroute_floor_s(self) -> float:
        """The earliest a probe-driven deroute can happen after a replica stops answering."""
        return self.probe_period_s * self.probe_failure_threshold


def apply_kubernetes_default_routing(layer: ServingLayer, pool: str) -> None:
    """Equal shares to every ready endpoint, no shedding, no gateway retries (absolute values)."""
    router = layer.router
    state = router.state(pool)
    state = router.set_weights(pool, WeightsChange(replaces_version=state.version, weights={}))
    state = router.set_admission(pool, AdmissionChange(replaces_version=state.version, admission=Admission()))
    router.set_retry_policy(
        pool,
        RetryPolicyChange(replaces_version=state.version, retry=RetryPolicy(retry_before_first_byte=False)),
    )


@dataclass
class DerouteMeasurement:
    replica: str
    fault: str
    sim_seconds_to_deroute: float | None
    requests_sent_to_dead_replica: int


async def measure_deroute(
    layer: ServingLayer,
    pool: str,
    pod: str,
    fault: FaultRequest,
    timeout_s: float = 900.0,
    poll_s: float = 0.25,
) -> DerouteMeasurement:
    """Inject ``fault`` and time (sim seconds) until ``pod`` leaves the pool's routing set."""
    start = layer.clock.now()
    layer.submit_fault(fault)
    while layer.clock.now() - start < timeout_s:
        if all(ep.pod != pod for ep in layer.router.routing_set(pool).endpoints):
            break
        await layer.clock.sleep(poll_s)
    else:
        return DerouteMeasurement(pod, fault.kind.value, None, _failed_on(layer, pool, pod, start))
    elapsed = layer.clock.now() - start
    return DerouteMeasurement(pod, fault.kind.value, elapsed, _failed_on(layer, pool, pod, start))


def _failed_on(layer: ServingLayer, pool: str, pod: str, since: float) -> int:
    page = layer.journal.query(pool=pool, replica=pod, since=since, limit=1_000_000)
    return sum(1 for e in page.entries if e.outcome in (Outcome.RETRIED, Outcome.TERMINAL_ERROR))


@dataclass
class ScaleDownMeasurement:
    pod: str
    shutdown_timeout_s: float
    streams_in_flight: int
    streams_truncated: int
    streams_completed: int


async def naive_scale_down(layer: ServingLayer, pool: str, namespace: str, pod: str) -> ScaleDownMeasurement:
    """Delete ``pod`` while it streams, as a plain ``kubectl delete pod`` / scale-down would."""
    engine = layer.supervisor.get(f"{namespace}/{pod}")
    in_flight = (engine.num_running + engine.num_waiting) if engine is not None else 0
    timeout = engine.spec.shutdown_timeout_s if engine is not None else 0.0
    start = layer.clock.now()
    layer.world.control.delete("pods", namespace, pod)
    layer.kick_world()
    # Wait until the replica's streams have all ended (aborted at once with timeout 0).
    for _ in range(2000):
        await asyncio.sleep(0.01)
        engine = layer.supervisor.get(f"{namespace}/{pod}")
        if engine is None or not engine.alive:
            break
    await layer.clock.sleep(1.0)
    entries = layer.journal.query(pool=pool, replica=pod, since=start, limit=1_000_000).entries
    truncated = sum(1 for e in entries if e.outcome == Outcome.TERMINAL_ERROR and e.truncated)
    completed = sum(1 for e in entries if e.outcome in (Outcome.COMPLETED, Outcome.LATE))
    return ScaleDownMeasurement(pod, timeout, in_flight, truncated, completed)
