"""Qualification Jobs and the machine's remediation history (step 8's way back).

* ``create_qualification_job`` / ``delete_qualification_job`` - ledger effects: ``POST`` /
  ``DELETE`` of a ``batch/v1`` Job in the configured namespace. The Job's name derives from
  the operation id, so a probe after an unknown outcome reads the Job by name (and checks the
  operation-id annotation) instead of creating a second one. A 403/422 is a refusal: recorded
  ``failed``, and the procedure asks an operator.
* ``read_qualification_job`` - the Job, its pod, the pod's log (``pods/log``: the JSON report
  ``dcgmi diag -j`` prints) and the node's machine now, judged by ``fleet.qualification``.
* ``machine_history`` - fleetmend's quarantines of one machine from the ledger (the cordon
  effects carry the machine id), for the loop cap and the operator's view.
* ``qualification_slots`` - the qualification Jobs running now, fleet-wide (a ``list`` of Jobs by
  their label in the qualification namespace), and the configured cap: the fleet-wide bound on
  concurrent qualifications (``fleet.qualification.qualification_slot``).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from sqlalchemy import select
from temporalio import activity

from activities import kube_reads as kr
from activities.act import EffectReport, EffectRequest, perform_effect
from activities.deps import ActivityDeps, operation_id
from activities.world_effects import api_server_world, permanent_if_client_error, request_digest
from fleet.qualification import (
    OPERATION_ANNOTATION,
    QUALIFICATION_LABEL,
    JobView,
    QualificationSlots,
    RemediationRecord,
    Verdict,
    job_finished,
    job_manifest,
    job_name,
    judge_qualification,
    machine_id,
)
from fleet.vocabulary import QUARANTINE_TAINT_KEY
from kube.client import KubeApis
from ledger.audit import EFFECTS
from ledger.effect import ActionSignature, Attempt, Effect
from ledger.errors import PermanentEffectError

QUARANTINE_KIND = "k8s.node.cordon"
RELEASE_KIND = "k8s.node.uncordon"
# One GPU's quarantine counts toward its machine's remediation loop cap like a node's (target
# node/<node>/gpu/<uuid>; its release closes that GPU's record only).
DEVICE_QUARANTINE_KIND = "k8s.node.quarantine-device"
DEVICE_RELEASE_KIND = "k8s.node.release-device"
_HISTORY_KINDS = (QUARANTINE_KIND, RELEASE_KIND, DEVICE_QUARANTINE_KIND, DEVICE_RELEASE_KIND)


class QualificationJobRequest(EffectRequest):
    node: str
    machine: str = Field(min_length=1)
    gpus: int = Field(ge=1, description="The node's GPU capacity: the diagnostic takes all of them")


class QualificationJobRef(EffectRequest):
    name: str
    node: str


class QualificationRead(BaseModel):
    name: str
    node: str
    machine: str


class QualificationReading(BaseModel):
    view: JobView
    verdict: Verdict


class MachineQuery(BaseModel):
    machine: str


class NodeReturn(EffectRequest):
    node: str
    machine: str
    uid: str = Field(description="The node object the quarantine was applied to (a re-created one is not it)")
    labels: dict[str, str | None] = Field(default_factory=dict)


class CreateJob(Effect):
    def __init__(self, k: KubeApis, namespace: str, body: dict[str, Any], op_id: str) -> None:
        self.k, self.ns, self.body, self.op_id = k, namespace, body, op_id
        self.name = body["metadata"]["name"]

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.batch.create_namespaced_job(self.ns, self.body, _preload_content=False)  # type: ignore[arg-type]
        except ApiException as exc:
            if exc.status == 409 and self.probe(attempt) is not None:
                return {"job": f"{self.ns}/{self.name}", "found_by_probe": True}
            permanent_if_client_error(exc, f"create qualification Job {self.ns}/{self.name}")
            raise
        return {"job": f"{self.ns}/{self.name}"}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        try:
            resp: Any = self.k.batch.read_namespaced_job(self.name, self.ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        job = json.loads(resp.data)
        if (job["metadata"].get("annotations") or {}).get(OPERATION_ANNOTATION) != self.op_id:
            raise PermanentEffectError(
                f"a Job named {self.ns}/{self.name} exists but was not created for {self.op_id}: "
                "delete it or rename it, then retry"
            )
        return {"job": f"{self.ns}/{self.name}", "found_by_probe": True}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="POST",
            path=f"/apis/batch/v1/namespaces/{self.ns}/jobs",
            body_digest=request_digest(self.body),
        )


class DeleteJob(Effect):
    """Delete the Job and (Background propagation) its pod: the GPUs go back with the node."""

    def __init__(self, k: KubeApis, namespace: str, name: str) -> None:
        self.k, self.ns, self.name = k, namespace, name
        self.body = {"propagationPolicy": "Background"}

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.batch.delete_namespaced_job(
                self.name, self.ns, propagation_policy="Background", _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                return {"deleted": f"{self.ns}/{self.name}", "already_gone": True}
            permanent_if_client_error(exc, f"delete qualification Job {self.ns}/{self.name}")
            raise
        return {"deleted": f"{self.ns}/{self.name}"}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        try:
            self.k.batch.read_namespaced_job(self.name, self.ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return {"deleted": f"{self.ns}/{self.name}", "found_by_probe": True}
            raise
        return None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="DELETE",
            path=f"/apis/batch/v1/namespaces/{self.ns}/jobs/{self.name}",
            body_digest="*",
        )


class ReturnNode(Effect):
    """Uncordon, drop fleetmend's quarantine taint and labels: one patch of the node object quarantined.

    Taints have no merge key (a strategic-merge patch replaces the list), so the list is read at
    apply time without fleetmend's taint, and the patch carries the node's uid and resourceVersion:
    a node re-created meanwhile, or changed under us, answers 409 instead of being released.
    """

    def __init__(
        self, k: KubeApis, node: str, uid: str, taint_key: str, labels: dict[str, str | None]
    ) -> None:
        self.k, self.node, self.uid, self.taint_key, self.labels = k, node, uid, taint_key, labels

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        obj = kr.get_node(self.k, self.node)
        if obj["metadata"]["uid"] != self.uid:
            raise PermanentEffectError(
                f"node {self.node} was re-created (uid {obj['metadata']['uid']}, quarantined {self.uid}): "
                "not releasing a node object that was never qualified"
            )
        taints = [t for t in obj.get("spec", {}).get("taints") or [] if t.get("key") != self.taint_key]
        body: dict[str, Any] = {
            "metadata": {"uid": self.uid, "resourceVersion": obj["metadata"]["resourceVersion"]},
            "spec": {"unschedulable": False, "taints": taints},
        }
        if self.labels:
            body["metadata"]["labels"] = self.labels
        try:
            self.k.core.patch_node(self.node, body, _preload_content=False)
        except ApiException as exc:
            permanent_if_client_error(exc, f"return node {self.node}")
            raise
        return {"node": self.node, "taints": taints}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        obj = kr.get_node(self.k, self.node)
        spec = obj.get("spec", {})
        if spec.get("unschedulable") or any(t.get("key") == self.taint_key for t in spec.get("taints") or []):
            return None
        return {"node": self.node, "found_by_probe": True}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k), verb="PATCH", path=f"/api/v1/nodes/{self.node}", body_digest="*"
        )


def node_machine(node: kr.Obj) -> str:
    return machine_id(node.get("spec", {}).get("providerID"), node["metadata"]["uid"])


class QualificationActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn(name="create_qualification_job")
    def create_qualification_job(self, req: QualificationJobRequest) -> EffectReport:
        """Create the DCGM qualification Job on ``req.node`` (result: the Job's name)."""
        spec = self.deps.settings.qualification
        target = f"job/{spec.namespace}/qualify-{req.node}"
        op_id = operation_id(req.scope, req.step, target)
        name = job_name(req.node, op_id)
        body = job_manifest(spec, node=req.node, machine=req.machine, gpus=req.gpus, name=name, op_id=op_id)
        effect = CreateJob(self.deps.kube, spec.namespace, body, op_id)
        params = {"job": name, "node": req.node, "machine": req.machine, "gpus": req.gpus, "image": spec.image,
                  "command": spec.container_command(), "deadline_s": spec.deadline_s}  # fmt: skip
        report = perform_effect(self.deps, req, "k8s.job.create", target, params, effect)
        return report.model_copy(update={"result": {**(report.result or {}), "name": name}})

    @activity.defn(name="delete_qualification_job")
    def delete_qualification_job(self, req: QualificationJobRef) -> EffectReport:
        spec = self.deps.settings.qualification
        effect = DeleteJob(self.deps.kube, spec.namespace, req.name)
        target = f"job/{spec.namespace}/{req.name}"
        return perform_effect(self.deps, req, "k8s.job.delete", target, {"propagation": "Background"}, effect)

    @activity.defn(name="return_node")
    def return_node(self, req: NodeReturn) -> EffectReport:
        """Return a node that passed qualification: uncordon, untaint, unlabel (keyed on its machine)."""
        effect = ReturnNode(self.deps.kube, req.node, req.uid, QUARANTINE_TAINT_KEY, req.labels)
        params = {"unschedulable": False, "untaint": QUARANTINE_TAINT_KEY, "labels": req.labels,
                  "machine": req.machine, "uid": req.uid}  # fmt: skip
        return perform_effect(self.deps, req, RELEASE_KIND, f"node/{req.node}", params, effect)

    @activity.defn(name="qualification_slots")
    def qualification_slots(self, node: str) -> QualificationSlots:
        """The qualification Jobs running now, fleet-wide, and the cap (``node``: who asks, for the record)."""
        spec = self.deps.settings.qualification
        resp: Any = self.deps.kube.batch.list_namespaced_job(
            spec.namespace, label_selector=f"{QUALIFICATION_LABEL}=true", _preload_content=False
        )
        jobs = json.loads(resp.data).get("items") or []
        running = [str(j["metadata"]["name"]) for j in jobs if not job_finished(j)]
        return QualificationSlots(running=running, cap=spec.concurrency)

    @activity.defn(name="read_qualification_job")
    def read_qualification_job(self, req: QualificationRead) -> QualificationReading:
        view = self._view(req)
        return QualificationReading(view=view, verdict=judge_qualification(view, req.node, req.machine))

    def _view(self, req: QualificationRead) -> JobView:
        k = self.deps.kube
        ns = self.deps.settings.qualification.namespace
        try:
            resp: Any = k.batch.read_namespaced_job(req.name, ns, _preload_content=False)
        except ApiException as exc:
            if exc.status == 404:
                return JobView(name=req.name, exists=False)
            raise
        job = json.loads(resp.data)
        conditions = job.get("status", {}).get("conditions") or []
        view = JobView(
            name=req.name,
            conditions={c["type"]: c["status"] for c in conditions},
            condition_reasons={c["type"]: c.get("reason", "") for c in conditions},
        )
        uid = job["metadata"]["uid"]
        pods = kr.list_pods(k, ns, f"batch.kubernetes.io/controller-uid={uid}")
        if not pods:
            return view
        pod = sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp", ""))[-1]
        status = pod.get("status", {})
        update: dict[str, Any] = {"pod": kr.name(pod), "pod_node": pod.get("spec", {}).get("nodeName"),
                                  "pod_phase": status.get("phase")}  # fmt: skip
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term:
                update["exit_code"] = term.get("exitCode")
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                update["unschedulable"] = c.get("message") or c.get("reason")
        if update["pod_phase"] in ("Succeeded", "Failed"):
            try:
                update["log"] = k.core.read_namespaced_pod_log(kr.name(pod), ns, container="dcgm-diag")
            except ApiException as exc:
                update["log_error"] = f"pod log unreadable: {exc.status} {exc.reason}"
        if update["pod_node"]:
            try:
                update["node_machine"] = node_machine(kr.get_node(k, update["pod_node"]))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                update["node_machine"] = "(node deleted)"
        return view.model_copy(update=update)

    @activity.defn(name="machine_history")
    def machine_history(self, req: MachineQuery) -> list[RemediationRecord]:
        """fleetmend's quarantines of this machine (applied cordons carrying its id), oldest first."""
        c = EFFECTS.c
        query = (
            select(c.op_id, c.kind, c.target, c.workflow_id, c.created_at, c.params)
            .where(c.kind.in_(_HISTORY_KINDS), c.state == "applied")
            .where(c.params["machine"].astext == req.machine)
            .order_by(c.created_at)
        )
        with self.deps.ledger.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        out: list[RemediationRecord] = []
        for row in rows:
            node = str(row["target"]).removeprefix("node/")
            if row["kind"] == RELEASE_KIND:
                out = [r.model_copy(update={"released": True}) for r in out]
                continue
            if row["kind"] == DEVICE_RELEASE_KIND:  # one GPU back: its own quarantine only
                out = [r.model_copy(update={"released": True}) if r.node == node else r for r in out]
                continue
            out.append(
                RemediationRecord(
                    op_id=row["op_id"],
                    at=row["created_at"].timestamp(),
                    node=node,
                    workflow_id=row["workflow_id"],
                )
            )
        return out
