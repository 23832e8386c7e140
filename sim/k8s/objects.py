"""Small helpers over API objects held as JSON dicts (conditions, owners, GPUs, hashes)."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from fleet.vocabulary import GPU_RESOURCE

Obj = dict[str, Any]

_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand


def name_of(obj: Obj) -> str:
    return str(obj["metadata"]["name"])


def namespace_of(obj: Obj) -> str:
    return str(obj["metadata"].get("namespace", ""))


def uid_of(obj: Obj) -> str:
    return str(obj["metadata"]["uid"])


def labels(obj: Obj) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("labels") or {})


def is_terminating(obj: Obj) -> bool:
    return "deletionTimestamp" in obj.get("metadata", {})


def random_suffix(rng: random.Random, length: int = 5) -> str:
    return "".join(rng.choice(_SUFFIX_ALPHABET) for _ in range(length))


def stable_hash(value: Any, length: int = 10) -> str:
    """A deterministic name-safe hash (like ``pod-template-hash``)."""
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).digest()
    return "".join(_SUFFIX_ALPHABET[b % len(_SUFFIX_ALPHABET)] for b in digest[:length])


# ------------------------------------------------------------------ conditions
def condition(obj: Obj, condition_type: str) -> Obj | None:
    for cond in obj.get("status", {}).get("conditions") or []:
        if cond.get("type") == condition_type:
            return dict(cond)
    return None


def condition_status(obj: Obj, condition_type: str) -> str | None:
    cond = condition(obj, condition_type)
    return None if cond is None else str(cond.get("status"))


def set_condition(
    obj: Obj,
    condition_type: str,
    status: str,
    now_ts: str,
    reason: str | None = None,
    message: str | None = None,
    *,
    style: str = "pod",
) -> None:
    """Upsert a condition; ``lastTransitionTime`` moves only when ``status`` changes.

    ``style``: "pod" (lastProbeTime), "node" (lastHeartbeatTime), "deployment"
    (lastUpdateTime) or "meta" (metav1.Condition: reason and message required).
    """
    conditions: list[Obj] = obj.setdefault("status", {}).setdefault("conditions", [])
    existing = next((c for c in conditions if c.get("type") == condition_type), None)
    new: Obj = {"type": condition_type, "status": status}
    if style == "pod":
        new["lastProbeTime"] = None
    if style == "node":
        new["lastHeartbeatTime"] = existing.get("lastHeartbeatTime", now_ts) if existing else now_ts
    if style == "deployment":
        unchanged = (
            existing is not None and existing.get("status") == status and existing.get("reason") == reason
        )
        new["lastUpdateTime"] = existing.get("lastUpdateTime", now_ts) if unchanged and existing else now_ts
    if existing is not None and existing.get("status") == status:
        new["lastTransitionTime"] = existing.get("lastTransitionTime", now_ts)
    else:
        new["lastTransitionTime"] = now_ts
    if style == "meta":
        new["reason"] = reason or condition_type
        new["message"] = message or ""
    else:
        if reason:
            new["reason"] = reason
        if message:
            new["message"] = message
    if existing is None:
        conditions.append(new)
    else:
        conditions[conditions.index(existing)] = new


# ---------------------------------------------------------------- pods & nodes
def is_pod_ready(pod: Obj) -> bool:
    return condition_status(pod, "Ready") == "True"


def pod_phase(pod: Obj) -> str:
    return str(pod.get("status", {}).get("phase", "Pending"))


def is_pod_terminal(pod: Obj) -> bool:
    return pod_phase(pod) in ("Succeeded", "Failed")


def is_pod_active(pod: Obj) -> bool:
    """Counted by controllers: not terminating, not finished."""
    return not is_terminating(pod) and not is_pod_terminal(pod)


def pod_gpus(pod: Obj) -> int:
    total = 0
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        value = (resources.get("requests") or {}).get(GPU_RESOURCE) or (resources.get("limits") or {}).get(
            GPU_RESOURCE
        )
        if value is not None:
            total += int(value)
    return total


def restart_count(pod: Obj) -> int:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def node_gpus(node: Obj) -> int:
    return int((node.get("status", {}).get("allocatable") or {}).get(GPU_RESOURCE, 0))


# -------------------------------------------------------------------- owners
def controller_ref(obj: Obj) -> Obj | None:
    for ref in obj.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return dict(ref)
    return None


def owner_reference(owner: Obj, *, controller: bool = True) -> Obj:
    return {
        "apiVersion": owner["apiVersion"],
        "kind": owner["kind"],
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": controller,
        "blockOwnerDeletion": True,
    }


def tolerates(tolerations: list[Obj], taint: Obj) -> Obj | None:
    """The toleration that tolerates ``taint`` (core/v1 ``ToleratesTaint`` rules), if any."""
    for toleration in tolerations:
        effect = toleration.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = toleration.get("key")
        if key and key != taint.get("key"):
            continue
        operator = toleration.get("operator", "Equal")
        if operator == "Exists":
            return toleration
        if operator == "Equal" and toleration.get("value", "") == taint.get("value", ""):
            return toleration
    return None
