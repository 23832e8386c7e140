"""Kubelet-ish pod start-up, readiness and termination on every live node.

A bound pod gets an IP at once (a loopback address of the world's own block, ``sim.k8s.podips``) (sandbox ready), its
container starts after the image pull (phase ``Running``), and the container
turns ready after the model's weight load plus distributed init (the readiness
probe answers once the engine has loaded). ``Ready`` = all containers ready AND
every readiness gate condition is ``"True"`` (a missing gate condition counts as
False, reason ``ReadinessGatesNotReady``), exactly as the kubelet computes it.

A killed container restarts after a CrashLoopBackOff delay with
``restartCount`` + 1 and ``lastState.terminated`` (``OOMKilled``/137 or ``Error``/1).
A revision with a start-up defect dies each time it finishes loading.

A terminating pod keeps running (and Ready) until its grace period ends or the
engine exits, then the kubelet confirms and the object disappears.
Pods on a lost node are left exactly as they were: nobody is reporting for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane, PodRuntime, StartupProfile

Obj = dict[str, Any]


def run_kubelets(cp: ControlPlane) -> None:
    from sim.k8s.controlplane import DEFAULT_PROFILE

    now = cp.now()
    nodes = {o.name_of(n): n for n in cp.store.list_view("nodes")}
    live_uids: set[str] = set()
    for pod in cp.store.list_view("pods"):
        uid = o.uid_of(pod)
        live_uids.add(uid)
        node_name = pod.get("spec", {}).get("nodeName")
        if not node_name or node_name not in nodes or cp.is_node_lost(node_name):
            continue
        runtime = cp.runtimes.get(uid)
        if runtime is None:
            profile = cp.profile_for(pod) or DEFAULT_PROFILE
            bound_at = (
                now - (profile.image_pull_s + profile.ready_after_start_s + 1.0) if cp.instant_start else now
            )
            runtime = cp.runtimes[uid] = _new_runtime(cp, bound_at)
        if o.is_terminating(pod):
            deadline = cp.deletion_deadline(pod)
            if runtime.exited or (deadline is not None and now >= deadline):
                cp.store.remove("pods", o.namespace_of(pod), o.name_of(pod))
                cp.runtimes.pop(uid, None)
                continue
        profile = cp.profile_for(pod) or DEFAULT_PROFILE
        _advance(cp, runtime, profile, now)
        node = nodes[node_name]

        def write(obj: Obj, runtime: PodRuntime = runtime, node: Obj = node) -> None:
            _write_status(cp, obj, runtime, node, now)

        cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), write)
    for uid in list(cp.runtimes):
        if uid not in live_uids:
            del cp.runtimes[uid]


def _new_runtime(cp: ControlPlane, bound_at: float) -> PodRuntime:
    from sim.k8s.controlplane import PodRuntime

    return PodRuntime(bound_at=bound_at, ip=cp.allocate_ip())


def _advance(cp: ControlPlane, runtime: PodRuntime, profile: StartupProfile, now: float) -> None:
    """Move the container through pull → running → (ready | crash) → backoff → running."""
    if runtime.crashed_at is not None:
        restart_at = runtime.crashed_at + cp.timings.crash_loop_backoff_s
        if now < restart_at:
            return
        runtime.crashed_at = None
        runtime.started_at = restart_at
    if runtime.started_at is None:
        started = runtime.bound_at + profile.image_pull_s
        if now < started:
            return
        runtime.started_at = started
    loaded_at = runtime.started_at + profile.ready_after_start_s
    if profile.defect in ("crash-on-start", "oom-on-start") and now >= loaded_at:
        cp._crash(runtime, loaded_at, oom=profile.defect == "oom-on-start")
        _advance(cp, runtime, profile, now)
        return
    runtime.extra["ready_at"] = loaded_at


def _container_ready(runtime: PodRuntime, now: float) -> bool:
    if runtime.started_at is None or runtime.crashed_at is not None:
        return False
    if runtime.ready_override is not None:
        return runtime.ready_override
    ready_at = runtime.extra.get("ready_at")
    return ready_at is not None and now >= ready_at


def _write_status(cp: ControlPlane, pod: Obj, runtime: PodRuntime, node: Obj, now: float) -> None:
    stamp = cp.clock.timestamp
    status = pod.setdefault("status", {})
    spec = pod["spec"]
    status["hostIP"] = _node_ip(node)
    status["hostIPs"] = [{"ip": status["hostIP"]}]
    status["podIP"] = runtime.ip
    status["podIPs"] = [{"ip": runtime.ip}]
    status.setdefault("startTime", stamp(runtime.bound_at))
    ready = _container_ready(runtime, now)
    container_statuses = []
    for container in spec.get("containers") or []:
        entry: Obj = {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": f"{container.get('image', '')}@sha256:{o.stable_hash(container.get('image', ''), 32)}",
            "ready": ready,
            "restartCount": runtime.restart_count,
            "started": runtime.started_at is not None,
        }
        if runtime.crashed_at is not None:
            entry["state"] = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {int(cp.timings.crash_loop_backoff_s)}s restarting failed container={container['name']} pod={o.name_of(pod)}",
                }
            }
        elif runtime.started_at is None:
            entry["state"] = {"waiting": {"reason": "ContainerCreating"}}
        else:
            entry["state"] = {"running": {"startedAt": stamp(runtime.started_at)}}
            entry["containerID"] = f"containerd://{o.stable_hash([runtime.ip, runtime.restart_count], 32)}"
        entry["lastState"] = dict(runtime.last_terminated or {})
        container_statuses.append(entry)
    status["containerStatuses"] = container_statuses
    status["phase"] = "Running" if runtime.started_at is not None or runtime.restart_count else "Pending"
    timestamp = stamp()
    o.set_condition(pod, "PodReadyToStartContainers", "True", timestamp)
    o.set_condition(pod, "Initialized", "True", timestamp)
    o.set_condition(pod, "PodScheduled", "True", timestamp)
    not_ready = [c["name"] for c in container_statuses if not c["ready"]]
    if not_ready:
        message = f"containers with unready status: [{' '.join(not_ready)}]"
        o.set_condition(pod, "ContainersReady", "False", timestamp, "ContainersNotReady", message)
        o.set_condition(pod, "Ready", "False", timestamp, "ContainersNotReady", message)
        return
    o.set_condition(pod, "ContainersReady", "True", timestamp)
    gates = [g["conditionType"] for g in spec.get("readinessGates") or [] if g.get("conditionType")]
    _admit_gates(cp, pod, runtime, gates, timestamp)
    for gate in gates:
        value = o.condition_status(pod, gate)
        if value != "True":
            message = (
                f'corresponding condition of pod readiness gate "{gate}" does not exist.'
                if value is None
                else f'the status of pod readiness gate "{gate}" is not "True", but {value}'
            )
            o.set_condition(pod, "Ready", "False", timestamp, "ReadinessGatesNotReady", message)
            return
    o.set_condition(pod, "Ready", "True", timestamp)


def _admit_gates(cp: ControlPlane, pod: Obj, runtime: PodRuntime, gates: list[str], timestamp: str) -> None:
    """Play the gate controller once per incarnation: a freshly loaded engine is admitted (gate True).

    Afterwards the gate belongs to whoever patches ``pods/status`` (fleetmend), the sim never flips it back.
    """
    if runtime.gate_initialised:
        return
    runtime.gate_initialised = True
    for gate in gates:
        if gate in cp.gates_set_on_first_ready and o.condition(pod, gate) is None:
            o.set_condition(
                pod, gate, "True", timestamp, "EngineLoaded", "engine loaded and accepting requests"
            )


def _node_ip(node: Obj) -> str:
    for address in node.get("status", {}).get("addresses") or []:
        if address.get("type") == "InternalIP":
            return str(address["address"])
    return "127.0.0.1"
