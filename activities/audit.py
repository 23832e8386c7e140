"""Ledger reconciliation as an activity: the verification step's "no duplicate, no orphan" check.

Where the target keeps its own action log (the simulator does), fleetmend's own
requests in it (identified by its user agent) are matched against the ledger.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

from pydantic import BaseModel
from temporalio import activity

from activities.deps import ActivityDeps
from activities.kube import USER_AGENT
from fleet.protocol import ActionLogEntry
from fleet.verification import LedgerReconcile
from ledger.reconcile import reconcile, world_actions_from_sim


class ReconcileRequest(BaseModel):
    workflow_id: str
    unresolved_after_s: float = 300.0


class AuditActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps

    @activity.defn(name="reconcile_ledger")
    def reconcile_workflow(self, req: ReconcileRequest) -> LedgerReconcile:
        world = actions = None
        url = self.deps.settings.action_log_url
        if url:
            r = self.deps.http.get(url)
            r.raise_for_status()
            entries = [ActionLogEntry.model_validate(e) for e in r.json()]
            mine = [e for e in entries if USER_AGENT in e.client]
            world = urlsplit(url).netloc
            actions = world_actions_from_sim(world, mine)
        report = reconcile(
            self.deps.ledger.engine,
            world=world,
            actions=actions,
            unresolved_after=timedelta(seconds=req.unresolved_after_s),
        )
        return LedgerReconcile(
            duplicates=len(report.duplicates),
            orphans=len(report.orphans),
            unresolved=len(report.unresolved) + len(report.needs_operator),
        )
