"""The readiness gate ``fleetmend.io/serving-ready``: "can this replica take more work?" (DESIGN.md §4).

Two activities write the pod condition the pods' ``readinessGates`` name, each
write through the effect ledger:

* ``set_serving_ready`` - one explicit verdict (a scale-down marks its victims
  not-ready before it drains them);
* ``sync_readiness_gates`` - one sample of a whole pool: health + metrics of
  every replica, the hysteresis policy ``fleet.readiness.next_readiness``, and a
  patch for each replica whose gate disagrees with its verdict. The caller (the
  ``ReadinessKeeper`` workflow) carries the per-pod state from one sample to the
  next, so the hysteresis survives worker restarts.

The condition lives in ``pods/status``; a strategic merge patch merges
conditions by ``type``, so the kubelet's own conditions are untouched. Liveness
is never touched: a saturated replica stays live, it only stops being sent work.
"""

from __future__ import annotations

from typing import Any

import httpx
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, Field
from temporalio import activity

from activities import kube_reads as kr
from activities.act import EffectReport, EffectRequest, perform_effect
from activities.deps import ActivityDeps
from activities.world_effects import api_server_world, permanent_if_client_error, request_digest
from fleet.engine_metrics import parse_engine_metrics
from fleet.incident import PoolRef
from fleet.readiness import EngineSample, ReadinessState, ReadinessThresholds, next_readiness
from fleet.scale_down import DRAINING_ANNOTATION
from fleet.vocabulary import LWS_WORKER_INDEX_LABEL, MODEL_LABEL, SERVING_READY_CONDITION
from kube.client import KubeApis
from ledger.effect import ActionSignature, Attempt, Effect
from ledger.errors import PermanentEffectError

STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"

# Condition reasons (CamelCase, as Kubernetes condition reasons are). The message is fixed per reason so
# the body - and the ledger's action signature - is a pure function of the operation's parameters.
REASON_MESSAGES: dict[str, str] = {
    "HasHeadroom": "fleetmend: KV-cache and queue under their ceilings; accepts more work",
    "Saturated": "fleetmend: KV-cache usage or waiting queue at its ceiling; no new work until it recovers",
    "Recovering": "fleetmend: below the ceiling but not yet calm for long enough (hysteresis)",
    "NotLive": "fleetmend: engine does not answer /health",
    "NotAccepting": "fleetmend: engine is not accepting new requests",
    "NoMetrics": "fleetmend: no engine metrics yet",
    "ScaleDown": "fleetmend: planned scale-down is draining this replica",
}


def reason_code(state: ReadinessState) -> str:
    """The condition reason for a ``next_readiness`` verdict."""
    text = state.reason
    if state.ready:
        return "HasHeadroom"
    if text.startswith("saturated"):
        return "Saturated"
    if "not live" in text:
        return "NotLive"
    if "not accepting" in text:
        return "NotAccepting"
    if "no engine metrics" in text:
        return "NoMetrics"
    return "Recovering"


class PodConditionPatch(Effect):
    """Set one pod condition in ``pods/status`` (strategic merge: conditions merge by ``type``)."""

    def __init__(
        self, k: KubeApis, namespace: str, pod: str, condition: str, ready: bool, reason: str
    ) -> None:
        self.k, self.ns, self.pod, self.condition, self.ready = k, namespace, pod, condition, ready
        message = REASON_MESSAGES.get(reason, f"fleetmend: {reason}")
        self.body = {
            "status": {
                "conditions": [
                    {
                        "type": condition,
                        "status": "True" if ready else "False",
                        "reason": reason,
                        "message": message,
                    }
                ]
            }
        }

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        try:
            self.k.core.patch_namespaced_pod_status(
                self.pod, self.ns, self.body, _content_type=STRATEGIC_MERGE_PATCH, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:
                if not self.ready:
                    # A pod that no longer exists is not ready anywhere: the outcome asked for holds.
                    return self._gone()
                raise PermanentEffectError(f"pod {self.ns}/{self.pod} no longer exists") from exc
            permanent_if_client_error(exc, f"set {self.condition} on pod {self.ns}/{self.pod}")
            raise
        return {"pod": f"{self.ns}/{self.pod}", "condition": self.condition, "ready": self.ready}

    def _gone(self) -> dict[str, Any]:
        return {"pod": f"{self.ns}/{self.pod}", "condition": self.condition, "ready": False, "pod_gone": True}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        pod = kr.get_pod(self.k, self.ns, self.pod)
        if pod is None:
            return None if self.ready else self._gone()
        want = "True" if self.ready else "False"
        if kr.condition(pod, self.condition) == want:
            return {
                "pod": f"{self.ns}/{self.pod}",
                "condition": self.condition,
                "ready": self.ready,
                "found_by_probe": True,
            }
        return None

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        return ActionSignature(
            world=api_server_world(self.k),
            verb="PATCH",
            path=f"/api/v1/namespaces/{self.ns}/pods/{self.pod}/status",
            body_digest=request_digest(self.body),
        )


class ServingReadyChange(EffectRequest):
    namespace: str
    pod: str
    ready: bool
    reason: str = Field("ScaleDown", pattern=r"^[A-Z][A-Za-z]*$")


class PodGate(BaseModel):
    """What the keeper remembers about one pod between samples."""

    state: ReadinessState = Field(default_factory=ReadinessState)
    writes: int = Field(0, ge=0, description="Gate writes so far: part of the next write's operation id")


class GateSyncRequest(BaseModel):
    pool: PoolRef
    thresholds: ReadinessThresholds = Field(default_factory=ReadinessThresholds)
    gates: dict[str, PodGate] = Field(default_factory=dict)
    dry_run: bool = False


class GateWrite(BaseModel):
    pod: str
    ready: bool
    reason: str
    detail: str
    state: str = Field(description="The ledger's state of the write (applied, planned, failed...)")


class GateSyncResult(BaseModel):
    gates: dict[str, PodGate]
    writes: list[GateWrite] = Field(default_factory=list)
    skipped: dict[str, str] = Field(default_factory=dict, description="pod -> why its gate was left alone")
    verdicts: dict[str, str] = Field(default_factory=dict, description="pod -> ready/not ready and why")


class ReadinessActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    def _write(self, req: ServingReadyChange) -> EffectReport:
        target = f"pod/{req.namespace}/{req.pod}"
        effect = PodConditionPatch(
            self.deps.kube, req.namespace, req.pod, SERVING_READY_CONDITION, req.ready, req.reason
        )
        params = {"condition": SERVING_READY_CONDITION, "ready": req.ready, "reason": req.reason}
        return perform_effect(self.deps, req, "k8s.pod.readiness-gate", target, params, effect)

    @activity.defn(name="set_serving_ready")
    def set_serving_ready(self, req: ServingReadyChange) -> EffectReport:
        """Write the readiness gate of one pod (through the ledger)."""
        return self._write(req)

    @activity.defn(name="sync_readiness_gates")
    def sync_readiness_gates(self, req: GateSyncRequest) -> GateSyncResult:
        """One sample of the pool: each replica's verdict, and a gate write wherever the gate disagrees."""
        ns = req.pool.namespace
        gates = dict(req.gates)
        writes: list[GateWrite] = []
        skipped: dict[str, str] = {}
        verdicts: dict[str, str] = {}
        for pod in self._pool_pods(req.pool):
            name = kr.name(pod)
            why_not = self._not_mine(pod)
            if why_not:
                skipped[name] = why_not
                continue
            previous = gates.get(name)
            sample = self._sample(ns, pod)
            state = next_readiness(previous.state if previous else None, sample, req.thresholds)
            verdicts[name] = f"{'ready' if state.ready else 'not ready'}: {state.reason}"
            gate = PodGate(state=state, writes=previous.writes if previous else 0)
            want = "True" if state.ready else "False"
            if kr.condition(pod, SERVING_READY_CONDITION) != want:
                reason = reason_code(state)
                report = self._write(
                    ServingReadyChange(
                        step=f"readiness-gate-{gate.writes + 1}",
                        namespace=ns,
                        pod=name,
                        ready=state.ready,
                        reason=reason,
                        dry_run=req.dry_run,
                    )
                )
                gate = gate.model_copy(update={"writes": gate.writes + 1})
                writes.append(
                    GateWrite(
                        pod=name, ready=state.ready, reason=reason, detail=state.reason, state=report.state
                    )
                )
            gates[name] = gate
        present = {kr.name(p) for p in self._pool_pods(req.pool)}
        gates = {p: g for p, g in gates.items() if p in present}
        return GateSyncResult(gates=gates, writes=writes, skipped=skipped, verdicts=verdicts)

    # ------------------------------------------------------------ helpers

    def _pool_pods(self, pool: PoolRef) -> list[kr.Obj]:
        k = self.deps.kube
        svc = kr.get_service(k, pool.namespace, pool.service)
        selector: dict[str, str] = dict(svc.get("spec", {}).get("selector") or {})
        model = selector.get(MODEL_LABEL)
        if model:
            return kr.list_pods(k, pool.namespace, f"{MODEL_LABEL}={model}")
        base = {key: v for key, v in selector.items() if key != self.deps.settings.router_label}
        return kr.list_pods(k, pool.namespace, ",".join(f"{key}={v}" for key, v in base.items()) or None)

    @staticmethod
    def _not_mine(pod: kr.Obj) -> str | None:
        meta = pod["metadata"]
        gates = [g.get("conditionType") for g in pod.get("spec", {}).get("readinessGates") or []]
        if SERVING_READY_CONDITION not in gates:
            return f"pod has no {SERVING_READY_CONDITION} readiness gate"
        if meta.get("deletionTimestamp"):
            return "terminating"
        if DRAINING_ANNOTATION in (meta.get("annotations") or {}):
            return f"drained by {meta['annotations'][DRAINING_ANNOTATION]}"
        if (meta.get("labels") or {}).get(LWS_WORKER_INDEX_LABEL, "0") != "0":
            return "worker rank (its group leader's engine decides)"
        if not pod.get("status", {}).get("podIP") or kr.condition(pod, "ContainersReady") != "True":
            return "engine not started (the readiness probe decides)"
        return None

    def _sample(self, ns: str, pod: kr.Obj) -> EngineSample:
        s = self.deps.settings
        values = {"pod_ip": pod.get("status", {}).get("podIP") or "", "namespace": ns, "pod": kr.name(pod)}
        try:
            live = self.deps.http.get(s.health_url_template.format(**values)).status_code == 200
        except httpx.HTTPError:
            return EngineSample(live=False)
        try:
            r = self.deps.http.get(s.metrics_url_template.format(**values))
            snap = parse_engine_metrics(r.text) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            snap = None
        if snap is None or snap.kv_usage is None:
            return EngineSample(live=live)
        return EngineSample(live=live, kv_usage=snap.kv_usage, waiting=snap.waiting)
