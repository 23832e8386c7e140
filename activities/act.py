"""Mutating activities: every one goes through the effect ledger.

Each activity names its step; the operation id is ``fleetmend:<scope>/step/target``
(``activities.deps.operation_id``; the scope is the procedure's workflow id and first
run id), so a retried activity, a restarted worker or a replayed workflow asks the
ledger about the *same* operation and the world sees the action once, while the
pool's next incident never meets this one's rows. In dry-run the ledger records the effect as ``planned``
and nothing is performed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field
from temporalio import activity

from activities.deps import ActivityDeps, effect_context, operation_id
from activities.world_effects import (
    DeletePod,
    NodePatch,
    NodeTaintAdd,
    PodMetadataPatch,
    ScaleWorkload,
    SetAdmission,
    SetRetryPolicy,
    SetWeights,
)
from fleet.gateway import Admission, RetryPolicy
from fleet.incident import PoolRef
from ledger.effect import Effect
from ledger.errors import EffectFailed
from ledger.models import EffectState


class EffectReport(BaseModel):
    """What the ledger holds for one operation after this call."""

    op_id: str
    kind: str
    target: str
    state: str
    replayed: bool = False
    result: dict[str, Any] | None = None
    error: str | None = None

    @property
    def applied(self) -> bool:
        return self.state == EffectState.APPLIED

    @property
    def planned(self) -> bool:
        return self.state == EffectState.PLANNED


class EffectRequest(BaseModel):
    step: str = Field(min_length=1, max_length=80)
    dry_run: bool = False
    fingerprints: list[str] = Field(default_factory=list)
    scope: str = Field(
        "",
        max_length=300,
        description="Operation-id scope: <workflow id>@<first run id> (set by the toolkit)",
    )


class PodLabelsChange(EffectRequest):
    namespace: str
    pod: str
    labels: dict[str, str | None] = Field(default_factory=dict)
    annotations: dict[str, str | None] = Field(default_factory=dict)


class ScaleChange(EffectRequest):
    namespace: str
    kind: str
    name: str
    replicas: int = Field(ge=0)


class NodeCordon(EffectRequest):
    """Cordon a node, optionally labelling/annotating it in the same patch (quarantine's first half)."""

    node: str
    labels: dict[str, str | None] = Field(default_factory=dict)
    annotations: dict[str, str | None] = Field(default_factory=dict)
    machine: str | None = Field(None, description="The machine a quarantine is keyed on (ledger history)")


class NodeTaint(EffectRequest):
    node: str
    taint_key: str
    taint_value: str


class PodDeletion(EffectRequest):
    namespace: str
    pod: str
    grace_period_s: int = Field(0, ge=0)


class AdmissionChangeRequest(EffectRequest):
    pool: PoolRef
    admission: Admission


class RetryPolicyChangeRequest(EffectRequest):
    pool: PoolRef
    retry: RetryPolicy


class WeightsChangeRequest(EffectRequest):
    pool: PoolRef
    weights: dict[str, float]


class NotifyRequest(EffectRequest):
    text: str = Field(min_length=1, max_length=4000)
    topic: str = Field(
        "incident", max_length=200, description="Part of the op id: one message per topic per step"
    )


def perform_effect(
    deps: ActivityDeps, req: EffectRequest, kind: str, target: str, params: dict[str, Any], effect: Effect
) -> EffectReport:
    """Perform one mutation through the ledger, op id ``fleetmend:<scope>/step/target``; report what it holds."""
    try:
        out = deps.ledger.perform(
            operation_id(req.scope, req.step, target),
            kind,
            target,
            params,
            effect,
            context=effect_context(req.step, req.fingerprints),
            dry_run=req.dry_run,
        )
    except EffectFailed as exc:
        # Recorded as failed; the workflow decides what a refusal means for the procedure.
        o = exc.outcome
        return EffectReport(op_id=o.op_id, kind=o.kind, target=o.target, state=o.state, error=o.error)
    return EffectReport(
        op_id=out.op_id,
        kind=out.kind,
        target=out.target,
        state=out.state,
        replayed=out.replayed,
        result=out.result,
        error=out.error,
    )


class ActActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    def _perform(
        self, req: EffectRequest, kind: str, target: str, params: dict[str, Any], effect: Effect
    ) -> EffectReport:
        return perform_effect(self.deps, req, kind, target, params, effect)

    @activity.defn(name="patch_pod_metadata")
    def patch_pod_metadata(self, req: PodLabelsChange) -> EffectReport:
        """Set or remove pod labels/annotations (router-only label, deletion cost, role)."""
        effect = PodMetadataPatch(self.deps.kube, req.namespace, req.pod, req.labels, req.annotations)
        params = {"labels": req.labels, "annotations": req.annotations}
        return self._perform(req, "k8s.pod.patch-metadata", f"pod/{req.namespace}/{req.pod}", params, effect)

    @activity.defn(name="scale_workload")
    def scale_workload(self, req: ScaleChange) -> EffectReport:
        effect = ScaleWorkload(self.deps.kube, req.kind, req.namespace, req.name, req.replicas)
        return self._perform(
            req,
            "k8s.workload.scale",
            f"{req.kind}/{req.namespace}/{req.name}",
            {"replicas": req.replicas},
            effect,
        )

    @activity.defn(name="cordon_node")
    def cordon_node(self, req: NodeCordon) -> EffectReport:
        """Mark a node unschedulable (with the quarantine label/annotations when triage sends them)."""
        effect = NodePatch(
            self.deps.kube, req.node, unschedulable=True, labels=req.labels, annotations=req.annotations
        )
        params: dict[str, Any] = {"unschedulable": True}
        if req.labels or req.annotations:
            params.update(labels=req.labels, annotations=req.annotations)
        if req.machine:
            params["machine"] = req.machine
        return self._perform(req, "k8s.node.cordon", f"node/{req.node}", params, effect)

    @activity.defn(name="taint_node")
    def taint_node(self, req: NodeTaint) -> EffectReport:
        """Add fleetmend's NoSchedule quarantine taint (quarantine's second half)."""
        effect = NodeTaintAdd(self.deps.kube, req.node, req.taint_key, req.taint_value)
        params = {"key": req.taint_key, "value": req.taint_value, "effect": "NoSchedule"}
        return self._perform(req, "k8s.node.taint", f"node/{req.node}", params, effect)

    @activity.defn(name="delete_pod")
    def delete_pod(self, req: PodDeletion) -> EffectReport:
        effect = DeletePod(self.deps.kube, req.namespace, req.pod, req.grace_period_s)
        return self._perform(
            req,
            "k8s.pod.delete",
            f"pod/{req.namespace}/{req.pod}",
            {"grace_period_s": req.grace_period_s},
            effect,
        )

    @activity.defn(name="set_admission")
    def set_admission(self, req: AdmissionChangeRequest) -> EffectReport:
        effect = SetAdmission(self.deps.gateway, req.pool, req.admission)
        return self._perform(
            req, "router.admission", f"router/{req.pool.key}", req.admission.model_dump(mode="json"), effect
        )

    @activity.defn(name="set_retry_policy")
    def set_retry_policy(self, req: RetryPolicyChangeRequest) -> EffectReport:
        effect = SetRetryPolicy(self.deps.gateway, req.pool, req.retry)
        return self._perform(
            req, "router.retry-policy", f"router/{req.pool.key}", req.retry.model_dump(mode="json"), effect
        )

    @activity.defn(name="set_weights")
    def set_weights(self, req: WeightsChangeRequest) -> EffectReport:
        effect = SetWeights(self.deps.gateway, req.pool, req.weights)
        return self._perform(
            req, "router.weights", f"router/{req.pool.key}", {"weights": req.weights}, effect
        )

    @activity.defn(name="notify")
    def notify(self, req: NotifyRequest) -> EffectReport:
        """Post to the incident channel (Slack-compatible webhook) through the ledger."""
        from activities.effects import notify_effect  # the inference-effect registry owns the notifier

        url = self.deps.settings.notifier_url
        if not url:
            return EffectReport(
                op_id=operation_id(req.scope, req.step, req.topic),
                kind="notify.post",
                target="incident-channel",
                state="skipped",
                error="no notifier configured (FLEETMEND_NOTIFIER_URL); message: " + req.text,
            )
        effect = notify_effect(self.deps.http, url, req.text)
        return self._perform(req, "notify.post", f"channel/{req.topic}", {"text": req.text}, effect)
