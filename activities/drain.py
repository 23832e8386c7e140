"""Read-only looks a planned scale-down takes while draining: in-flight requests, and cut streams.

Both answers are summaries, so a long drain under heavy load does not carry
every journal entry through workflow history.
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from temporalio import activity

from activities import kube_reads as kr
from activities.deps import ActivityDeps
from activities.engine_reads import look_deadline, read_all
from activities.observe import ObserveActivities
from fleet.gateway import Outcome
from fleet.incident import PoolRef
from fleet.scale_down import DrainProgress, drain_progress


class DrainLook(BaseModel):
    pool: PoolRef
    pods: list[str] = Field(description="Victim pods whose engines hold requests (group leaders)")


class CutStreamsRequest(BaseModel):
    pool: PoolRef
    replicas: list[str]
    since: float | None = Field(None, description="Only requests that ended at or after this (unix s)")


class CutStreams(BaseModel):
    requests: int = Field(0, description="Journal entries of the replicas in the window")
    completed: int = 0
    cut: int = Field(0, description="Streams that ended with a terminal error after their first token")
    cut_request_ids: list[str] = Field(default_factory=list, description="First 50 cut request ids")


class DrainActivities:
    def __init__(self, deps: ActivityDeps) -> None:
        self.deps = deps
        self._observe = ObserveActivities(deps)

    @activity.defn(name="drain_look")
    def drain_look(self, req: DrainLook) -> DrainProgress:
        """Running + waiting requests on each victim engine, from its own /metrics (several at once, within
        the attempt's time); a victim too slow to answer is named unread, never counted drained."""
        ns = req.pool.namespace
        found = {name: pod for name in req.pods if (pod := kr.get_pod(self.deps.kube, ns, name)) is not None}
        reads = read_all(
            lambda name: self._observe._read_engine(ns, found[name]),
            list(found),
            deadline=look_deadline(),
            concurrency=self.deps.settings.engine_reads_per_look,
        )
        scrapes = {name: r.snapshot for name, r in reads.items() if r.snapshot is not None}
        unread = {name: r.unread for name, r in reads.items() if r.unread is not None}
        return drain_progress(req.pods, scrapes, unread)

    @activity.defn(name="cut_streams")
    def cut_streams(self, req: CutStreamsRequest) -> CutStreams:
        """What the gateway journaled for the replicas: how many streams were cut, and which."""
        out = CutStreams()
        for replica in req.replicas:
            for e in self.deps.gateway.request_outcomes(req.pool, replica=replica, since=req.since):
                out.requests += 1
                if e.outcome in (Outcome.COMPLETED, Outcome.LATE):
                    out.completed += 1
                elif e.outcome == Outcome.TERMINAL_ERROR and e.truncated:
                    out.cut += 1
                    if len(out.cut_request_ids) < 50:
                        out.cut_request_ids.append(e.request_id)
        return out
