"""The simulated control plane: runs every controller over the store when something changed.

Controllers are level-triggered: each pass compares the desired state with the
stored objects and writes only differences (no-op writes are dropped by the
store), so running them again converges. They run when the cluster changed (a
write) and when a timer a controller set comes due (``wake_at``: a container's
image pull ends, a toleration expires, a lease needs renewing); a timer runs only
the controller that set it (``reconcile_due``). An idle cluster runs nothing.

Pass order (one reconcile): node lifecycle → node lease heartbeats → taint eviction → garbage collection
→ Deployments → ReplicaSets → LeaderWorkerSets → Jobs → DaemonSets → DRA driver slices → ResourceClaims (DRA) → device
taint eviction (DRA) → scheduler → kubelets → EndpointSlices → PodDisruptionBudgets.

Which GPU each pod holds (device plugin indices, or DRA claims) is ``devices`` (``sim.k8s.devices.GpuLedger``).

Containers are long-running servers (engines) unless a *program* claims the pod
(``program_for``: the world's hook, e.g. the serving layer's DCGM diagnostic): a
program runs for its duration, then ends with an exit code and the output the
``pods/log`` subresource serves; a pod with ``restartPolicy: Never`` then ends
``Succeeded`` or ``Failed``.

Object deletion (``delete``) is shared by the API server and the controllers:
a pod bound to a node gets a ``deletionTimestamp`` and lives on until its
kubelet confirms (grace period, or the engine exited); everything else goes at
once and its dependents are garbage-collected.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim.clock import SimClock, parse_timestamp
from sim.k8s import objects as o
from sim.k8s.devices import GpuLedger
from sim.k8s.errors import ApiError, not_found
from sim.k8s.events import EventRecorder
from sim.k8s.podips import PodIpAllocator
from sim.k8s.resources import RESOURCES
from sim.k8s.store import ObjectStore
from sim.scenario import Timings

Obj = dict[str, Any]

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


@dataclass(frozen=True)
class StartupProfile:
    """How long a pod's engine takes to come up (sim seconds) and whether it dies on start."""

    image_pull_s: float = 2.0
    weight_load_s: float = 0.0
    distributed_init_s: float = 0.0
    defect: str = "none"

    @property
    def ready_after_start_s(self) -> float:
        return self.weight_load_s + self.distributed_init_s


DEFAULT_PROFILE = StartupProfile()


@dataclass(frozen=True)
class Program:
    """What a run-to-completion container does: runs ``duration_s``, then ``finish()`` -> (exit code, output)."""

    duration_s: float
    finish: Callable[[], tuple[int, str]]
    started_output: str = ""


@dataclass
class PodRuntime:
    """What the kubelet knows about one pod incarnation (keyed by pod uid)."""

    bound_at: float
    ip: str
    started_at: float | None = None  # current container incarnation start
    restart_count: int = 0
    crashed_at: float | None = None  # in CrashLoopBackOff until crashed_at + backoff
    last_terminated: Obj | None = None
    ready_override: bool | None = None
    exited: bool = False
    gate_initialised: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class ControlPlane:
    """Controllers, scheduler, node lifecycle and kubelets of the simulated cluster."""

    def __init__(
        self,
        store: ObjectStore,
        clock: SimClock,
        timings: Timings,
        profile_for: Callable[[Obj], StartupProfile | None],
        *,
        seed: int = 0,
        engine_port: int = 8000,
        scoring: str = "LeastAllocated",
    ) -> None:
        self.store = store
        self.scoring = scoring  # the scheduler's NodeResourcesFit strategy (sim.scenario.SchedulerSpec)
        self.clock = clock
        self.timings = timings
        self.profile_for = profile_for
        self.events = EventRecorder(store, clock)
        self.rng = random.Random(seed)
        self.lock = threading.RLock()
        self.lost_nodes: dict[str, float] = {}
        # Lost to the API server only (a top-of-rack partition): the kubelet is silent, the machine runs.
        self.partitioned_nodes: set[str] = set()
        # Node lifecycle: (resourceVersion, lost at, unreachable) each node was last written from.
        self.node_sync: dict[str, tuple[Any, ...]] = {}
        self.gc_inputs: tuple[int, ...] | None = None  # what garbage collection last ran on
        self.runtimes: dict[str, PodRuntime] = {}
        self.gates_set_on_first_ready: set[str] = set()  # readiness-gate condition types the sim admits
        self.pod_ips = PodIpAllocator(engine_port)
        self.scheduler_memory: dict[str, tuple[str, float]] = {}  # pod uid -> (last message, last event time)
        self.instant_start: bool = False
        # The world's hook naming the program a pod's container runs (None: a long-running server).
        self.program_for: Callable[[Obj], Program | None] = lambda pod: None
        self.logs: dict[str, str] = {}  # pod uid -> its container's output (pods/log)
        self.devices = GpuLedger(store)  # which GPU indices each pod holds (sim.k8s.devices)
        self.dra_evicted: dict[str, int] = {}  # DeviceTaintRule uid -> pods it evicted
        self.dra_slice_inputs: tuple[int, ...] | None = None  # what the DRA driver last published from
        # imported here to keep each controller in its own module without import cycles
        from sim.k8s.controllers import (
            disruption,
            dra,
            endpoints,
            jobs,
            kubelet,
            lws,
            nodes,
            scheduler,
            workloads,
        )
        from sim.k8s.controllers.daemonsets import DaemonSetController

        self.daemonsets = DaemonSetController(self)  # event-driven: idle while nothing it reads changes
        # Timers: the sim time each pass asked to run again at (``wake_at``); None = a whole reconcile.
        self._timers: dict[Callable[[ControlPlane], None] | None, float] = {}
        self._running: Callable[[ControlPlane], None] | None = None
        self._passes: list[Callable[[ControlPlane], None]] = [
            nodes.reconcile_nodes,
            nodes.renew_node_leases,
            nodes.evict_tainted_pods,
            nodes.collect_garbage,
            workloads.reconcile_deployments,
            workloads.reconcile_replicasets,
            lws.reconcile_leaderworkersets,
            jobs.reconcile_jobs,
            self.daemonsets.reconcile,
            dra.publish_driver_slices,
            dra.reconcile_resource_claims,
            dra.reconcile_device_taint_rules,
            scheduler.schedule_pending_pods,
            kubelet.run_kubelets,
            endpoints.reconcile_endpointslices,
            disruption.reconcile_pdbs,
        ]

    # ------------------------------------------------------------- running
    def reconcile(self) -> None:
        """Run every controller once."""
        with self.lock:
            self._timers.pop(None, None)
            for step in self._passes:
                self._run(step)

    def reconcile_due(self) -> bool:
        """Run the controllers whose timer came due (``wake_at``); False when none did."""
        now = self.now()
        with self.lock:
            if self._timers.get(None, math.inf) <= now:
                self.reconcile()
                return True
            due = [step for step in self._passes if self._timers.get(step, math.inf) <= now]
            for step in due:
                self._run(step)
            return bool(due)

    def _run(self, step: Callable[[ControlPlane], None]) -> None:
        self._timers.pop(step, None)
        self._running = step
        try:
            step(self)
        finally:
            self._running = None

    def wake_at(self, at: float) -> None:
        """Run the calling controller again at sim time ``at`` (outside a pass: every controller)."""
        with self.lock:
            key = self._running
            if at < self._timers.get(key, math.inf):
                self._timers[key] = at

    def next_due(self) -> float:
        """The earliest sim time a controller asked to run again (``inf``: none)."""
        with self.lock:
            return min(self._timers.values(), default=math.inf)

    def settle(self, max_passes: int = 20) -> None:
        """Reconcile until nothing changes (used to build the initial steady state)."""
        for _ in range(max_passes):
            before = self.store.resource_version
            self.reconcile()
            if self.store.resource_version == before:
                return

    def now(self) -> float:
        return self.clock.now()

    def allocate_ip(self) -> str:
        """A pod IP: a bindable loopback address from this world's own random block (``sim.k8s.podips``)."""
        return self.pod_ips.allocate()

    # -------------------------------------------------------------- nodes
    def is_node_lost(self, name: str) -> bool:
        """The kubelet no longer reports (the machine is down, or cut off from the API server)."""
        return name in self.lost_nodes

    def is_machine_down(self, name: str) -> bool:
        """The machine itself is gone (its engines with it), not merely cut off from the API server."""
        return name in self.lost_nodes and name not in self.partitioned_nodes

    def lose_node(self, name: str, *, partition: bool = False) -> None:
        if self.store.find("nodes", "", name) is None:
            raise KeyError(f"no node named {name!r}")
        with self.lock:
            self.lost_nodes.setdefault(name, self.now())
            if partition:
                self.partitioned_nodes.add(name)

    def restore_node(self, name: str) -> None:
        with self.lock:
            self.lost_nodes.pop(name, None)
            self.partitioned_nodes.discard(name)

    # -------------------------------------------------------------- pods
    def admit_pod(self, pod: Obj) -> Obj:
        """What admission plugins add to a new pod (defaults and DefaultTolerationSeconds)."""
        spec = pod.setdefault("spec", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", self.timings.default_termination_grace_s)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", "default")
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
        tolerations: list[Obj] = spec.setdefault("tolerations", [])
        for key, seconds in (
            (NOT_READY_TAINT, self.timings.not_ready_toleration_s),
            (UNREACHABLE_TAINT, self.timings.unreachable_toleration_s),
        ):
            if not any(t.get("key") == key and t.get("effect") in (None, "NoExecute") for t in tolerations):
                tolerations.append(
                    {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": seconds}
                )
        for container in spec.get("containers") or []:
            container.setdefault("imagePullPolicy", "IfNotPresent")
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            container.setdefault("resources", {})
        status = pod.setdefault("status", {})
        status.setdefault("phase", "Pending")
        status.setdefault(
            "qosClass",
            "BestEffort"
            if not any(c.get("resources") for c in spec.get("containers") or [])
            else "Burstable",
        )
        return pod

    def create_pod(self, pod: Obj, *, dry_run: bool = False) -> Obj:
        return self.store.create("pods", self.admit_pod(pod), dry_run=dry_run)

    def create_job(self, job: Obj, *, dry_run: bool = False) -> Obj:
        """A batch/v1 Job with the apiserver's defaults (selector and template labels on its uid)."""
        from sim.k8s.controllers.jobs import default_job

        created = self.store.create("jobs", default_job(job, None), dry_run=dry_run)
        if dry_run:
            return created
        uid = o.uid_of(created)
        stored = self.store.mutate(
            "jobs", o.namespace_of(created), o.name_of(created), lambda obj: _ignore(default_job(obj, uid))
        )
        return stored or created

    def pod_log(self, pod: Obj, container: str | None = None) -> str:
        """``GET pods/{name}/log``: the container's output; 400 while it has not started (as the kubelet says)."""
        names = [c["name"] for c in pod.get("spec", {}).get("containers") or []]
        if container is not None and container not in names:
            raise ApiError(400, "BadRequest", f"container {container} is not valid for pod {o.name_of(pod)}")
        if container is None and len(names) > 1:
            raise ApiError(
                400,
                "BadRequest",
                f"a container name must be specified for pod {o.name_of(pod)}, choose one of: {names}",
            )
        name = container or (names[0] if names else "")
        uid = o.uid_of(pod)
        runtime = self.runtimes.get(uid)
        if runtime is None or (runtime.started_at is None and "exit" not in runtime.extra):
            raise ApiError(
                400,
                "BadRequest",
                f'container "{name}" in pod "{o.name_of(pod)}" is waiting to start: ContainerCreating',
            )
        return self.logs.get(uid, "")

    def runtime(self, namespace: str, name: str) -> PodRuntime | None:
        pod = self.store.find("pods", namespace, name)
        if pod is None:
            return None
        return self.runtimes.get(o.uid_of(pod))

    def _require_runtime(self, namespace: str, name: str) -> PodRuntime:
        runtime = self.runtime(namespace, name)
        if runtime is None:
            raise KeyError(f"pod {namespace}/{name} is not running on a node")
        return runtime

    def kill_container(self, namespace: str, name: str, *, oom: bool, message: str = "") -> None:
        with self.lock:
            runtime = self._require_runtime(namespace, name)
            self._crash(runtime, self.now(), oom=oom, message=message)

    def _crash(self, runtime: PodRuntime, at: float, *, oom: bool, message: str = "") -> None:
        started = runtime.started_at if runtime.started_at is not None else at
        runtime.last_terminated = {
            "terminated": {
                "exitCode": 137 if oom else 1,
                "reason": "OOMKilled" if oom else "Error",
                "message": message
                or ("container exceeded its memory limit" if oom else "engine process exited"),
                "startedAt": self.clock.timestamp(started),
                "finishedAt": self.clock.timestamp(at),
                "containerID": f"containerd://{o.stable_hash([runtime.ip, runtime.restart_count], 32)}",
            }
        }
        runtime.restart_count += 1
        runtime.crashed_at = at
        runtime.started_at = None
        runtime.extra.pop("ready_at", None)

    def set_container_ready(self, namespace: str, name: str, ready: bool | None) -> None:
        with self.lock:
            self._require_runtime(namespace, name).ready_override = ready

    def finish_termination(self, namespace: str, name: str) -> None:
        with self.lock:
            self._require_runtime(namespace, name).exited = True

    def set_pod_condition(
        self, namespace: str, name: str, condition_type: str, status: str, reason: str = "", message: str = ""
    ) -> None:
        def change(pod: Obj) -> None:
            o.set_condition(
                pod, condition_type, status, self.clock.timestamp(), reason or None, message or None
            )

        if self.store.mutate("pods", namespace, name, change) is None:
            raise KeyError(f"no pod {namespace}/{name}")

    # ----------------------------------------------------------- deletion
    def delete(
        self,
        plural: str,
        namespace: str,
        name: str,
        *,
        grace_seconds: int | None = None,
        propagation: str | None = None,
    ) -> Obj:
        """Delete as the apiserver does; returns the object as it stands afterwards."""
        resource = RESOURCES[plural]
        obj = self.store.find(plural, namespace, name)
        if obj is None:
            raise not_found(plural, name, resource.group)
        if plural == "pods":
            return self._delete_pod(obj, grace_seconds)
        if propagation == "Orphan":
            self._orphan_dependents(obj)
        if obj["metadata"].get("finalizers"):
            marked = self.store.set_deletion(plural, namespace, name, self.clock.timestamp(), 0)
            return marked or obj
        removed = self.store.remove(plural, namespace, name)
        return removed or obj

    def _delete_pod(self, pod: Obj, grace_seconds: int | None) -> Obj:
        namespace, name = o.namespace_of(pod), o.name_of(pod)
        grace = grace_seconds
        if grace is None:
            grace = int(
                pod.get("spec", {}).get(
                    "terminationGracePeriodSeconds", self.timings.default_termination_grace_s
                )
            )
        node = pod.get("spec", {}).get("nodeName")
        # Unscheduled pods, finished pods and grace 0 (force) leave storage at once.
        if grace <= 0 or not node or o.is_pod_terminal(pod):
            removed = self.store.remove("pods", namespace, name)
            self.runtimes.pop(o.uid_of(pod), None)
            return removed or pod
        deadline = self.now() + grace
        marked = self.store.set_deletion("pods", namespace, name, self.clock.timestamp(deadline), grace)
        return marked or pod

    def _orphan_dependents(self, owner: Obj) -> None:
        uid = o.uid_of(owner)
        for plural in ("replicasets", "pods", "endpointslices"):
            for dependent in self.store.list(plural, o.namespace_of(owner) or None):
                refs = dependent["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):

                    def drop(obj: Obj, uid: str = uid) -> None:
                        obj["metadata"]["ownerReferences"] = [
                            r for r in obj["metadata"].get("ownerReferences") or [] if r.get("uid") != uid
                        ]

                    self.store.mutate(plural, o.namespace_of(dependent), o.name_of(dependent), drop)

    def deletion_deadline(self, obj: Obj) -> float | None:
        stamp = obj["metadata"].get("deletionTimestamp")
        return None if stamp is None else parse_timestamp(stamp)

    def ensure_exists(self, plural: str, obj: Obj) -> Obj:
        """Create ``obj`` unless an object of that name exists (then return the stored one)."""
        existing = self.store.find(plural, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
        if existing is not None:
            return existing
        try:
            return self.store.create(plural, obj)
        except ApiError:
            return self.store.get(plural, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def _ignore(_: object) -> None:
    """Store mutators return nothing."""
