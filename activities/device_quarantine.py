"""The device path's effects and reads: one GPU's quarantine record, its DeviceTaintRule, and the
ResourceClaim + Job that qualify it (``fleet.device_fault``, ``fleet.device_taint``).

Every mutation goes through the effect ledger like every other (``activities.act.perform_effect``):
op id ``fleetmend:<scope>/step/target``, an existing object created for the same operation is
found by its probe, a 4xx refusal is permanent and stops the step for an operator.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import Field
from temporalio import activity

from activities.act import EffectReport, EffectRequest, perform_effect
from activities.deps import ActivityDeps, operation_id
from activities.qualification import DEVICE_QUARANTINE_KIND, DEVICE_RELEASE_KIND, CreateJob
from activities.world_effects import NodePatch, api_server_world, permanent_if_client_error, request_digest
from fleet.device_fault import DraDevice, FaultedDevice, quarantine_annotation
from fleet.device_taint import claim_manifest, claim_name, rule_manifest, rule_name
from fleet.qualification import OPERATION_ANNOTATION, job_manifest, job_name
from fleet.vocabulary import DRA_GROUP, DRA_VERSION
from ledger.effect import ActionSignature, Attempt, Effect
from ledger.errors import PermanentEffectError


class DeviceRecord(EffectRequest):
    """Record (or, ``release``, close) one GPU's quarantine on its node, keyed on the machine and UUID."""

    node: str
    machine: str
    device: FaultedDevice
    fault_class: str
    at: float
    release: bool = False


class DeviceTaintRequest(EffectRequest):
    node: str
    machine: str
    device: FaultedDevice
    dra: DraDevice
    fault_class: str
    effect: str = Field(pattern="^(None|NoSchedule|NoExecute)$")


class DeviceTaintRef(EffectRequest):
    node: str
    uuid: str


class DeviceQualificationRequest(EffectRequest):
    node: str
    machine: str
    device: FaultedDevice
    dra: DraDevice
    attempt: int = Field(ge=0)


class DeviceClaimRef(EffectRequest):
    name: str


class DraObject(Effect):
    """Create or delete one ``resource.k8s.io/v1`` object (a DeviceTaintRule, a ResourceClaim)."""

    def __init__(
        self,
        deps: ActivityDeps,
        plural: str,
        name: str,
        namespace: str | None = None,
        body: dict[str, Any] | None = None,
    ) -> None:
        self.r, self.world, self.plural, self.name, self.ns, self.body = (
            deps.kube.resource,
            api_server_world(deps.kube),
            plural,
            name,
            namespace,
            body,
        )

    @property
    def _what(self) -> str:
        return f"{self.plural} {self.ns + '/' if self.ns else ''}{self.name}"

    def _call(self, verb: str) -> Any:
        kind = {"devicetaintrules": "device_taint_rule", "resourceclaims": "namespaced_resource_claim"}
        method: Callable[..., Any] = getattr(self.r, f"{verb}_{kind[self.plural]}")
        # The client's order: create(namespace, body) / read(name, namespace); cluster-scoped: (body) / (name).
        first: Any = self.body if verb == "create" else self.name
        args: list[Any] = (
            [first] if not self.ns else ([self.ns, first] if verb == "create" else [first, self.ns])
        )
        return method(*args, _preload_content=False)

    def _read(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads(self._call("read").data))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, attempt: Attempt) -> dict[str, Any]:
        verb = "delete" if self.body is None else "create"
        try:
            self._call(verb)
        except ApiException as exc:
            if exc.status == 404 and verb == "delete":
                return {"deleted": self._what, "already_gone": True}
            if exc.status == 409 and verb == "create" and self.probe(attempt) is not None:
                return {"created": self._what, "found_by_probe": True}
            permanent_if_client_error(exc, f"{verb} {self._what}")
            raise
        return {"deleted" if verb == "delete" else "created": self._what, "name": self.name}

    def probe(self, attempt: Attempt) -> dict[str, Any] | None:
        obj = self._read()
        if self.body is None:
            return {"deleted": self._what, "found_by_probe": True} if obj is None else None
        if obj is None:
            return None
        mine = (self.body["metadata"].get("annotations") or {}).get(OPERATION_ANNOTATION)
        theirs = (obj["metadata"].get("annotations") or {}).get(OPERATION_ANNOTATION)
        if mine != theirs or (obj.get("spec") or {}).get("taint") != self.body["spec"].get("taint"):
            raise PermanentEffectError(
                f"{self._what} exists but was not created for {mine} (another run's, or another taint): "
                "delete it, then retry"
            )
        return {"created": self._what, "name": self.name, "found_by_probe": True}

    def action_signature(self, attempt: Attempt) -> ActionSignature:
        base = f"/apis/{DRA_GROUP}/{DRA_VERSION}" + (f"/namespaces/{self.ns}" if self.ns else "")
        if self.body is None:
            return ActionSignature(
                world=self.world, verb="DELETE", path=f"{base}/{self.plural}/{self.name}", body_digest="*"
            )
        return ActionSignature(
            world=self.world, verb="POST", path=f"{base}/{self.plural}", body_digest=request_digest(self.body)
        )


class DeviceActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn(name="record_device_quarantine")
    def record_device_quarantine(self, req: DeviceRecord) -> EffectReport:
        """The quarantine record on the node: annotation ``gpu-quarantine.fleetmend.io/<uuid>``."""
        value = None if req.release else f"{req.fault_class}@{req.at:.0f}"
        effect = NodePatch(
            self.deps.kube, req.node, annotations={quarantine_annotation(req.device.uuid): value}
        )
        kind = DEVICE_RELEASE_KIND if req.release else DEVICE_QUARANTINE_KIND
        params = {
            "machine": req.machine,
            "uuid": req.device.uuid,
            "index": req.device.index,
            "fault_class": req.fault_class,
        }
        return perform_effect(self.deps, req, kind, f"node/{req.node}/gpu/{req.device.uuid}", params, effect)

    @activity.defn(name="create_device_taint_rule")
    def create_device_taint_rule(self, req: DeviceTaintRequest) -> EffectReport:
        body = rule_manifest(
            req.dra,
            req.device,
            node=req.node,
            machine=req.machine,
            fault_class=req.fault_class,
            effect=req.effect,
        )
        name = body["metadata"]["name"]
        target = f"devicetaintrule/{name}"
        body["metadata"]["annotations"][OPERATION_ANNOTATION] = operation_id(req.scope, req.step, target)
        effect = DraObject(self.deps, "devicetaintrules", name, body=body)
        params = {
            "rule": name,
            "selector": body["spec"]["deviceSelector"],
            "taint": body["spec"]["taint"],
            "machine": req.machine,
            "uuid": req.device.uuid,
        }
        report = perform_effect(
            self.deps, req, "k8s.devicetaintrule.create", f"devicetaintrule/{name}", params, effect
        )
        return report.model_copy(update={"result": {**(report.result or {}), "name": name}})

    @activity.defn(name="delete_device_taint_rule")
    def delete_device_taint_rule(self, req: DeviceTaintRef) -> EffectReport:
        name = rule_name(req.node, req.uuid)
        effect = DraObject(self.deps, "devicetaintrules", name)
        return perform_effect(
            self.deps,
            req,
            "k8s.devicetaintrule.delete",
            f"devicetaintrule/{name}",
            {"uuid": req.uuid},
            effect,
        )

    @activity.defn(name="read_device_taint_rule")
    def read_device_taint_rule(self, ref: DeviceTaintRef) -> dict[str, Any] | None:
        return DraObject(self.deps, "devicetaintrules", rule_name(ref.node, ref.uuid))._read()

    @activity.defn(name="create_device_qualification")
    def create_device_qualification(self, req: DeviceQualificationRequest) -> EffectReport:
        """The device's ResourceClaim (that GPU by UUID) and the Job that runs ``dcgmi diag -i <index>`` on it."""
        spec = self.deps.settings.qualification
        # Named by its operation: a retried step is a new operation and gets a new claim, never a clash.
        claim_target = f"resourceclaim/{spec.namespace}/qualify-{req.node}-gpu-{req.device.index}"
        claim_op = operation_id(req.scope, f"{req.step}-claim", claim_target)
        claim = claim_name(req.node, req.device.uuid, claim_op)
        body = claim_manifest(req.dra, req.device, namespace=spec.namespace, name=claim, op_id=claim_op)
        claimed = perform_effect(
            self.deps,
            req.model_copy(update={"step": f"{req.step}-claim"}),
            "k8s.resourceclaim.create",
            claim_target,
            {
                "claim": claim,
                "uuid": req.device.uuid,
                "selector": body["spec"]["devices"]["requests"][0]["exactly"],
            },
            DraObject(self.deps, "resourceclaims", claim, spec.namespace, body),
        )
        if claimed.state != "applied":
            return claimed
        target = f"job/{spec.namespace}/qualify-{req.node}-gpu-{req.device.index}"
        op_id = operation_id(req.scope, req.step, target)
        name = job_name(req.node, op_id)
        job = job_manifest(
            spec,
            node=req.node,
            machine=req.machine,
            gpus=1,
            name=name,
            op_id=op_id,
            claim=claim,
            gpu_index=req.device.index,
        )
        params = {
            "job": name,
            "node": req.node,
            "machine": req.machine,
            "claim": claim,
            "uuid": req.device.uuid,
            "command": spec.container_command(req.device.index),
        }
        report = perform_effect(
            self.deps,
            req,
            "k8s.job.create",
            target,
            params,
            CreateJob(self.deps.kube, spec.namespace, job, op_id),
        )
        return report.model_copy(update={"result": {**(report.result or {}), "name": name, "claim": claim}})

    @activity.defn(name="read_device_claim")
    def read_device_claim(self, name: str) -> list[dict[str, Any]]:
        """The devices the qualification's claim was allocated (``status.allocation.devices.results``)."""
        ns = self.deps.settings.qualification.namespace
        claim = DraObject(self.deps, "resourceclaims", name, ns)._read() or {}
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
        return [dict(r) for r in results or []]

    @activity.defn(name="delete_device_claim")
    def delete_device_claim(self, req: DeviceClaimRef) -> EffectReport:
        ns = self.deps.settings.qualification.namespace
        effect = DraObject(self.deps, "resourceclaims", req.name, ns)
        return perform_effect(
            self.deps, req, "k8s.resourceclaim.delete", f"resourceclaim/{ns}/{req.name}", {}, effect
        )
