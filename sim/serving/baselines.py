"""The policies fleetmend is measured against, as runnable sim policies.

* **Kubernetes default path** — what a fleet gets with no recovery procedure:
  the kubelet's readiness probe (``periodSeconds`` x ``failureThreshold``, default
  10 s x 3) is the only thing that takes a dead-but-running replica out of the
  Service's EndpointSlice; a lost node needs the node-monitor grace period
  before its pods turn not-ready and the 300 s ``unreachable`` toleration before
  they are evicted and replaced; the gateway routes equal shares to every Ready
  endpoint the moment it is Ready (cold or not) and does not retry
  (``KUBERNETES_DEFAULT_POLICY``, set in the gateway in front of the engines).

``measure_deroute`` returns the figures ``bench/sim_baselines.py`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.gateway import GatewayPolicy, RetryPolicy
from sim.control import FaultRequest
from sim.serving.kubeview import routed_pods
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import LoadRun

# Equal shares to every ready endpoint, no shedding, no gateway retries (absolute values).
KUBERNETES_DEFAULT_POLICY = GatewayPolicy(retry=RetryPolicy(retry_before_first_byte=False))


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


@dataclass
class DerouteMeasurement:
    replica: str
    fault: str
    sim_seconds_to_deroute: float | None
    requests_failed_on_replica: int | None


async def measure_deroute(
    layer: ServingLayer,
    pool: str,
    pod: str,
    fault: FaultRequest,
    load: LoadRun | None = None,
    timeout_s: float = 900.0,
    poll_s: float = 0.25,
) -> DerouteMeasurement:
    """Inject ``fault`` and time (sim seconds) until ``pod`` leaves the pool's routing set (the ready,
    router-labelled endpoints a gateway routes to). With the ``load`` running meanwhile, also count
    its requests the replica failed (None without a load): all of them, as the replica was healthy
    before the fault (a request's arrival time is when it was due, not when it reached the
    replica, so a time filter would drop requests the fault failed)."""
    start = layer.clock.now()
    layer.submit_fault(fault)
    elapsed: float | None = None
    while layer.clock.now() - start < timeout_s:
        if all(routed != pod for routed, _ in routed_pods(layer.kube, pool)):
            elapsed = layer.clock.now() - start
            break
        await layer.clock.sleep(poll_s)
    failed = None
    if load is not None:
        failed = sum(1 for r in load.results if r.replica == pod and r.outcome not in ("goodput", "late"))
    return DerouteMeasurement(pod, fault.kind.value, elapsed, failed)
