"""PodDisruptionBudget status and the Eviction API's budget check.

``disruptionsAllowed = currentHealthy - desiredHealthy`` where healthy means
Ready and not terminating. Eviction (``POST pods/{name}/eviction``): pods that
are not Running or already terminating skip the budget; more than one matching
PDB is a 500; a budget without room answers the real 429 ``TooManyRequests``
Status with a ``DisruptionBudget`` cause.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sim.k8s import objects as o
from sim.k8s.controllers.workloads import pods_for_selector
from sim.k8s.errors import ApiError, too_many_requests
from sim.k8s.selectors import matches_label_selector_object

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]


def _expected_pods(cp: ControlPlane, pods: list[Obj]) -> int:
    """Sum of the scale of the controllers owning the matched pods (the real ``getExpectedScale``)."""
    seen: set[str] = set()
    expected = 0
    orphans = 0
    for pod in pods:
        ref = o.controller_ref(pod)
        if ref is None:
            orphans += 1
            continue
        if ref["uid"] in seen:
            continue
        seen.add(ref["uid"])
        if ref["kind"] == "ReplicaSet":
            rs = cp.store.find("replicasets", o.namespace_of(pod), ref["name"])
            expected += int(rs["spec"].get("replicas", 0)) if rs else 0
        else:
            expected += sum(
                1 for p in pods if (r := o.controller_ref(p)) is not None and r["uid"] == ref["uid"]
            )
    return expected + orphans


def budget(cp: ControlPlane, pdb: Obj) -> Obj:
    """The PDB's status as the disruption controller would compute it now."""
    namespace = o.namespace_of(pdb)
    selector = pdb["spec"].get("selector")
    pods = [
        p
        for p in pods_for_selector(cp, namespace, selector)
        if matches_label_selector_object(selector, o.labels(p))
    ]
    expected = _expected_pods(cp, pods)
    healthy = sum(1 for p in pods if o.is_pod_ready(p) and not o.is_terminating(p))
    spec = pdb["spec"]
    if spec.get("minAvailable") is not None:
        value = spec["minAvailable"]
        desired = math.ceil(float(value[:-1]) / 100 * expected) if isinstance(value, str) else int(value)
    else:
        value = spec.get("maxUnavailable", 0)
        unavailable = math.ceil(float(value[:-1]) / 100 * expected) if isinstance(value, str) else int(value)
        desired = max(0, expected - unavailable)
    return {
        "observedGeneration": pdb["metadata"].get("generation", 1),
        "disruptionsAllowed": max(0, healthy - desired),
        "currentHealthy": healthy,
        "desiredHealthy": desired,
        "expectedPods": expected,
    }


def reconcile_pdbs(cp: ControlPlane) -> None:
    stamp = cp.clock.timestamp()
    for pdb in cp.store.list_view("poddisruptionbudgets"):
        computed = budget(cp, pdb)

        def change(obj: Obj, computed: Obj = computed) -> None:
            conditions = obj.get("status", {}).get("conditions")
            obj["status"] = dict(computed)
            if conditions:
                obj["status"]["conditions"] = conditions
            if computed["disruptionsAllowed"] > 0:
                o.set_condition(obj, "DisruptionAllowed", "True", stamp, "SufficientPods", "", style="meta")
            else:
                o.set_condition(
                    obj, "DisruptionAllowed", "False", stamp, "InsufficientPods", "", style="meta"
                )

        cp.store.mutate("poddisruptionbudgets", o.namespace_of(pdb), o.name_of(pdb), change)


def check_eviction(cp: ControlPlane, pod: Obj) -> None:
    """Raise the apiserver's error if evicting ``pod`` now would violate its budget."""
    if o.is_terminating(pod) or o.pod_phase(pod) != "Running":
        return
    pdbs = [
        p
        for p in cp.store.list_view("poddisruptionbudgets", o.namespace_of(pod))
        if matches_label_selector_object(p["spec"].get("selector"), o.labels(pod))
    ]
    if not pdbs:
        return
    if len(pdbs) > 1:
        raise ApiError(
            500,
            "InternalError",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        )
    pdb = pdbs[0]
    computed = budget(cp, pdb)
    if computed["disruptionsAllowed"] <= 0:
        raise too_many_requests(
            "Cannot evict pod as it would violate the pod's disruption budget.",
            causes=[
                {
                    "reason": "DisruptionBudget",
                    "message": f"The disruption budget {o.name_of(pdb)} needs {computed['desiredHealthy']} healthy pods "
                    f"and has {computed['currentHealthy']} currently",
                }
            ],
        )
