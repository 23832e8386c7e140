"""Ledger reconciliation as an activity: the verification step's "no duplicate, no orphan" check.

The world's record of fleetmend's actions comes from where a real deployment keeps it:

* Kubernetes actions: the API server's **audit log** (``audit_log``: ``audit.k8s.io/v1`` Event
  JSON lines, as ``--audit-log-path`` writes them), for the API server the kubeconfig names
  (``audit_log_world`` overrides the host:port);
* other targets' own action logs (``action_log_url``: the simulator's ``/sim/v1/actions`` for
  Jira issues and the incident channel; Envoy's record of a gateway change is its ACK). When the audit log covers the Kubernetes API,
  Kubernetes paths in that log are left out: the audit log is their record.

Only fleetmend's own requests (its user agents) are compared.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel
from temporalio import activity

from activities.deps import ActivityDeps
from fleet.verification import LedgerReconcile
from kube.client import USER_AGENT, kube_apis
from ledger.reconcile import WorldAction, reconcile, world_actions_from_audit, world_actions_from_sim

KUBERNETES_API_PREFIXES = ("/api/", "/apis/")


class RecordSources(Protocol):
    """Where the world's records are (the worker's settings say it)."""

    @property
    def kubeconfig(self) -> Path | None: ...

    @property
    def kube_context(self) -> str | None: ...

    @property
    def audit_log(self) -> Path | None: ...

    @property
    def audit_log_world(self) -> str | None: ...

    @property
    def action_log_url(self) -> str | None: ...


class ReconcileRequest(BaseModel):
    workflow_id: str
    unresolved_after_s: float = 300.0


def kube_world(settings: RecordSources) -> str:
    """host:port of the API server fleetmend's Kubernetes effects name in their signatures."""
    if settings.audit_log_world:
        return settings.audit_log_world
    return urlsplit(kube_apis(settings).core.api_client.configuration.host).netloc


def read_audit_log(path: Path, world: str) -> list[WorldAction]:
    """The mutations recorded in an audit log file (a clear error when it is not one)."""
    import json

    events = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                events.append(json.loads(line))
            except ValueError as exc:
                raise ValueError(
                    f"{path}:{number} is not JSON ({exc}); expected audit.k8s.io/v1 Event lines"
                ) from None
    return world_actions_from_audit(world, events)


def world_record(
    settings: RecordSources, http: httpx.Client | None = None, client_mark: str | None = USER_AGENT
) -> tuple[list[str], list[WorldAction]]:
    """(worlds, actions) from every configured record; ``client_mark`` keeps only matching clients."""
    worlds: list[str] = []
    actions: list[WorldAction] = []
    api_world = None
    if settings.audit_log is not None:
        api_world = kube_world(settings)
        worlds.append(api_world)
        actions += read_audit_log(settings.audit_log, api_world)
    if settings.action_log_url:
        url = settings.action_log_url
        getter = http.get if http is not None else httpx.get
        response = getter(url)
        response.raise_for_status()
        log_world = urlsplit(url).netloc
        logged = world_actions_from_sim(log_world, response.json())
        if api_world is not None and api_world != log_world:
            logged = [a for a in logged if not a.path.startswith(KUBERNETES_API_PREFIXES)]
        if log_world not in worlds:
            worlds.append(log_world)
        actions += logged
    if client_mark:
        actions = [a for a in actions if client_mark in (a.client or "")]
    return worlds, actions


class AuditActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn(name="reconcile_ledger")
    def reconcile_workflow(self, req: ReconcileRequest) -> LedgerReconcile:
        worlds, actions = world_record(self.deps.settings, self.deps.http)
        report = reconcile(
            self.deps.ledger.engine,
            world=worlds or None,
            actions=actions if worlds else None,
            unresolved_after=timedelta(seconds=req.unresolved_after_s),
        )
        return LedgerReconcile(
            duplicates=len(report.duplicates),
            orphans=len(report.orphans),
            unresolved=len(report.unresolved) + len(report.needs_operator),
        )
