"""Fault injection for the serving layer: each kind leaves the signals a real one would.

| kind            | target        | what happens (Kubernetes / metrics / DCGM)                              |
|-----------------|---------------|-------------------------------------------------------------------------|
| node-lost       | node          | (world) kubelet silent -> Ready=Unknown -> taint -> eviction at +300 s; |
|                 |               | its engines die at once, its DCGM exporter stops answering              |
| gpu-xid         | node (+gpu,   | DCGM_FI_DEV_XID_ERRORS{err_code} = code (ECC counters for 48/63/64/94/95);|
|                 |  keep_alive)  | a hardware Xid lowers the node's allocatable nvidia.com/gpu (device plugin);|
|                 |  code)        | the replica holding that GPU dies (503, then container exit, restart);  |
|                 |               | a hardware Xid leaves the GPU broken: restarts crash-loop until repair  |
| pod-oomkilled   | ns/pod        | process killed: lastState.terminated.reason=OOMKilled, exit 137,       |
|                 |               | restartCount+1; the new engine is cold and its counters reset           |
| rank-lost       | ns/pod (rank) | that rank's container dies; the leader's engine aborts (NCCL); the LWS |
|                 |               | controller recreates the whole group                                    |
| slow-replica    | ns/pod        | rate x factor (default 0.3): ITL up, throughput down, still Ready       |
| wedged-engine   | ns/pod        | no progress at all; /health still 200; running/waiting stay, tokens flat |
| slow-metrics    | ns/pod        | GET /metrics answers ``delay_s`` (default 5) late: an API server so busy |
|                 |               | its scrapes time out; it still serves, /health still 200               |
| nvlink-error    | node (+gpu)   | Xid 74 + NVLink CRC/replay counters; multi-GPU replicas there die and   |
|                 |               | crash-loop until repair                                                  |
| thermal         | node          | GPU temp high, clock-event reasons = thermal slowdown; engines there   |
|                 |               | run at ``factor`` (default 0.5) until cleared                            |
| bad-rollout     | ns/workload   | the workload's template moves to a revision whose pods crash on start  |
|                 |               | (CrashLoopBackOff, restartCount climbing)                                |
| false-gpu-      | node          | a bad health check: the node problem detector sets ``condition``        |
|  condition      |  (condition)  | (default GpuXid) True while every GPU, DCGM series and engine is fine   |
|                 |               | (NVSentinel #1663: a check that flagged every node of a type)           |

``params.clear: true`` undoes slow-replica, slow-metrics, wedged-engine (by restart), thermal and
repairs a node's broken GPUs (what a GPU reset or RMA would do). A repair with
``params.under_load_defect: true`` leaves the GPU that broke idling clean but failing under
load (a reset that hid the fault): DCGM's series show nothing, ``dcgmi diag -r 1`` passes,
``-r 2`` and up fail.

With Dynamic Resource Allocation (``gpu_api: dra``) a hardware Xid (and an NVLink failure) makes NVIDIA's
DRA driver taint the device in its node's ResourceSlice: ``{key: gpu.nvidia.com/unhealthy, value:
xid-<code>, effect: NoSchedule}`` on ``gpu-<i>``; the taint stays until the kubelet plugin restarts,
which the repair (``clear``) does: the taint goes. The GPU's health in the pods' status
(``allocatedResourcesStatus``) follows the broken state on either API.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fleet.vocabulary import (
    DRIVER_UNHEALTHY_TAINT_KEY,
    GPU_RESOURCE,
    LWS_GROUP_KEY_LABEL,
    REVISION_LABEL,
    FaultKind,
)
from sim.control import FaultRequest
from sim.k8s.devices import device_name, node_slices
from sim.scenario import ModelRevision
from sim.serving.supervisor import is_leader
from sim.serving.telemetry import (
    APPLICATION_XIDS,
    CLOCK_EVENT_HW_THERMAL,
    CLOCK_EVENT_SW_THERMAL,
    INFORMATIONAL_XIDS,
    gpu_assignment,
)

if TYPE_CHECKING:
    from sim.serving.layer import ServingLayer

log = logging.getLogger(__name__)

NODE_FAULTS = frozenset(
    {
        FaultKind.NODE_LOST,
        FaultKind.GPU_XID,
        FaultKind.NVLINK_ERROR,
        FaultKind.THERMAL,
        FaultKind.FALSE_GPU_CONDITION,
    }
)
POD_FAULTS = frozenset(
    {
        FaultKind.POD_OOMKILLED,
        FaultKind.RANK_LOST,
        FaultKind.SLOW_REPLICA,
        FaultKind.SLOW_METRICS,
        FaultKind.WEDGED_ENGINE,
    }
)


class FaultError(Exception):
    """A fault request that cannot be applied; ``status`` is the HTTP answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _param_int(params: dict[str, Any], name: str, default: int, lo: int = 0, hi: int = 10_000) -> int:
    value = params.get(name, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise FaultError(422, f"params.{name} must be an integer (got {value!r})") from None
    if not lo <= number <= hi:
        raise FaultError(422, f"params.{name} must be between {lo} and {hi} (got {number})")
    return number


def _param_float(params: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = params.get(name, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FaultError(422, f"params.{name} must be a number (got {value!r})") from None
    if not lo <= number <= hi:
        raise FaultError(422, f"params.{name} must be between {lo:g} and {hi:g} (got {number:g})")
    return number


class FaultInjector:
    def __init__(self, layer: ServingLayer) -> None:
        self.layer = layer

    # ---- validation -------------------------------------------------------------------------
    def validate(self, fault: FaultRequest) -> None:
        """Raise FaultError (404/422) when the target or params are wrong; changes nothing."""
        if fault.kind in NODE_FAULTS:
            self._node(fault.target)
        elif fault.kind in POD_FAULTS:
            self._pod_key(fault.target)
        elif fault.kind == FaultKind.BAD_ROLLOUT:
            self._workload(fault.target)
        params = fault.params
        if fault.kind == FaultKind.GPU_XID:
            _param_int(params, "code", 79, 1, 200)
        if fault.kind in (FaultKind.GPU_XID, FaultKind.NVLINK_ERROR, FaultKind.THERMAL) and "gpu" in params:
            tel = self.layer.node_telemetry(fault.target)
            _param_int(params, "gpu", 0, 0, max(0, len(tel.gpus) - 1))
        if fault.kind in (FaultKind.SLOW_REPLICA, FaultKind.THERMAL) and "factor" in params:
            _param_float(params, "factor", 0.3, 0.01, 1.0)
        if fault.kind == FaultKind.SLOW_METRICS:
            _param_float(params, "delay_s", 5.0, 0.0, 600.0)
        if fault.kind == FaultKind.FALSE_GPU_CONDITION:
            condition = params.get("condition", "GpuXid")
            if not isinstance(condition, str) or not condition.isidentifier():
                raise FaultError(
                    422, f"params.condition must be a node condition type such as GpuXid (got {condition!r})"
                )

    def _node(self, name: str) -> dict[str, Any]:
        node = self.layer.kube.node(name)
        if node is None:
            known = sorted(n["metadata"]["name"] for n in self.layer.kube.nodes())
            raise FaultError(404, f"no node named {name!r}; known nodes: {known}")
        return node

    def _pod_key(self, target: str) -> str:
        ns, _, name = target.rpartition("/")
        ns = ns or self.layer.default_namespace
        if self.layer.kube.pod(ns, name) is None:
            raise FaultError(404, f"no pod {name!r} in namespace {ns!r}; name it as 'namespace/pod'")
        return f"{ns}/{name}"

    def _workload(self, target: str) -> tuple[str, str, str]:
        ns, _, name = target.rpartition("/")
        ns = ns or self.layer.default_namespace
        for plural in ("deployments", "leaderworkersets"):
            if self.layer.world.store.find(plural, ns, name) is not None:
                return plural, ns, name
        raise FaultError(404, f"no Deployment or LeaderWorkerSet {name!r} in namespace {ns!r}")

    # ---- application --------------------------------------------------------------------------
    def apply(self, fault: FaultRequest) -> None:
        self.validate(fault)
        now = self.layer.clock.now()
        params = fault.params
        clear = bool(params.get("clear"))
        log.info("fault %s on %s %s", fault.kind.value, fault.target, params)
        kind = fault.kind
        if kind == FaultKind.NODE_LOST:
            if clear:
                self.layer.world.restore_node(fault.target)
            else:
                self.layer.world.lose_node(fault.target)
                self.layer.supervisor.reconcile(now, force=True)
        elif kind == FaultKind.GPU_XID:
            if clear:
                self.repair_node(fault.target, under_load_defect=bool(params.get("under_load_defect")))
            else:
                self._xid(fault.target, _param_int(params, "code", 79, 1, 200), params, now)
        elif kind == FaultKind.NVLINK_ERROR:
            if clear:
                self.repair_node(fault.target)
            else:
                self._nvlink(fault.target, params, now)
        elif kind == FaultKind.THERMAL:
            self._thermal(fault.target, params, clear, now)
        elif kind == FaultKind.POD_OOMKILLED:
            self._oom(self._pod_key(fault.target), now)
        elif kind == FaultKind.RANK_LOST:
            self._rank_lost(self._pod_key(fault.target), now)
        elif kind == FaultKind.SLOW_REPLICA:
            key = self._pod_key(fault.target)
            factor = 1.0 if clear else _param_float(params, "factor", 0.3, 0.01, 1.0)
            self.layer.supervisor.sticky.setdefault(key, {})["slow_factor"] = factor
            engine = self.layer.supervisor.get(key)
            if engine is not None:
                engine.advance(now)
                engine.slow_factor = factor
        elif kind == FaultKind.SLOW_METRICS:
            key = self._pod_key(fault.target)
            delay = 0.0 if clear else _param_float(params, "delay_s", 5.0, 0.0, 600.0)
            self.layer.supervisor.sticky.setdefault(key, {})["metrics_delay_s"] = delay
        elif kind == FaultKind.WEDGED_ENGINE:
            key = self._pod_key(fault.target)
            engine = self.layer.supervisor.get(key)
            if engine is None:
                raise FaultError(409, f"pod {key} runs no engine right now (not started or crashed)")
            engine.advance(now)
            engine.wedged = not clear
        elif kind == FaultKind.BAD_ROLLOUT:
            self._bad_rollout(fault.target, params)
        elif kind == FaultKind.FALSE_GPU_CONDITION:
            condition = str(params.get("condition", "GpuXid"))
            message = "health check reports Xid 48 (double-bit ECC) on GPU 0" if not clear else "cleared"
            self._problem_condition(fault.target, condition, not clear, "XidError", message)

    def _victims(self, node: str, gpu: int | None) -> list[str]:
        """Serving replicas (engine keys) using ``gpu`` on ``node`` (all GPUs when None)."""
        holders = gpu_assignment(self.layer.kube, node)
        pods = (
            [holders[gpu]]
            if gpu is not None and gpu in holders
            else list(holders.values())
            if gpu is None
            else []
        )
        keys: list[str] = []
        for pod in pods:
            key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            if key not in keys:
                keys.append(key)
        return keys

    def _kill_replicas(self, keys: list[str], reason: str, now: float) -> None:
        for key in keys:
            engine = self.layer.supervisor.get(key)
            if engine is not None:
                engine.kill(reason, now)
            else:
                # A worker rank: its container dies, and the group's leader follows (NCCL).
                ns, name = key.split("/", 1)
                self.layer.world.set_container_state(ns, name, "crashed", message=reason)

    def _xid(self, node: str, code: int, params: dict[str, Any], now: float) -> None:
        """``params.keep_alive``: the server runs with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 (stays up, answers 503)."""
        tel = self.layer.node_telemetry(node)
        gpu = _param_int(params, "gpu", 0, 0, max(0, len(tel.gpus) - 1))
        state = tel.gpus[gpu]
        state.last_xid = code
        if code == 48:
            state.ecc_dbe_vol += 1
            state.ecc_dbe_agg += 1
        elif code in (94, 95, 140):
            state.ecc_dbe_vol += 1
            state.ecc_dbe_agg += 1
            state.remapped_uncorrectable += 1
        elif code == 63:
            state.remapped_correctable += 1
        elif code == 64:
            state.row_remap_failure = 1
        elif code == 92:
            state.ecc_sbe_vol += 1000
            state.ecc_sbe_agg += 1000
        elif code == 74:
            state.nvlink_crc_errors += 100
        if code in INFORMATIONAL_XIDS:
            return
        reason = f"CUDA error: Xid {code} on GPU {gpu} of {node}"
        if code not in APPLICATION_XIDS:
            state.broken = f"Xid {code}"
            self._problem_condition(
                node, "GpuXid", True, "XidError", f"Xid {code} on GPU {gpu} ({state.uuid})"
            )
            self._driver_taint(node, gpu, code)
        self._sync_allocatable(node)
        victims = self._victims(node, gpu)
        if params.get("keep_alive"):
            for key in victims:
                self.layer.supervisor.sticky.setdefault(key, {})["keep_alive"] = True
        self._kill_replicas(victims, reason, now)

    def _nvlink(self, node: str, params: dict[str, Any], now: float) -> None:
        tel = self.layer.node_telemetry(node)
        gpu = _param_int(params, "gpu", 0, 0, max(0, len(tel.gpus) - 1))
        state = tel.gpus[gpu]
        state.last_xid = 74
        state.nvlink_crc_errors += 250
        state.nvlink_crc_data_errors += 60
        state.nvlink_replay_errors += 40
        state.nvlink_recovery_errors += 3
        state.broken = "Xid 74 (NVLink error)"
        self._driver_taint(node, gpu, 74)
        self._sync_allocatable(node)
        held: dict[str, int] = {}
        for pod in gpu_assignment(self.layer.kube, node).values():
            key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            held[key] = held.get(key, 0) + 1
        victims = [key for key in self._victims(node, gpu) if held.get(key, 0) > 1]
        self._kill_replicas(victims, f"NCCL error: NVLink failure on GPU {gpu} of {node} (Xid 74)", now)

    def _thermal(self, node: str, params: dict[str, Any], clear: bool, now: float) -> None:
        tel = self.layer.node_telemetry(node)
        factor = 1.0 if clear else _param_float(params, "factor", 0.5, 0.01, 1.0)
        temp = 38.0 if clear else _param_float(params, "temp_c", 94.0, 0.0, 130.0)
        gpus = [tel.gpus[_param_int(params, "gpu", 0, 0, len(tel.gpus) - 1)]] if "gpu" in params else tel.gpus
        for g in gpus:
            g.temp_c = temp
            g.clock_events = 0 if clear else CLOCK_EVENT_SW_THERMAL | CLOCK_EVENT_HW_THERMAL
            if g.thermal_since is not None:
                g.thermal_violation_us += (now - g.thermal_since) * 1e6
            g.thermal_since = None if clear else now
        if clear:
            self.layer.thermal_nodes.pop(node, None)
        else:
            self.layer.thermal_nodes[node] = factor
        for key, engine in self.layer.supervisor.engines().items():
            if engine.node == node:
                engine.advance(now)
                sticky = self.layer.supervisor.sticky.get(key, {}).get("slow_factor", 1.0)
                engine.slow_factor = sticky * factor

    def _oom(self, key: str, now: float) -> None:
        ns, name = key.split("/", 1)
        engine = self.layer.supervisor.get(key)
        if engine is not None:
            engine.kill("OOMKilled: the container exceeded its memory limit", now)
            self.layer.supervisor.mark_exit_reported(key)
        self.layer.world.set_container_state(ns, name, "oomkilled", message="OOMKilled")

    def _rank_lost(self, key: str, now: float) -> None:
        """One rank's process dies; the group's leader engine aborts with it (a broken NCCL communicator)."""
        ns, name = key.split("/", 1)
        pod = self.layer.kube.pod(ns, name)
        group = ((pod or {}).get("metadata", {}).get("labels") or {}).get(LWS_GROUP_KEY_LABEL)
        leaders = [key]
        if group is not None:
            leaders = [
                f"{ns}/{p['metadata']['name']}"
                for p in self.layer.kube.pods()
                if p["metadata"]["namespace"] == ns
                and (p["metadata"].get("labels") or {}).get(LWS_GROUP_KEY_LABEL) == group
                and is_leader(p)
            ]
        for leader in leaders:
            engine = self.layer.supervisor.get(leader)
            if engine is not None:
                engine.kill(f"NCCL error: rank {name} of the replica group was lost", now)
                if leader == key:
                    self.layer.supervisor.mark_exit_reported(key)
        self.layer.world.set_container_state(ns, name, "crashed", message="rank lost: NCCL watchdog timeout")

    def _bad_rollout(self, target: str, params: dict[str, Any]) -> None:
        plural, ns, name = self._workload(target)
        store = self.layer.world.store
        obj = store.find(plural, ns, name)
        assert obj is not None
        if plural == "deployments":
            template = obj["spec"]["template"]
        else:
            template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        current = labels.get(REVISION_LABEL, "r1")
        model = self.layer.world.model_for_pod({"metadata": {"labels": labels}})
        revision = str(params.get("revision") or f"{current}-bad")
        defect = str(params.get("defect") or "crash-on-start")
        if defect not in ("crash-on-start", "oom-on-start", "slow"):
            raise FaultError(
                422, f"params.defect must be crash-on-start, oom-on-start or slow (got {defect!r})"
            )
        if model is not None:
            try:
                model.revision(revision)
            except KeyError:
                base = model.revisions[0]
                model.revisions.append(
                    ModelRevision(
                        name=revision,
                        image=f"{base.image.rsplit(':', 1)[0]}:{revision}",
                        engine_version=base.engine_version,
                        defect=defect,  # type: ignore[arg-type]
                    )
                )
            image = model.revision(revision).image
        else:
            image = None

        def change(o: dict[str, Any]) -> None:
            tpl = (
                o["spec"]["template"]
                if plural == "deployments"
                else o["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            )
            tpl.setdefault("metadata", {}).setdefault("labels", {})[REVISION_LABEL] = revision
            if image:
                for c in tpl.get("spec", {}).get("containers", [])[:1]:
                    c["image"] = image
            if plural == "leaderworkersets":
                leader = o["spec"]["leaderWorkerTemplate"].get("leaderTemplate")
                if leader:
                    leader.setdefault("metadata", {}).setdefault("labels", {})[REVISION_LABEL] = revision
                    for c in leader.get("spec", {}).get("containers", [])[:1]:
                        if image:
                            c["image"] = image

        store.mutate(plural, ns, name, change)

    def repair_node(self, node: str, *, under_load_defect: bool = False) -> None:
        """A GPU reset / repair: clears broken GPUs and volatile counters (aggregate ones persist).

        ``under_load_defect``: the GPUs that were broken idle clean but fail under load.
        """
        tel = self.layer.node_telemetry(node)
        for g in tel.gpus:
            if under_load_defect and g.broken:
                g.under_load_defect = f"fails under load after a reset that cleared {g.broken}"
            elif not under_load_defect:
                g.under_load_defect = None
            g.broken = None
            g.ecc_sbe_vol = g.ecc_dbe_vol = 0
        self._problem_condition(
            node, "GpuXid", False, "NoXidError", "no Xid error since the driver restarted"
        )
        for g in tel.gpus:
            g.last_xid = 0
            g.row_remap_failure = 0
        self._restart_driver(node)
        self._sync_allocatable(node)

    def _problem_condition(self, node: str, ctype: str, on: bool, reason: str, message: str) -> None:
        """A node-problem-detector condition (custom plugin style: True while the problem stands)."""
        from sim.k8s import objects as o

        stamp = self.layer.clock.timestamp()

        def change(obj: dict[str, Any]) -> None:
            if not on and o.condition(obj, ctype) is None:
                return
            o.set_condition(obj, ctype, "True" if on else "False", stamp, reason, message, style="node")

        self.layer.world.store.mutate("nodes", "", node, change)

    def _sync_allocatable(self, node: str) -> None:
        """The device plugin reports unhealthy GPUs: allocatable nvidia.com/gpu = capacity - broken.

        A node without ``nvidia.com/gpu`` capacity (DRA) is left alone. Either way the GPUs' health
        changed: the kubelets re-sync the pods' ``allocatedResourcesStatus``."""
        tel = self.layer.node_telemetry(node)
        broken = sum(1 for g in tel.gpus if g.broken)
        self.layer.kube.devices.health_changed()

        def change(obj: dict[str, Any]) -> None:
            status = obj.setdefault("status", {})
            if GPU_RESOURCE not in (status.get("capacity") or {}):
                return
            capacity = int((status.get("capacity") or {}).get(GPU_RESOURCE, len(tel.gpus)))
            status.setdefault("allocatable", {})[GPU_RESOURCE] = str(max(0, capacity - broken))

        self.layer.world.store.mutate("nodes", "", node, change)

    def _driver_taint(self, node: str, gpu: int, code: int) -> None:
        """NVIDIA's DRA driver taints a device on a fatal Xid (in its ResourceSlice), until it restarts."""
        store = self.layer.world.store
        stamp = self.layer.clock.timestamp()
        name = device_name(gpu)
        for found in node_slices(store, node):

            def change(obj: dict[str, Any]) -> None:
                for device in obj["spec"].get("devices") or []:
                    if device.get("name") != name:
                        continue
                    taints = device.setdefault("taints", [])
                    if not any(t.get("key") == DRIVER_UNHEALTHY_TAINT_KEY for t in taints):
                        taints.append(
                            {
                                "key": DRIVER_UNHEALTHY_TAINT_KEY,
                                "value": f"xid-{code}",
                                "effect": "NoSchedule",
                                "timeAdded": stamp,
                            }
                        )

            store.mutate("resourceslices", "", found["metadata"]["name"], change)

    def _restart_driver(self, node: str) -> None:
        """The repair restarts the DRA driver's kubelet plugin: it republishes its devices untainted."""
        store = self.layer.world.store
        for found in node_slices(store, node):

            def change(obj: dict[str, Any]) -> None:
                for device in obj["spec"].get("devices") or []:
                    kept = [
                        t for t in device.get("taints") or [] if t.get("key") != DRIVER_UNHEALTHY_TAINT_KEY
                    ]
                    if kept:
                        device["taints"] = kept
                    else:
                        device.pop("taints", None)

            store.mutate("resourceslices", "", found["metadata"]["name"], change)
