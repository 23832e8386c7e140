"""Fencing one GPU on a DRA cluster: a DeviceTaintRule, and the claim that qualifies the device.

Kubernetes' Dynamic Resource Allocation publishes each GPU as a device of a ResourceSlice
(``resource.k8s.io/v1``; a device is named by driver, pool and name - NVIDIA's driver names
them ``gpu-<index>`` and gives each a ``uuid`` and an ``index`` attribute). A **DeviceTaintRule**
(KEP-5055; cluster-scoped, ``resource.k8s.io/v1`` in 1.37) taints the devices its
``spec.deviceSelector`` {driver, pool, device} names, with ``spec.taint`` {key, value, effect}:

* ``NoSchedule`` - no new claim is allocated the device; pods using it keep running;
* ``NoExecute`` - also evicts the pods whose claims hold it;
* ``None`` - changes nothing; the rule's ``EvictionInProgress`` condition says what NoExecute
  would evict (a dry run's report).

fleetmend's rule names exactly the faulted device, with its quarantine key
(``fleetmend.io/quarantine=<fault class>``). It is ``None`` in a dry run, ``NoExecute`` when a
pod still holds the device (a replica on a dead GPU serves nothing; its controller re-creates
it elsewhere), else ``NoSchedule``. The device's qualification is a Job whose ResourceClaim
selects the device by UUID (a CEL selector) and tolerates the quarantine taint and the driver's
own health taint; a pass deletes the rule (the clearing NVIDIA DRA driver users ask for,
dra-driver-nvidia-gpu #1455), a fail keeps it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from fleet.device_fault import DraDevice, FaultedDevice
from fleet.qualification import MACHINE_ANNOTATION, OPERATION_ANNOTATION, QUALIFICATION_LABEL
from fleet.vocabulary import (
    DRA_GROUP,
    DRA_VERSION,
    DRIVER_UNHEALTHY_TAINT_KEY,
    GPU_DEVICE_CLASS,
    QUARANTINE_TAINT_KEY,
)

UUID_ANNOTATION = "fleetmend.io/gpu-uuid"
MANAGED = {"app.kubernetes.io/managed-by": "fleetmend"}


def taint_effect(dry_run: bool, users: Iterable[str]) -> str:
    """``None`` in a dry run (report only), ``NoExecute`` while a pod still holds the device, else ``NoSchedule``."""
    if dry_run:
        return "None"
    return "NoExecute" if list(users) else "NoSchedule"


def _short(node: str, uuid: str, kind: str) -> str:
    digest = hashlib.sha256(f"{node}/{uuid}".encode()).hexdigest()[:8]
    return f"fm-{kind}-{node[:40].rstrip('-.')}-{digest}".lower()


def rule_name(node: str, uuid: str) -> str:
    """One rule per quarantined GPU (a DNS-1123 name, readable by node)."""
    return _short(node, uuid, "quarantine")


def rule_manifest(
    device: DraDevice, faulted: FaultedDevice, *, node: str, machine: str, fault_class: str, effect: str
) -> dict[str, Any]:
    return {
        "apiVersion": f"{DRA_GROUP}/{DRA_VERSION}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule_name(node, faulted.uuid),
            "labels": dict(MANAGED),
            "annotations": {MACHINE_ANNOTATION: machine, UUID_ANNOTATION: faulted.uuid},
        },
        "spec": {
            "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.name},
            "taint": {"key": QUARANTINE_TAINT_KEY, "value": fault_class, "effect": effect},
        },
    }


def rule_report(rule: Mapping[str, Any] | None) -> str | None:
    """The rule's ``EvictionInProgress`` message (for effect None: what NoExecute would evict)."""
    if rule is None:
        return None
    for c in (rule.get("status") or {}).get("conditions") or []:
        if c.get("type") == "EvictionInProgress":
            return str(c.get("message") or c.get("reason") or c.get("status"))
    return None


def uuid_selector(driver: str, uuid: str) -> str:
    """The CEL expression that picks one GPU by UUID."""
    return f'device.attributes["{driver}"].uuid == "{uuid}"'


def claim_manifest(
    device: DraDevice, faulted: FaultedDevice, *, namespace: str, name: str, op_id: str
) -> dict[str, Any]:
    """The ResourceClaim a device's qualification Job runs under: exactly that GPU, quarantine tolerated."""
    tolerations = [
        {"key": QUARANTINE_TAINT_KEY, "operator": "Exists"},
        {"key": DRIVER_UNHEALTHY_TAINT_KEY, "operator": "Exists"},
    ]
    return {
        "apiVersion": f"{DRA_GROUP}/{DRA_VERSION}",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**MANAGED, QUALIFICATION_LABEL: "true"},
            "annotations": {OPERATION_ANNOTATION: op_id, UUID_ANNOTATION: faulted.uuid},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": GPU_DEVICE_CLASS,
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "selectors": [
                                {"cel": {"expression": uuid_selector(device.driver, faulted.uuid)}}
                            ],
                            "tolerations": tolerations,
                        },
                    }
                ]
            }
        },
    }


def claim_name(node: str, uuid: str, op_id: str) -> str:
    """The qualification claim's name: readable by node, unique per operation."""
    return f"{_short(node, uuid, 'qualify')[:54]}-{hashlib.sha256(op_id.encode()).hexdigest()[:8]}"
