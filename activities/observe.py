"""Read-only activities: look at the pool through Kubernetes, the gateway (Envoy) and the engines.

None of these mutate anything, so none go through the ledger. Each returns a
pydantic model the workflow hands to the pure policies in ``fleet/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from temporalio import activity

from activities import kube_reads as kr
from activities.deps import ActivityDeps
from activities.engine_reads import EngineRead, look_deadline, read_all, read_engine
from fleet.admission_look import KeeperLook, KeeperMemory, keeper_look, keeper_readmission
from fleet.device_fault import DraDevice, dra_device
from fleet.engine_metrics import EngineSnapshot, NodeGpuTelemetry, parse_dcgm_metrics
from fleet.gateway import Admission, JournalEntry, RouterState
from fleet.incident import PoolRef
from fleet.observation import (
    EndpointConditions,
    EngineHealth,
    PodObservation,
    PoolObservation,
    WorkloadSelector,
)
from fleet.pool import GroupRole, NodeInfo, PoolSnapshot, ReplicaGroup, Taint, WorkloadKind
from fleet.qualification import QUALIFICATION_LABEL, GpuHolder, gpu_problem_conditions, machine_id
from fleet.recovery import IncidentInput
from fleet.shedding import admission_changed, refused_fraction
from fleet.slots import REBUILD_PHASES, Slots
from fleet.survivor_load import next_admission_look
from fleet.vocabulary import (
    GPU_DRIVER,
    GPU_RESOURCE,
    LWS_GROUP_INDEX_LABEL,
    LWS_GROUP_KEY_LABEL,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    MODEL_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    ROLE_SPARE,
)
from kube.allocation import allocation_of, device_health, gpus_held, gpus_of
from kube.allocation import terminated as pod_terminated

PROGRESS_PROBE_GAP_S = 0.5


class ObserveRequest(BaseModel):
    pool: PoolRef
    check_progress_of: list[str] = Field(
        default_factory=list, description="Group ids whose engines get two scrapes (wedge detection)"
    )
    focus_nodes: list[str] = Field(default_factory=list)
    focus_pods: list[str] = Field(default_factory=list)
    light: bool = Field(
        False,
        description="Only what confirming a loss needs: engines of the focus groups only, no GPU accounting "
        "or scheduling events (the deroute must not wait for a full survey)",
    )


class NodeRead(BaseModel):
    node: NodeInfo | None = Field(description="None: no such node in the cluster")


class NodeEngines(BaseModel):
    """Whether a node still serves, from its engines themselves (a direct probe of each: the node's
    Ready condition says what the API server hears from its kubelet, not whether its engines answer)."""

    node: str
    engines: int = Field(description="Running GPU pods with a pod IP on the node")
    answering: int = Field(description="Of them, the engines whose /health answered 200 just now")
    unread: int = Field(
        0, description="Of them, the engines not read within the look's time (no answer yet is not death)"
    )
    fleet_gpu_nodes: int = Field(description="Nodes in the cluster with GPUs (the removal breaker's base)")


class NodeHealth(BaseModel):
    node: NodeInfo | None
    conditions: dict[str, str] = Field(default_factory=dict)
    telemetry: NodeGpuTelemetry | None = None
    telemetry_error: str | None = None
    pod_reasons: dict[str, str] = Field(default_factory=dict, description="pod -> termination/waiting reason")
    annotations: dict[str, str] = Field(default_factory=dict)
    machine: str | None = Field(
        None, description="spec.providerID, else uid:<node UID> (fleet.qualification)"
    )
    uid: str | None = None
    gpu_capacity: int = 0
    gpu_allocatable: int = 0
    gpus_held: int = Field(
        0, description="GPUs requested by running pods on the node other than qualification"
    )
    gpu_holders: list[GpuHolder] = Field(
        default_factory=list, description="the pods behind gpus_held (qualification Jobs excluded)"
    )
    dra_devices: list[DraDevice] = Field(
        default_factory=list,
        description="The node's GPUs in its DRA driver's ResourceSlice ([]: device plugin)",
    )


class AdmissionWatch(BaseModel):
    """The admission keeper's state, handed to ``watch_admission`` while its recovery asks an operator."""

    observe: ObserveRequest
    lost_ids: list[str]
    memory: KeeperMemory
    admission: Admission  # what the gateway has, as the recovery set it
    capacity_rps: float  # the capacity the keeper planned on
    arrival_rps: float  # the keeper's arrival estimate, until the gateway has counted enough
    wait_budget_s: float
    target_utilization: float = Field(0.9, gt=0, le=1, description="the objectives' planned utilization")
    interval_s: float = Field(gt=0, description="the keeper's base interval between looks")
    max_interval_s: float = Field(gt=0)
    look_timeout_s: float = Field(
        gt=0, description="one look's time (the engines are waited for a share of it)"
    )
    watch_s: float = Field(gt=0, description="return after this long even if nothing moved")


class AdmissionWatched(BaseModel):
    """How a watch ended: the look that would move admission (``moved``), or its last look."""

    moved: bool
    look: KeeperLook
    looks: int
    interval_s: float  # the interval the looks had backed off to


class DerouteWait(BaseModel):
    pool: PoolRef
    pods: list[str]
    timeout_s: float = Field(gt=0)


class DerouteSeen(BaseModel):
    at: float
    still_routed: list[str]


class ScrapeRequest(BaseModel):
    pool: PoolRef
    pods: list[str]


class JournalRequest(BaseModel):
    pool: PoolRef
    replicas: list[str]
    since: float | None = None


def node_info(node: kr.Obj, allocated: int) -> NodeInfo:
    ready = kr.condition(node, "Ready")
    taints = tuple(
        Taint(key=t["key"], value=t.get("value", ""), effect=t.get("effect", "NoSchedule"))
        for t in node.get("spec", {}).get("taints") or []
    )
    alloc = (node.get("status", {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)
    return NodeInfo(
        name=kr.name(node),
        labels=kr.labels(node),
        ready=True if ready == "True" else (False if ready == "False" else None),
        unschedulable=bool(node.get("spec", {}).get("unschedulable")),
        taints=taints,
        gpu_allocatable=int(alloc),
        gpu_allocated=allocated,
        gpu_problems=tuple(
            gpu_problem_conditions(
                {c["type"]: str(c.get("status")) for c in node.get("status", {}).get("conditions") or []}
            )
        ),
    )


def _or_list(watched: list[kr.Obj] | None, list_fn: Callable[..., list[kr.Obj]], *args: Any) -> list[kr.Obj]:
    """What a watch holds, or a list from the API server while that watch is not following it."""
    return watched if watched is not None else list_fn(*args)


def _container_reasons(pod: kr.Obj) -> tuple[str | None, str | None, int]:
    waiting = terminated = None
    restarts = 0
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        restarts += int(cs.get("restartCount") or 0)
        state = cs.get("state") or {}
        last = cs.get("lastState") or {}
        if "waiting" in state and not waiting:
            waiting = state["waiting"].get("reason")
        term = state.get("terminated") or last.get("terminated")
        if term and not terminated:
            terminated = term.get("reason")
    return waiting, terminated, restarts


class ObserveActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    # ------------------------------------------------------------ config

    @activity.defn(name="load_incident_config")
    def load_incident_config(self, pool: PoolRef) -> IncidentInput:
        """The worker's procedure policy for an incident started by an alert (no explicit config)."""
        s = self.deps.settings
        return IncidentInput(
            pool=pool, dry_run=s.dry_run, timings=s.recovery_timings, objectives=s.serving_objectives
        )

    # ------------------------------------------------------------ the pool

    @activity.defn(name="observe_pool")
    def observe_pool(self, req: ObserveRequest) -> PoolObservation:
        """Kubernetes + gateway + engines, for one pool, as one observation."""
        # Engines are waited for until a share of this attempt's time from its start, whatever the
        # Kubernetes and gateway reads before them took (at least a second).
        return self._observe_pool(req, look_deadline())

    @activity.defn(name="watch_admission")
    def watch_admission(self, req: AdmissionWatch) -> AdmissionWatched:
        """The admission keeper's looks while its recovery waits on an operator, in one activity.

        Each look is ``observe_pool``'s, read by ``fleet.admission_look.keeper_look`` and decided by
        ``keeper_readmission``, as the keeper decides between its own looks. The watch returns the
        look that would move admission (the workflow re-decides and applies it), or its last look
        after ``watch_s``, or at once when the workflow cancels it (the operator answered). Looks back
        off as the keeper's do (``next_admission_look``). Each look heartbeats its count, so a dead
        worker's watch is started again on another from the request's memory. A watch holds one of
        the worker's activity slots for as long as it runs.
        """
        started = time.monotonic()
        memory, interval, looks = req.memory, req.interval_s, 0
        refused = refused_fraction(req.admission)
        while True:
            obs = self._observe_pool(req.observe, look_deadline(look_s=req.look_timeout_s))
            look = keeper_look(
                memory, obs, req.lost_ids, refused_share=refused, planned_capacity_rps=req.capacity_rps
            )
            memory, looks = look.memory, looks + 1
            decision = keeper_readmission(
                req.arrival_rps if look.arrival_rps is None else look.arrival_rps,
                look.capacity_rps,
                look.change,
                backlog=look.backlog,
                wait_budget_s=req.wait_budget_s,
                look_s=interval,
                target_utilization=req.target_utilization,
            )
            if admission_changed(req.admission, decision.admission):
                return AdmissionWatched(moved=True, look=look, looks=looks, interval_s=interval)
            interval = next_admission_look(
                interval,
                req.interval_s,
                req.max_interval_s,
                admission_moved=False,
                backlog=look.backlog,
                awaiting_operator=True,
            )
            if time.monotonic() - started + interval > req.watch_s:
                return AdmissionWatched(moved=False, look=look, looks=looks, interval_s=interval)
            activity.heartbeat(looks)
            activity.wait_for_cancelled_sync(interval)
            if activity.is_cancelled():  # the operator answered: the workflow no longer waits for this
                return AdmissionWatched(moved=False, look=look, looks=looks, interval_s=interval)

    def _observe_pool(self, req: ObserveRequest, deadline: float) -> PoolObservation:
        """One look at the pool; engines are waited for until ``deadline`` (monotonic)."""
        k = self.deps.kube
        ns, svc_name = req.pool.namespace, req.pool.service
        warnings: list[str] = []
        svc = kr.get_service(k, ns, svc_name)
        selector: dict[str, str] = dict(svc.get("spec", {}).get("selector") or {})
        pnra = bool(svc.get("spec", {}).get("publishNotReadyAddresses"))
        model = selector.get(MODEL_LABEL)
        router_label = self.deps.settings.router_label
        if model:
            pods = kr.list_pods(k, ns, f"{MODEL_LABEL}={model}")
        else:
            # The Service may select only group leaders (LWS): find the model through the pods it
            # selects, then take every pod of that model (workers and warm spares included).
            base = {key: v for key, v in selector.items() if key != router_label}
            pods = kr.list_pods(k, ns, ",".join(f"{key}={v}" for key, v in base.items()) or None)
            models = {m for p in pods if (m := kr.labels(p).get(MODEL_LABEL))}
            if len(models) == 1:
                model = models.pop()
                pods = kr.list_pods(k, ns, f"{MODEL_LABEL}={model}")

        endpoints: dict[str, EndpointConditions] = {}
        for sl in kr.list_endpoint_slices(k, ns, svc_name):
            for ep in sl.get("endpoints") or []:
                ref = ep.get("targetRef") or {}
                if ref.get("kind") == "Pod" and ref.get("name"):
                    cond = ep.get("conditions") or {}
                    endpoints[ref["name"]] = EndpointConditions(
                        pod=ref["name"],
                        ready=cond.get("ready"),
                        serving=cond.get("serving"),
                        terminating=cond.get("terminating"),
                    )

        router_state = None
        routed: list[str] = []
        admitted: int | None = None
        counted_at: float | None = None
        # The routing set and the policy together or neither: a policy read without its routing set (a
        # busy Envoy's /clusters timing out) would call every group "not routed", and the protect step
        # would see no survivor at all (two peak demos on one 2-core machine once planned on 0
        # survivors and refused 80 % of arrivals). Without them, the router label decides.
        try:
            policy = self.deps.gateway.policy(req.pool)
            routed = [e.pod for e in self.deps.gateway.routing_set(req.pool).endpoints]
            router_state = RouterState(pool=req.pool.key, version=0, **policy.model_dump())
        except httpx.HTTPError as exc:
            warnings.append(f"gateway unreachable: {exc}")
        try:
            admitted = self.deps.gateway.admitted_requests(req.pool)
            counted_at = time.time()
        except httpx.HTTPError as exc:
            warnings.append(f"gateway's counters unreadable: {exc}")

        # Nodes, with GPUs allocated by every non-terminated pod on them (all namespaces).
        # From the worker's pod watch (kube.allocation); a list of every pod only while it is not following.
        allocated: dict[str, int] = {}
        if not req.light:
            watched = self.deps.allocation.allocated()
            allocated = watched if watched is not None else allocation_of(kr.list_all_pods(k))
        listed = self.deps.nodes.items()  # the worker's node watch; a list only while it is not following
        nodes = [node_info(n, allocated.get(kr.name(n), 0)) for n in _or_list(listed, kr.list_nodes, k)]

        workloads, rs_owner, targets = self._workloads(ns)

        # Pods -> observations and replica groups.
        pod_obs: dict[str, PodObservation] = {}
        pod_nodes: dict[str, str] = {}
        pod_uids: dict[str, str] = {}
        members: dict[str, list[kr.Obj]] = {}
        for p in pods:
            pname = kr.name(p)
            meta, status = p["metadata"], p.get("status", {})
            waiting, terminated, restarts = _container_reasons(p)
            node = p.get("spec", {}).get("nodeName")
            if node:
                pod_nodes[pname] = node
            pod_uids[pname] = str(meta.get("uid", ""))
            pod_obs[pname] = PodObservation(
                pod=pname,
                phase=status.get("phase", "Unknown"),
                node=node,
                deleting=bool(meta.get("deletionTimestamp")),
                pod_ready=kr.condition(p, "Ready") == "True",
                containers_ready=kr.condition(p, "ContainersReady") != "False",
                waiting_reason=waiting,
                terminated_reason=terminated,
                restart_count=restarts,
                status_reason=status.get("reason"),
                endpoint=endpoints.get(pname),
            )
            lbl = kr.labels(p)
            gid = (
                f"{lbl[LWS_NAME_LABEL]}-{lbl.get(LWS_GROUP_INDEX_LABEL, '0')}"
                if LWS_NAME_LABEL in lbl
                else pname
            )
            members.setdefault(gid, []).append(p)

        groups: list[ReplicaGroup] = []
        leaders: dict[str, kr.Obj] = {}
        for gid, gpods in members.items():
            gpods.sort(key=lambda p: int(kr.labels(p).get(LWS_WORKER_INDEX_LABEL, "0")))
            leader = gpods[0]
            leaders[gid] = leader
            lbl = kr.labels(leader)
            names = tuple(kr.name(p) for p in gpods)
            if LWS_NAME_LABEL in lbl:
                kind, wname = WorkloadKind.LEADER_WORKER_SET, lbl[LWS_NAME_LABEL]
            else:
                kind, wname = WorkloadKind.DEPLOYMENT, self._deployment_of(leader, rs_owner)
            groups.append(
                ReplicaGroup(
                    id=gid,
                    model=lbl.get(MODEL_LABEL, model or ""),
                    revision=lbl.get(REVISION_LABEL, ""),
                    # A pod carrying the router-only label serves, whatever its role label says
                    # (a promoted spare keeps role=spare: its controller may select on that label).
                    role=GroupRole.SPARE
                    if lbl.get(ROLE_LABEL) == ROLE_SPARE
                    and lbl.get(router_label) != self.deps.settings.router_label_value
                    else GroupRole.SERVING,
                    pods=names,
                    nodes=tuple(sorted({pod_nodes[n] for n in names if n in pod_nodes})),
                    leader_pod=kr.name(leader),
                    gpus_per_pod=gpus_of(leader),
                    engine_up=all(pod_obs[n].containers_ready and not pod_obs[n].deleting for n in names),
                    ready=all(pod_obs[n].pod_ready and not pod_obs[n].deleting for n in names),
                    routed=(kr.name(leader) in routed)
                    if router_state is not None
                    else kr.labels(leader).get(router_label) == self.deps.settings.router_label_value,
                    workload_kind=kind,
                    workload_name=wname,
                )
            )

        # Engines: health + one scrape per leader; two scrapes for groups under suspicion. Read several
        # at once, within a share of this attempt's time: an engine too slow to answer is unread, named
        # in the look, and the look still returns (activities.engine_reads).
        engines: dict[str, EngineSnapshot] = {}
        unread: dict[str, str] = {}
        first: dict[str, EngineSnapshot] = {}
        focus = set(req.focus_pods)
        probed = [
            g
            for g in groups
            if not req.light
            or focus & set(g.pods)
            or set(req.focus_nodes) & set(g.nodes)
            or g.id in req.check_progress_of
        ]
        deadline = max(deadline, time.monotonic() + 1.0)
        concurrency = self.deps.settings.engine_reads_per_look
        reads = read_all(
            lambda gid: self._read_engine(ns, leaders[gid]),
            [g.id for g in probed],
            deadline=deadline,
            concurrency=concurrency,
        )
        for g in probed:
            read = reads[g.id]
            pod_obs[g.leader_pod] = pod_obs[g.leader_pod].model_copy(update={"engine_health": read.health})
            if read.unread is not None:
                # Named by group id; a group whose id is not its leader pod's name names the pod too.
                unread[g.id] = (
                    read.unread if g.id == g.leader_pod else f"leader {g.leader_pod}: {read.unread}"
                )
            if read.snapshot is not None:
                engines[g.id] = read.snapshot
                if g.id in req.check_progress_of:
                    first[g.id] = read.snapshot
        if first:
            time.sleep(PROGRESS_PROBE_GAP_S)
            again = read_all(
                lambda gid: self._read_engine(ns, leaders[gid]),
                list(first),
                deadline=max(deadline, time.monotonic() + 1.0),
                concurrency=concurrency,
            )
            for gid, before in first.items():
                after = again[gid].snapshot
                if after is None:
                    continue
                stuck = (
                    before.in_flight > 0 and after.generation_tokens_total <= before.generation_tokens_total
                )
                leader_pod = kr.name(leaders[gid])
                pod_obs[leader_pod] = pod_obs[leader_pod].model_copy(update={"engine_progressing": not stuck})
                engines[gid] = after

        pending: dict[str, str] = {}
        pending_names = {kr.name(p) for p in pods if p.get("status", {}).get("phase") == "Pending"}
        if pending_names and not req.light:
            for ev in sorted(kr.list_events(k, ns), key=lambda e: str(e.get("lastTimestamp") or "")):
                obj = ev.get("involvedObject") or {}
                if ev.get("reason") == "FailedScheduling" and obj.get("name") in pending_names:
                    pending[obj["name"]] = ev.get("message", "")
            for n in pending_names:
                pending.setdefault(n, "Pending (no scheduling event yet)")

        target_revision, rollout = targets.get("revision"), bool(targets.get("rollout"))
        snapshot = PoolSnapshot(
            pool=req.pool,
            observed_at=time.time(),
            groups=tuple(groups),
            nodes=tuple(nodes),
            target_revision=target_revision,
            rollout_in_progress=rollout
            or any(
                g.revision != target_revision
                for g in groups
                if target_revision and g.role is GroupRole.SERVING
            ),
        )
        return PoolObservation(
            snapshot=snapshot,
            pods=pod_obs,
            pod_uids=pod_uids,
            pod_nodes=pod_nodes,
            router_label=router_label,
            router_label_value=self.deps.settings.router_label_value,
            service_selector=selector,
            publish_not_ready=pnra,
            workloads=workloads,
            routed_pods=routed,
            router=router_state,
            gateway_admitted_total=admitted,
            gateway_counted_at=counted_at,
            engines=engines,
            pending_pods=pending,
            warnings=warnings,
            unread_engines=unread,
        )

    def _workloads(self, ns: str) -> tuple[list[WorkloadSelector], dict[str, str], dict[str, Any]]:
        """Every controller's selector in the namespace (any of them may select on the router label)."""
        k = self.deps.kube
        out: list[WorkloadSelector] = []
        rs_owner: dict[str, str] = {}
        targets: dict[str, Any] = {}

        def selector_of(obj: kr.Obj) -> tuple[dict[str, str], tuple[str, ...]]:
            sel = obj.get("spec", {}).get("selector") or {}
            exprs = tuple(e.get("key", "") for e in sel.get("matchExpressions") or [])
            return dict(sel.get("matchLabels") or {}), exprs

        # From the worker's watches (kube.cache); lists only while a watch is not following.
        for d in _or_list(self.deps.deployments(ns).items(ns), kr.list_deployments, k, ns):
            ml, ex = selector_of(d)
            replicas = d.get("spec", {}).get("replicas")
            out.append(
                WorkloadSelector(
                    kind="Deployment",
                    name=kr.name(d),
                    match_labels=ml,
                    match_expression_keys=ex,
                    replicas=replicas,
                )
            )
            tmpl = d.get("spec", {}).get("template", {}).get("metadata", {}).get("labels") or {}
            if tmpl.get(ROLE_LABEL, "serving") != ROLE_SPARE and REVISION_LABEL in tmpl:
                targets["revision"] = tmpl[REVISION_LABEL]
                st = d.get("status", {})
                if (st.get("updatedReplicas") or 0) < (replicas or 0):
                    targets["rollout"] = True
        for rs in _or_list(self.deps.replica_sets(ns).items(ns), kr.list_replica_sets, k, ns):
            ml, ex = selector_of(rs)
            out.append(
                WorkloadSelector(
                    kind="ReplicaSet",
                    name=kr.name(rs),
                    match_labels=ml,
                    match_expression_keys=ex,
                    replicas=rs.get("spec", {}).get("replicas"),
                )
            )
            for ref in rs["metadata"].get("ownerReferences") or []:
                if ref.get("kind") == "Deployment":
                    rs_owner[kr.name(rs)] = ref["name"]
        for sts in kr.list_stateful_sets(k, ns):
            ml, ex = selector_of(sts)
            out.append(
                WorkloadSelector(
                    kind="StatefulSet",
                    name=kr.name(sts),
                    match_labels=ml,
                    match_expression_keys=ex,
                    replicas=sts.get("spec", {}).get("replicas"),
                )
            )
        for lws in kr.list_leader_worker_sets(k, ns):
            # LWS selects its pods by leaderworkerset.sigs.k8s.io/name (and group labels).
            out.append(
                WorkloadSelector(
                    kind="LeaderWorkerSet",
                    name=kr.name(lws),
                    match_labels={LWS_NAME_LABEL: kr.name(lws)},
                    replicas=lws.get("spec", {}).get("replicas"),
                )
            )
            tmpl = (
                lws.get("spec", {})
                .get("leaderWorkerTemplate", {})
                .get("workerTemplate", {})
                .get("metadata", {})
                .get("labels")
                or {}
            )
            if REVISION_LABEL in tmpl and tmpl.get(ROLE_LABEL, "serving") != ROLE_SPARE:
                targets["revision"] = tmpl[REVISION_LABEL]
        return out, rs_owner, targets

    @staticmethod
    def _deployment_of(pod: kr.Obj, rs_owner: dict[str, str]) -> str:
        for ref in pod["metadata"].get("ownerReferences") or []:
            if ref.get("kind") == "ReplicaSet":
                return rs_owner.get(ref["name"], ref["name"])
        return "(orphan)"

    def _urls(self, ns: str, pod: kr.Obj) -> tuple[str, str]:
        s = self.deps.settings
        values = {"pod_ip": pod.get("status", {}).get("podIP") or "", "namespace": ns, "pod": kr.name(pod)}
        return s.metrics_url_template.format(**values), s.health_url_template.format(**values)

    def _read_engine(self, ns: str, pod: kr.Obj, *, metrics: bool = True) -> EngineRead:
        if not pod.get("status", {}).get("podIP"):
            return EngineRead(EngineHealth.UNREACHABLE)
        metrics_url, health_url = self._urls(ns, pod)
        return read_engine(self.deps.http, health_url, metrics_url if metrics else None)

    @activity.defn(name="scrape_engines")
    def scrape_engines(self, req: ScrapeRequest) -> dict[str, EngineSnapshot]:
        """One metrics scrape per named pod (group leaders), several at once within the attempt's time;
        those that did not answer (unreachable or too slow) are left out."""
        k, ns = self.deps.kube, req.pool.namespace
        found = {name: pod for name in req.pods if (pod := kr.get_pod(k, ns, name)) is not None}
        reads = read_all(
            lambda name: self._read_engine(ns, found[name]),
            list(found),
            deadline=look_deadline(),
            concurrency=self.deps.settings.engine_reads_per_look,
        )
        return {name: read.snapshot for name, read in reads.items() if read.snapshot is not None}

    # ------------------------------------------------------------ nodes

    @activity.defn(name="read_node")
    def read_node(self, node: str) -> NodeRead:
        """One node as the API server has it now (a GET, not the watch: the fence reads right after the
        fast path saw the node change, and must not act on a watch that has not caught up)."""
        try:
            obj = kr.get_node(self.deps.kube, node)
        except ApiException as exc:
            if exc.status == 404:
                return NodeRead(node=None)
            raise
        return NodeRead(node=node_info(obj, 0))

    @activity.defn(name="probe_node_engines")
    def probe_node_engines(self, node: str) -> NodeEngines:
        """Probe the engines on ``node`` directly (a suspect's confirmation, ``engine_reads_per_look`` at a
        time): the removal breaker tells dead capacity from capacity that still serves by this."""
        k = self.deps.kube
        pods = [
            p
            for p in kr.list_all_pods(k, node)
            if not pod_terminated(p)
            and gpus_held(p) > 0
            and QUALIFICATION_LABEL not in kr.labels(p)
            and p.get("status", {}).get("podIP")
        ]
        # A worker rank of a multi-node group runs no API server: it serves while its group's leader
        # answers, so the leader (wherever it runs) is read for it. Reading the rank itself would call
        # every node that holds only worker ranks dead.
        by_key: dict[str, kr.Obj] = {}
        for p in pods:
            by_key[f"{p['metadata']['namespace']}/{kr.name(p)}"] = self._engine_of(k, p)
        reads = read_all(
            lambda key: self._read_engine(by_key[key]["metadata"]["namespace"], by_key[key], metrics=False),
            list(by_key),
            deadline=look_deadline(),
            concurrency=self.deps.settings.engine_reads_per_look,
        )
        gpu_nodes = _or_list(self.deps.nodes.items(), kr.list_nodes, k)
        return NodeEngines(
            node=node,
            engines=len(by_key),
            answering=sum(1 for r in reads.values() if r.health is EngineHealth.OK),
            unread=sum(1 for r in reads.values() if r.health is EngineHealth.UNKNOWN),
            fleet_gpu_nodes=sum(
                1 for n in gpu_nodes if int((n.get("status", {}).get("capacity") or {}).get(GPU_RESOURCE, 0))
            ),
        )

    @staticmethod
    def _engine_of(k: Any, pod: kr.Obj) -> kr.Obj:
        """The pod whose engine answers for ``pod``: itself, or a worker rank's group leader (worker index
        0 with the same group key; the rank itself when its leader is gone, and so unread as dead)."""
        labels = kr.labels(pod)
        if labels.get(LWS_WORKER_INDEX_LABEL, "0") == "0" or LWS_GROUP_KEY_LABEL not in labels:
            return pod
        ns = pod["metadata"]["namespace"]
        selector = f"{LWS_GROUP_KEY_LABEL}={labels[LWS_GROUP_KEY_LABEL]},{LWS_WORKER_INDEX_LABEL}=0"
        leaders = [p for p in kr.list_pods(k, ns, selector) if not pod_terminated(p)]
        return leaders[0] if leaders else pod

    @activity.defn(name="read_node_health")
    def read_node_health(self, node: str) -> NodeHealth:
        """Node conditions, DCGM telemetry and the reasons its pods ended, for triage."""
        k = self.deps.kube
        try:
            obj = kr.get_node(k, node)
        except Exception as exc:
            return NodeHealth(node=None, telemetry_error=f"node object unreadable: {exc}")
        conditions = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions") or []}
        reasons: dict[str, str] = {}
        holders: list[GpuHolder] = []
        settings = self.deps.settings
        for p in kr.list_all_pods(k, node):
            if p.get("spec", {}).get("nodeName") == node:
                lbl = kr.labels(p)
                if not pod_terminated(p) and QUALIFICATION_LABEL not in lbl and gpus_held(p) > 0:
                    holders.append(
                        GpuHolder(
                            namespace=p["metadata"]["namespace"],
                            pod=kr.name(p),
                            gpus=gpus_held(p),
                            devices=device_health(p),
                            spare=lbl.get(ROLE_LABEL) == ROLE_SPARE
                            and lbl.get(settings.router_label) != settings.router_label_value,
                        )
                    )
                waiting, terminated, _ = _container_reasons(p)
                reason = terminated or waiting or p.get("status", {}).get("reason")
                if reason:
                    reasons[kr.name(p)] = reason
        telemetry = None
        error = None
        try:
            r = self.deps.http.get(self.deps.settings.node_telemetry_url_template.format(node=node))
            r.raise_for_status()
            telemetry = parse_dcgm_metrics(node, r.text)
        except (httpx.HTTPError, ValueError) as exc:
            error = f"DCGM exporter on {node} unreachable: {exc}"
        return NodeHealth(
            node=node_info(obj, 0),
            conditions=conditions,
            telemetry=telemetry,
            telemetry_error=error,
            pod_reasons=reasons,
            annotations=dict(obj["metadata"].get("annotations") or {}),
            machine=machine_id(obj.get("spec", {}).get("providerID"), obj["metadata"]["uid"]),
            uid=obj["metadata"]["uid"],
            gpu_capacity=int((obj.get("status", {}).get("capacity") or {}).get(GPU_RESOURCE, 0)),
            gpu_allocatable=int((obj.get("status", {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)),
            gpus_held=sum(h.gpus for h in holders),
            gpu_holders=holders,
            dra_devices=[dra_device(d) for d in kr.node_devices(k, node, GPU_DRIVER)],
        )

    # ------------------------------------------------------------ router

    @activity.defn(name="recovery_slots")
    async def recovery_slots(self, recovery_id: str) -> Slots:
        """The recoveries rebuilding capacity now, fleet-wide, and the cap (``fleet.slots.rebuild_slot``).

        Temporal's own record: running ``ReplicaLossRecovery`` workflows of this deployment (its task
        queue) whose ``FleetmendPhase`` is one of ``REBUILD_PHASES``, the asking one left out.
        Visibility trails a phase change by a moment, so the bound holds to within the recoveries that
        entered those phases in that moment.
        """
        phases = ", ".join(f"'{p.value}'" for p in REBUILD_PHASES)
        query = (
            f"WorkflowType = 'ReplicaLossRecovery' AND ExecutionStatus = 'Running' AND "
            f"TaskQueue = '{activity.info().task_queue}' AND FleetmendPhase IN ({phases})"
        )
        running = [w.id async for w in activity.client().list_workflows(query) if w.id != recovery_id]
        return Slots(running=running, cap=self.deps.settings.recovery_concurrency)

    @activity.defn(name="routed_pods")
    def routed_pods(self, pool: PoolRef) -> list[str]:
        return [e.pod for e in self.deps.gateway.routing_set(pool).endpoints]

    @activity.defn(name="await_derouted")
    def await_derouted(self, req: DerouteWait) -> DerouteSeen:
        """Poll the gateway until none of ``pods`` is routable; report when (unix s) that was first seen.

        Polls inside the activity (every 50 ms) rather than with workflow timers,
        whose granularity is too coarse to measure a sub-second deroute.
        """
        deadline = time.monotonic() + req.timeout_s
        while True:
            routed = {e.pod for e in self.deps.gateway.routing_set(req.pool).endpoints}
            still = sorted(routed & set(req.pods))
            if not still:
                return DerouteSeen(at=time.time(), still_routed=[])
            if time.monotonic() > deadline:
                return DerouteSeen(at=time.time(), still_routed=still)
            activity.heartbeat(still)
            time.sleep(0.05)

    @activity.defn(name="read_journal")
    def read_journal(self, req: JournalRequest) -> list[JournalEntry]:
        """The gateway's journal of requests the named replicas served (the in-flight record)."""
        out: list[JournalEntry] = []
        for replica in req.replicas:
            out.extend(self.deps.gateway.request_outcomes(req.pool, replica=replica, since=req.since))
        return out
