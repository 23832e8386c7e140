"""The state of one replica-loss recovery, as one model (what the runbook knows between its steps)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fleet.incident import LossReport
from fleet.loss import Correlation, GroupVerdict
from fleet.observation import PoolObservation
from fleet.pool import ReplicaGroup


class RecoveryState(BaseModel):
    """What ``ReplicaLossRecovery`` has learnt so far; the admission keeper keeps its own figures."""

    reports: list[LossReport] = Field(default_factory=list)
    new_reports: list[LossReport] = Field(
        default_factory=list, description="Further losses, not yet absorbed"
    )
    verdicts: list[GroupVerdict] = Field(default_factory=list)
    correlation: Correlation | None = None
    initial_obs: PoolObservation | None = Field(
        None, description="The pool as confirmed, lost groups included"
    )
    started_at: float = 0.0
    confirmed_at: float = 0.0
    by_pod_name: bool = Field(
        False, description="LeaderWorkerSet pods matched by name (the confirm step's patch)"
    )
    lost_ids: set[str] = Field(default_factory=set, description="Groups confirmed lost (and handled)")
    lost_groups: list[ReplicaGroup] = Field(default_factory=list)
    failed_nodes: dict[str, str] = Field(
        default_factory=dict, description="node -> why, as the fence decided"
    )
    baseline: dict[str, float] = Field(default_factory=dict, description="Survivors' queues at step 3")
    unmatched: list[str] = Field(default_factory=list, description="Lost groups no warm spare replaced")
    expected_new: int = 0
    quarantined: list[str] = Field(default_factory=list, description="Nodes quarantined and not returned")
    node_workflows: dict[str, str] = Field(
        default_factory=dict, description="node -> its qualification workflow"
    )
    triaged: list[str] = Field(default_factory=list, description="Nodes whose workflow reported its triage")
