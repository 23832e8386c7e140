"""The Job controller (batch/v1), for the run-to-completion pods the simulator runs (qualification Jobs).

Non-indexed Jobs with ``completions`` = ``parallelism`` = 1, as kube-controller-manager runs them:
one pod at a time from the template (``restartPolicy`` Never or OnFailure), a failed pod is
replaced until ``backoffLimit`` failures; ``activeDeadlineSeconds`` ends the Job with
``Failed/DeadlineExceeded`` and deletes its running pod; success writes ``SuccessCriteriaMet``
then ``Complete``, failure ``FailureTarget`` then ``Failed`` (1.33+ condition order). Pods carry
the ``batch.kubernetes.io/job-name`` and ``controller-uid`` labels and an owner reference, so
deleting the Job (propagation Background) garbage-collects them.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from sim.clock import parse_timestamp
from sim.k8s import objects as o

if TYPE_CHECKING:
    from sim.k8s.controlplane import ControlPlane

Obj = dict[str, Any]
COMPONENT = "job-controller"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"


def default_job(job: Obj, uid: str | None) -> Obj:
    """The apiserver's defaulting of a Job (selector and template labels need the uid)."""
    spec = job.setdefault("spec", {})
    spec.setdefault("parallelism", 1)
    spec.setdefault("completions", 1)
    spec.setdefault("backoffLimit", 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    spec.setdefault("manualSelector", False)
    spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
    template = spec.setdefault("template", {})
    template.setdefault("spec", {}).setdefault("restartPolicy", "Never")
    if uid is not None:
        name = job["metadata"]["name"]
        labels = template.setdefault("metadata", {}).setdefault("labels", {})
        labels.update(
            {
                CONTROLLER_UID_LABEL: uid,
                JOB_NAME_LABEL: name,
                "controller-uid": uid,
                "job-name": name,
            }
        )
        spec.setdefault("selector", {"matchLabels": {CONTROLLER_UID_LABEL: uid}})
    return job


def _finished(job: Obj) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in job.get("status", {}).get("conditions") or []
    )


def _pods_of(cp: ControlPlane, job: Obj) -> list[Obj]:
    uid = o.uid_of(job)
    return [
        p
        for p in cp.store.owned_by("pods", uid)
        if o.namespace_of(p) == o.namespace_of(job)
        and (ref := o.controller_ref(p)) is not None
        and ref.get("uid") == uid
    ]


def _create_pod(cp: ControlPlane, job: Obj) -> None:
    template = copy.deepcopy(job["spec"].get("template") or {})
    meta = template.get("metadata") or {}
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{o.name_of(job)}-{o.random_suffix(cp.rng)}",
            "namespace": o.namespace_of(job),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [o.owner_reference(job)],
        },
        "spec": template.get("spec") or {},
    }
    created = cp.create_pod(pod)
    cp.events.record(job, "SuccessfulCreate", f"Created pod: {o.name_of(created)}", component=COMPONENT)


def reconcile_jobs(cp: ControlPlane) -> None:
    now = cp.now()
    stamp = cp.clock.timestamp()
    for job in cp.store.list_view("jobs"):
        if o.is_terminating(job) or _finished(job) or job.get("spec", {}).get("suspend"):
            continue
        spec = job["spec"]
        pods = _pods_of(cp, job)
        succeeded = sum(1 for p in pods if o.pod_phase(p) == "Succeeded")
        failed = sum(1 for p in pods if o.pod_phase(p) == "Failed")
        active = sum(1 for p in pods if o.is_pod_active(p))
        started = (job.get("status") or {}).get("startTime")
        start = parse_timestamp(started) if started else now
        deadline = spec.get("activeDeadlineSeconds")
        verdict: tuple[str, str, str] | None = None
        if succeeded >= int(spec.get("completions") or 1):
            verdict = ("Complete", "CompletionsReached", "Reached expected number of succeeded pods")
        elif failed > int(spec.get("backoffLimit", 6)):
            verdict = ("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        elif deadline is not None and now >= start + float(deadline):
            verdict = ("Failed", "DeadlineExceeded", "Job was active longer than specified deadline")
        elif deadline is not None:
            cp.wake_at(start + float(deadline))
        if verdict is not None and verdict[0] == "Failed":
            for pod in pods:
                if o.is_pod_active(pod):
                    cp.delete("pods", o.namespace_of(pod), o.name_of(pod))
            active = 0
        elif verdict is None and not active:
            _create_pod(cp, job)
            active = 1

        def write(
            obj: Obj,
            verdict: tuple[str, str, str] | None = verdict,
            n_active: int = active,
            succeeded: int = succeeded,
            failed: int = failed,
        ) -> None:
            status = obj.setdefault("status", {})
            status.setdefault("startTime", stamp)
            status["active"] = n_active
            status["ready"] = sum(1 for p in _pods_of(cp, obj) if o.condition_status(p, "Ready") == "True")
            status["succeeded"] = succeeded
            status["failed"] = failed
            status["terminating"] = 0
            status["uncountedTerminatedPods"] = {}
            for key in ("active", "succeeded", "failed", "terminating"):
                if not status[key]:
                    status.pop(key)
            if verdict is not None:
                kind, reason, message = verdict
                interim = "SuccessCriteriaMet" if kind == "Complete" else "FailureTarget"
                o.set_condition(obj, interim, "True", stamp, reason, message, style="pod")
                o.set_condition(obj, kind, "True", stamp, reason, message, style="pod")
                if kind == "Complete":
                    status["completionTime"] = stamp

        cp.store.mutate("jobs", o.namespace_of(job), o.name_of(job), write)
        if verdict is not None:
            kind, reason, message = verdict
            event = "Completed" if kind == "Complete" else reason
            cp.events.record(
                job,
                event,
                "Job completed" if kind == "Complete" else message,
                event_type="Normal" if kind == "Complete" else "Warning",
                component=COMPONENT,
            )
