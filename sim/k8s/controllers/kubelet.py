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

A container that runs a *program* (``cp.program_for``, e.g. a DCGM diagnostic) runs it for its
duration after the image pull, then terminates with its exit code (``Completed``/0 or
``Error``); its output is what ``pods/log`` serves. With ``restartPolicy: Never`` the pod ends
``Succeeded`` or ``Failed``; with ``OnFailure`` a failed run restarts after the back-off.

Device health (KEP-4680, ``ResourceHealthStatus``): each container holding GPUs reports them in
``containerStatuses[].allocatedResourcesStatus``: ``{name: "claim:<pod claim>/<request>", resources:
[{resourceID: "<driver>/<pool>/<device>", health}]}`` for DRA claims, ``{name: "nvidia.com/gpu",
resources: [{resourceID: <GPU UUID>, health}]}`` for device-plugin GPUs; ``Healthy`` or ``Unhealthy``
as the GPU's broken state (``cp.devices``) says, re-synced whenever a GPU's health changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane, PodRuntime, Program, StartupProfile

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
            if deadline is not None:
                cp.wake_at(deadline)
        elif runtime.extra.get("settled") == _settled_key(runtime, pod, cp.devices.health_epoch):
            continue  # up and ready: nothing to sync until something acts on it or on its pod
        profile = cp.profile_for(pod) or DEFAULT_PROFILE
        node = nodes[node_name]
        if "program" not in runtime.extra:
            runtime.extra["program"] = cp.program_for(pod)
        program: Program | None = runtime.extra["program"]
        if program is not None:
            _run_program(cp, pod, runtime, profile, program, now)
        else:
            _advance(cp, runtime, profile, now)

        def write(obj: Obj, runtime: PodRuntime = runtime, node: Obj = node) -> None:
            _write_status(cp, obj, runtime, node, now)

        stored = cp.store.mutate("pods", o.namespace_of(pod), o.name_of(pod), write)
        if (
            stored is not None
            and program is None
            and not o.is_terminating(stored)
            and _container_ready(runtime, now)
        ):
            runtime.extra["settled"] = _settled_key(runtime, stored, cp.devices.health_epoch)
    for uid in list(cp.runtimes):
        if uid not in live_uids:
            del cp.runtimes[uid]


def _settled_key(runtime: PodRuntime, pod: Obj, health_epoch: int) -> tuple[Any, ...]:
    """What a settled pod's status was written from. Once a long-running container is up and ready
    nothing time-driven changes its status, so the kubelet stops re-syncing it (at fleet size there
    are thousands): any change (a crash, a readiness override, an exit, any write to the pod, such as
    a readiness gate's condition) differs from the key recorded and brings the pod back into the sync."""
    return (
        runtime.started_at,
        runtime.crashed_at,
        runtime.ready_override,
        runtime.restart_count,
        runtime.exited,
        pod["metadata"].get("resourceVersion"),
        health_epoch,
    )


def _run_program(
    cp: ControlPlane, pod: Obj, runtime: PodRuntime, profile: StartupProfile, program: Program, now: float
) -> None:
    """Pull, run ``program.duration_s``, then record its exit (once per incarnation)."""
    if "exit" in runtime.extra:
        exit_code, _ = runtime.extra["exit"]
        restart = pod.get("spec", {}).get("restartPolicy", "Always")
        if exit_code == 0 or restart == "Never" or runtime.crashed_at is None:
            return
        if now < runtime.crashed_at + cp.timings.crash_loop_backoff_s:
            cp.wake_at(runtime.crashed_at + cp.timings.crash_loop_backoff_s)
            return
        runtime.extra.pop("exit")
        runtime.restart_count += 1
        runtime.started_at = runtime.crashed_at + cp.timings.crash_loop_backoff_s
        runtime.crashed_at = None
    if runtime.started_at is None:
        started = runtime.bound_at + profile.image_pull_s
        if now < started:
            cp.wake_at(started)
            return
        runtime.started_at = started
        cp.logs[o.uid_of(pod)] = program.started_output
    ends = runtime.started_at + program.duration_s
    if now < ends:
        cp.wake_at(ends)
        return
    exit_code, output = program.finish()
    uid = o.uid_of(pod)
    cp.logs[uid] = cp.logs.get(uid, "") + output
    runtime.extra["exit"] = (exit_code, ends)
    runtime.last_terminated = {
        "terminated": {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": cp.clock.timestamp(runtime.started_at),
            "finishedAt": cp.clock.timestamp(ends),
        }
    }
    if exit_code != 0:
        runtime.crashed_at = ends


def _new_runtime(cp: ControlPlane, bound_at: float) -> PodRuntime:
    from sim.k8s.controlplane import PodRuntime

    return PodRuntime(bound_at=bound_at, ip=cp.allocate_ip())


def _advance(cp: ControlPlane, runtime: PodRuntime, profile: StartupProfile, now: float) -> None:
    """Move the container through pull → running → (ready | crash) → backoff → running."""
    if runtime.crashed_at is not None:
        restart_at = runtime.crashed_at + cp.timings.crash_loop_backoff_s
        if now < restart_at:
            cp.wake_at(restart_at)
            return
        runtime.crashed_at = None
        runtime.started_at = restart_at
    if runtime.started_at is None:
        started = runtime.bound_at + profile.image_pull_s
        if now < started:
            cp.wake_at(started)
            return
        runtime.started_at = started
    loaded_at = runtime.started_at + profile.ready_after_start_s
    if now < loaded_at:
        cp.wake_at(loaded_at)
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


def _write_finished(cp: ControlPlane, pod: Obj, runtime: PodRuntime) -> bool:
    """A program that exited under ``restartPolicy: Never`` (or succeeded): the pod's final status."""
    if "exit" not in runtime.extra:
        return False
    exit_code, _ = runtime.extra["exit"]
    if exit_code != 0 and pod.get("spec", {}).get("restartPolicy", "Always") != "Never":
        return False
    status = pod.setdefault("status", {})
    terminated = dict((runtime.last_terminated or {}).get("terminated") or {})
    terminated["containerID"] = f"containerd://{o.stable_hash([runtime.ip, runtime.restart_count], 32)}"
    statuses = []
    for container in pod["spec"].get("containers") or []:
        statuses.append(
            {
                "name": container["name"],
                "image": container.get("image", ""),
                "imageID": f"{container.get('image', '')}@sha256:{o.stable_hash(container.get('image', ''), 32)}",
                "ready": False,
                "restartCount": runtime.restart_count,
                "started": False,
                "state": {"terminated": terminated},
                "lastState": {},
                "containerID": terminated["containerID"],
            }
        )
    status["containerStatuses"] = statuses
    status["phase"] = "Succeeded" if exit_code == 0 else "Failed"
    timestamp = cp.clock.timestamp()
    o.set_condition(pod, "PodReadyToStartContainers", "False", timestamp)
    o.set_condition(pod, "ContainersReady", "False", timestamp, "PodCompleted")
    o.set_condition(pod, "Ready", "False", timestamp, "PodCompleted")
    return True


def _write_status(cp: ControlPlane, pod: Obj, runtime: PodRuntime, node: Obj, now: float) -> None:
    if _write_finished(cp, pod, runtime):
        return
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
        devices = cp.devices.resource_statuses(pod, container)
        if devices:
            entry["allocatedResourcesStatus"] = devices
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
