"""Scenario files: the cluster, models and workloads a simulated world starts with.

A scenario is YAML validated by pydantic; a bad file is rejected with an error
naming the offending field (``load_scenario`` raises ``ScenarioError``).

Sections:
* ``nodes``: groups of identical GPU nodes (count, GPUs, topology labels; ``label_blocks`` give
  a label whose value changes every N nodes, e.g. a rack of 16 or an NVLink domain of 2);
* ``models``: what a replica needs (GPUs per pod, pods per replica) and how it
  behaves (image pull, weight load, distributed init, warm rate, KV capacity,
  engine version era, shutdown timeout), with one or more revisions;
* ``workloads``: pools — a Service plus a serving Deployment or LeaderWorkerSet,
  optionally a warm-spare Deployment of the same model and revision
  (``fleetmend.io/role=spare``, no router label: Ready but not routed) and a PDB;
* ``pool_sets``: many pools of one shape at once (``count`` pools ``{prefix}-{i:03d}``, each
  serving its own copy of a model), expanded into ``models`` and ``workloads`` on load;
* ``scheduler``: the scheduler's scoring (LeastAllocated spreads, MostAllocated bin-packs);
* ``gpu_api``: how pods get GPUs: ``device-plugin`` (``nvidia.com/gpu`` requests, the default) or
  ``dra`` (Dynamic Resource Allocation: NVIDIA's DRA driver publishes ResourceSlices, pods claim GPUs
  through ResourceClaimTemplates; ``sim.k8s.devices``);
* ``timings``: control-plane durations (node-monitor grace, toleration seconds);
* ``faults``: faults to inject at given sim times;
* ``load``: free-form settings owned by the serving layer (``sim.serving``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fleet.vocabulary import FaultKind


class ScenarioError(ValueError):
    """A scenario file that cannot be loaded; the message names the file and the bad field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LabelBlock(_Strict):
    """A label whose value changes every ``every`` nodes of a group: node ``i`` is in block ``n = i // every``
    and gets ``format.format(n=n)`` (e.g. ``rack-{n:02d}``) or ``values[n % len(values)]`` (blocks
    take the values in turn, e.g. racks alternating between two zones)."""

    key: str = Field(min_length=1)
    every: int = Field(ge=1, description="nodes per block (consecutive node indexes)")
    format: str | None = Field(None, description="value template; {n} is the block number")
    values: list[str] | None = Field(None, min_length=1, description="values the blocks take in turn")

    @model_validator(mode="after")
    def _one_source(self) -> LabelBlock:
        if (self.format is None) == (self.values is None):
            raise ValueError("set exactly one of format or values")
        if self.format is not None:
            try:
                self.format.format(n=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"format {self.format!r} must use only {{n}} ({exc})") from None
        return self

    def value(self, index: int) -> str:
        block = index // self.every
        if self.values is not None:
            return self.values[block % len(self.values)]
        return str(self.format).format(n=block)


class NodeGroup(_Strict):
    """``count`` identical nodes named ``{prefix}-{i}`` (``{i}`` zero-padded to ``index_width`` digits)."""

    prefix: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    count: int = Field(ge=1, le=2048)
    index_width: int = Field(0, ge=0, le=6, description="zero-pad node indexes to this many digits")
    gpus: int = Field(ge=0, le=64)
    gpu_product: str = "NVIDIA-H100-80GB-HBM3"
    cpu: str = "96"
    memory: str = "1024Gi"
    labels: dict[str, str] = Field(default_factory=dict)
    # Optional per-node labels, e.g. one NVLink domain per pair of nodes: {"0": {...}, "1": {...}}.
    node_labels: dict[int, dict[str, str]] = Field(default_factory=dict)
    # Labels by blocks of consecutive nodes, e.g. {key: topology.kubernetes.io/rack, every: 16, format: rack-{n:02d}}.
    label_blocks: list[LabelBlock] = Field(default_factory=list)
    unschedulable: bool = False

    def node_name(self, index: int) -> str:
        return f"{self.prefix}-{index:0{self.index_width}d}"

    def labels_of(self, index: int) -> dict[str, str]:
        """The scenario's labels of node ``index``: the group's, its blocks', then its own."""
        return {
            **self.labels,
            **{block.key: block.value(index) for block in self.label_blocks},
            **self.node_labels.get(index, {}),
        }


class ModelRevision(_Strict):
    """One revision of a model's serving image. ``defect`` makes a bad rollout reproducible."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    image: str
    engine_version: str = Field("0.10.2", description="vLLM version era the metrics names follow")
    # none: healthy; crash-on-start / oom-on-start: the kubelet sees the container die
    # after loading (restartCount grows, CrashLoopBackOff); slow: serving layer slows it down.
    defect: Literal["none", "crash-on-start", "oom-on-start", "slow"] = "none"


class ModelSpec(_Strict):
    """What one replica (one replica group) of a model needs and how it behaves."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    served_name: str
    gpus_per_pod: int = Field(ge=0, le=64, description="nvidia.com/gpu per pod (tensor parallel size)")
    pods_per_replica: int = Field(1, ge=1, le=64, description="nodes per replica group (LWS size)")
    image_pull_s: float = Field(20.0, ge=0)
    weight_load_s: float = Field(60.0, ge=0)
    distributed_init_s: float = Field(0.0, ge=0)
    warm_up_s: float = Field(120.0, ge=0, description="time until the prefix cache is warm after Ready")
    warm_rate_tokens_per_s: float = Field(2000.0, gt=0, description="service rate of a warm replica")
    cold_rate_fraction: float = Field(0.5, gt=0, le=1, description="fraction of warm rate when just Ready")
    kv_capacity_tokens: int = Field(400_000, gt=0)
    max_num_seqs: int = Field(256, gt=0)
    shutdown_timeout_s: float = Field(0.0, ge=0, description="vLLM --shutdown-timeout (0 = abort in-flight)")
    termination_grace_s: int = Field(60, ge=0)
    container_port: int = Field(8000, ge=1, le=65535)
    revisions: list[ModelRevision] = Field(min_length=1)

    @property
    def gpus_per_replica(self) -> int:
        return self.gpus_per_pod * self.pods_per_replica

    @property
    def startup_s(self) -> float:
        return self.image_pull_s + self.weight_load_s + self.distributed_init_s

    def revision(self, name: str) -> ModelRevision:
        for revision in self.revisions:
            if revision.name == name:
                return revision
        raise KeyError(name)


class ServiceSpec(_Strict):
    name: str | None = Field(None, description="default: the workload name")
    port: int = Field(80, ge=1, le=65535)
    select_router_label: bool = Field(
        False, description="Service selector also requires fleetmend.io/serving=true (router-only label)"
    )
    publish_not_ready_addresses: bool = False


class PdbSpec(_Strict):
    min_available: int | str | None = None
    max_unavailable: int | str | None = None

    @model_validator(mode="after")
    def _one_of(self) -> PdbSpec:
        if (self.min_available is None) == (self.max_unavailable is None):
            raise ValueError("set exactly one of min_available or max_unavailable")
        return self


class RolloutSpec(_Strict):
    """A second revision rolled out by "CI" at a sim time (seconds after start)."""

    to_revision: str
    at_s: float = Field(ge=0)


class WorkloadSpec(_Strict):
    """A pool: Service + serving workload (+ warm spares, + PDB)."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    model: str
    revision: str | None = Field(None, description="default: the model's first revision")
    kind: Literal["Deployment", "LeaderWorkerSet"] = "Deployment"
    replicas: int = Field(ge=0, le=512)
    warm_spares: int = Field(
        0, ge=0, le=64, description="replicas of a role=spare Deployment (no router label)"
    )
    selector_includes_router_label: bool = Field(
        False, description="anti-pattern: the workload's own selector uses the router-only label"
    )
    readiness_gate: bool = Field(True, description="pods carry the fleetmend.io/serving-ready readiness gate")
    router_label_on_pods: bool = True
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    pdb: PdbSpec | None = None
    topology_key: str | None = Field(None, description="multi-pod groups share one value of this node label")
    extra_labels: dict[str, str] = Field(default_factory=dict)
    rollout: RolloutSpec | None = None


class PoolSet(_Strict):
    """``count`` pools of one shape: pools ``{prefix}-{i:03d}``, each with its own copy of ``model``
    (named like the pool, served as ``{pool}/{last part of the model's served name}``), so a user or
    a load run names one pool by its model."""

    prefix: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    count: int = Field(ge=1, le=1024)
    model: str = Field(description="the model every pool of the set serves a copy of")
    kind: Literal["Deployment", "LeaderWorkerSet"] = "Deployment"
    replicas: int = Field(ge=0, le=512)
    warm_spares: int = Field(0, ge=0, le=64)
    topology_key: str | None = None
    service: ServiceSpec = Field(default_factory=ServiceSpec)
    pdb: PdbSpec | None = None

    def pool_name(self, index: int) -> str:
        return f"{self.prefix}-{index:03d}"


class SchedulerSpec(_Strict):
    """How the scheduler scores the nodes a pod fits on (kube-scheduler's NodeResourcesFit strategy)."""

    scoring: Literal["LeastAllocated", "MostAllocated"] = Field(
        "LeastAllocated",
        description="LeastAllocated: most free GPUs first (spreads). MostAllocated: fewest free GPUs "
        "that fit first (bin-packs, leaving whole nodes free for TP=8 and multi-node groups); pods "
        "of one ReplicaSet then prefer nodes holding none of their siblings (a soft spread over hosts)",
    )


class Timings(_Strict):
    """Control-plane durations in sim seconds (Kubernetes defaults)."""

    # kube-controller-manager --node-monitor-grace-period: 50 s since Kubernetes 1.32 (40 s before;
    # kubernetes/kubernetes#126287).
    node_monitor_grace_s: float = Field(50.0, ge=0)
    unreachable_toleration_s: int = Field(300, ge=0)
    not_ready_toleration_s: int = Field(300, ge=0)
    default_termination_grace_s: int = Field(30, ge=0)
    crash_loop_backoff_s: float = Field(10.0, ge=0)
    scheduler_retry_s: float = Field(10.0, gt=0, description="how often an unschedulable pod is retried")


class ScheduledFault(_Strict):
    kind: FaultKind
    target: str
    at_s: float = Field(ge=0)
    params: dict[str, Any] = Field(default_factory=dict)


class Scenario(_Strict):
    name: str
    description: str = ""
    namespace: str = "inference"
    seed: int = 0
    timings: Timings = Field(default_factory=Timings)
    nodes: list[NodeGroup] = Field(min_length=1)
    models: list[ModelSpec] = Field(min_length=1)
    workloads: list[WorkloadSpec] = Field(default_factory=list)
    pool_sets: list[PoolSet] = Field(
        default_factory=list, exclude=True, description="expanded into models and workloads on load"
    )
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    gpu_api: Literal["device-plugin", "dra"] = Field(
        "device-plugin",
        description="device-plugin: nodes advertise nvidia.com/gpu and pods request it. dra: nodes advertise "
        "no nvidia.com/gpu; the NVIDIA DRA driver publishes a DeviceClass gpu.nvidia.com and a ResourceSlice "
        "per GPU node, and each workload's pods claim GPUs through a ResourceClaimTemplate <workload>-gpus",
    )
    faults: list[ScheduledFault] = Field(default_factory=list)
    load: dict[str, Any] = Field(default_factory=dict, description="owned by the serving layer")

    @model_validator(mode="after")
    def _cross_references(self) -> Scenario:
        self._expand_pool_sets()
        models = {m.name: m for m in self.models}
        if len(models) != len(self.models):
            raise ValueError("models: model names must be unique")
        prefixes = [g.prefix for g in self.nodes]
        if len(set(prefixes)) != len(prefixes):
            raise ValueError("nodes: node group prefixes must be unique")
        seen: set[tuple[str, str]] = set()
        for index, workload in enumerate(self.workloads):
            where = f"workloads.{index}"
            model = models.get(workload.model)
            if model is None:
                raise ValueError(f"{where}.model: unknown model {workload.model!r} (known: {sorted(models)})")
            revisions = [r.name for r in model.revisions]
            if workload.revision is not None and workload.revision not in revisions:
                raise ValueError(
                    f"{where}.revision: model {model.name!r} has no revision {workload.revision!r}"
                )
            if workload.rollout is not None and workload.rollout.to_revision not in revisions:
                raise ValueError(
                    f"{where}.rollout.to_revision: model {model.name!r} has no revision {workload.rollout.to_revision!r}"
                )
            if model.pods_per_replica > 1 and workload.kind != "LeaderWorkerSet":
                raise ValueError(
                    f"{where}.kind: model {model.name!r} needs {model.pods_per_replica} pods per replica; "
                    "use kind: LeaderWorkerSet"
                )
            key = (workload.namespace or self.namespace, workload.name)
            if key in seen:
                raise ValueError(f"{where}.name: duplicate workload {workload.name!r}")
            seen.add(key)
        return self

    def _expand_pool_sets(self) -> None:
        templates = {m.name: m for m in self.models}
        for index, pool_set in enumerate(self.pool_sets):
            template = templates.get(pool_set.model)
            if template is None:
                raise ValueError(
                    f"pool_sets.{index}.model: unknown model {pool_set.model!r} (known: {sorted(templates)})"
                )
            for i in range(pool_set.count):
                pool = pool_set.pool_name(i)
                served = f"{pool}/{template.served_name.rsplit('/', 1)[-1]}"
                self.models.append(template.model_copy(update={"name": pool, "served_name": served}))
                self.workloads.append(
                    WorkloadSpec(
                        name=pool,
                        model=pool,
                        kind=pool_set.kind,
                        replicas=pool_set.replicas,
                        warm_spares=pool_set.warm_spares,
                        topology_key=pool_set.topology_key,
                        service=pool_set.service.model_copy(),
                        pdb=pool_set.pdb.model_copy() if pool_set.pdb is not None else None,
                    )
                )
        self.pool_sets = []

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    def workload_namespace(self, workload: WorkloadSpec) -> str:
        return workload.namespace or self.namespace


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc if not str(part).startswith("function-"))


def parse_scenario(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate an already-parsed scenario document."""
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{_field_path(err['loc']) or '(top level)'}: {err['msg']}" for err in exc.errors()
        )
        raise ScenarioError(
            f"{source}: invalid scenario: {problems}. Fix the field(s) named and retry."
        ) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read scenario file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ScenarioError(
            f"{path}: a scenario must be a YAML mapping with at least 'name', 'nodes' and 'models'"
        )
    return parse_scenario(data, str(path))


SCENARIO_DIR = Path(__file__).parent / "scenarios"


def scaled_scenario(scenario: str | Path, nodes: int) -> Scenario:
    """The scenario at ``scenario`` (a path, or a shipped scenario's name) with ``nodes`` nodes: every
    node group's count and every pool set's count scaled by ``nodes`` / its node total, so the same
    shape (racks, zones, mix of pools, free share) holds at another size, e.g. ``fleet-512`` at 64."""
    path = Path(scenario)
    if not path.suffix:
        path = SCENARIO_DIR / f"{scenario}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read scenario file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise ScenarioError(f"{path}: a scenario must be a YAML mapping with a 'nodes' list")
    total = sum(int(group.get("count", 0)) for group in data["nodes"])
    if total <= 0 or nodes <= 0:
        raise ScenarioError(f"{path}: cannot scale {total} nodes to {nodes}")

    def scaled(count: int, where: str) -> int:
        value = count * nodes / total
        if value != int(value) or value < 1:
            raise ScenarioError(
                f"{path}: {where} ({count}) does not scale to {nodes} nodes from {total}: pick a node "
                f"count that divides evenly (e.g. {total // 8}, {total // 4}, {total // 2})"
            )
        return int(value)

    for i, group in enumerate(data["nodes"]):
        group["count"] = scaled(int(group["count"]), f"nodes.{i}.count")
    for i, pool_set in enumerate(data.get("pool_sets") or []):
        pool_set["count"] = scaled(int(pool_set["count"]), f"pool_sets.{i}.count")
    if nodes != total:
        data["name"] = f"{data.get('name', path.stem)}-at-{nodes}"
    return parse_scenario(data, f"{path} at {nodes} nodes")


def shipped_scenarios() -> dict[str, Path]:
    """The scenarios shipped in ``sim/scenarios`` by name."""
    return {p.stem: p for p in sorted(SCENARIO_DIR.glob("*.yaml"))}
