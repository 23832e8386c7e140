"""One consistent look at a pool, as the observe activity returns it to the workflows.

It bundles the Kubernetes view (``PoolSnapshot``, pods, EndpointSlice
conditions, the Service and every workload selector), the router's view
(routing set, configuration) and the engines' view (one metrics scrape and a
health answer per group leader). Policies in ``fleet/`` decide from it: what
was seen of one pod (``PodObservation``, with its EndpointSlice conditions and
its engine's health) is judged lost or present by ``fleet.loss``.

**A partial look.** Against a slow world (a saturated engine, an overloaded node) some
engines do not answer a scrape in time. Their groups are named in
``PoolObservation.unread_engines`` with the reason, their ``engine_health`` stays
``UNKNOWN`` and they have no entry in ``engines``. An unread engine is neither idle nor
dead: it connected and did not answer in time (a refused or timed-out *connection* is
``UNREACHABLE``, what a dead process or a dead machine leaves). What each step does with one:

* confirm the loss: an unread engine is no loss evidence (its health is ``UNKNOWN``); the
  verdict rests on Kubernetes (pod, node, EndpointSlice) and the engines that answered;
* protect the survivors: ``judge_partial_look`` via ``fleet.survivor_load.survivors_read`` -
  some read: decide on them (``decide_shedding`` counts an unread survivor at the per-group
  capacity, judges pressure on those read, names it); none read: look again with backoff for
  ``RetryBudget.read_patience_s``, then ask an operator with every reason;
* in-flight retry budget: an unread survivor adds no queue headroom (its queue is unknown);
* admission keeper: the backlog and served rate are those of the survivors read (the capacity
  counted on never drops below the estimate for it);
* capacity guard (``fleet.capacity.recovery_guard``): an unread group counts for the group floor,
  at the mean rate of those read in both capacity and demand;
* ramp: a replica not read is left out of that step's weights (the gateway gives an unnamed host
  the mean weight);
* verification: an unread replica is not checked in that look; the verification looks again;
* scale-down drain (``fleet.scale_down.drain_progress``): an unread victim is never drained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from fleet.engine_metrics import EngineSnapshot
from fleet.gateway import RouterState
from fleet.pool import PoolSnapshot


class EngineHealth(StrEnum):
    OK = "ok"  # /health 200
    FAILING = "failing"  # /health 5xx (EngineDeadError -> 503)
    UNREACHABLE = "unreachable"  # connection refused / timed out
    UNKNOWN = "unknown"  # not probed


class EndpointConditions(BaseModel):
    """One endpoint of the Service's EndpointSlices. ``None`` follows Kubernetes' nil semantics."""

    model_config = ConfigDict(frozen=True)

    pod: str
    ready: bool | None = None  # nil = true
    serving: bool | None = None  # nil = true
    terminating: bool | None = None  # nil = false

    def routable(self, publish_not_ready: bool) -> bool:
        """Would a router following the slice send traffic here?

        Under ``publishNotReadyAddresses`` (e.g. LWS headless Services) ``ready`` is
        always true, so ``serving`` and ``terminating`` are what count.
        """
        if publish_not_ready:
            return self.serving is not False and self.terminating is not True
        return self.ready is not False


class PodObservation(BaseModel):
    """What the activities saw of one pod of a group."""

    model_config = ConfigDict(frozen=True)

    pod: str
    exists: bool = True
    phase: str = "Running"
    node: str | None = None
    deleting: bool = Field(default=False, description="metadata.deletionTimestamp set")
    pod_ready: bool = True
    containers_ready: bool = True
    waiting_reason: str | None = None
    terminated_reason: str | None = Field(default=None, description="Current or last termination reason")
    restart_count: int = 0
    status_reason: str | None = Field(default=None, description="status.reason, e.g. Evicted, NodeLost")
    engine_health: EngineHealth = EngineHealth.UNKNOWN
    engine_progressing: bool | None = Field(
        default=None, description="False = requests queued/running but no token advanced between two scrapes"
    )
    endpoint: EndpointConditions | None = Field(default=None, description="None = not in any EndpointSlice")


class WorkloadSelector(BaseModel):
    """A workload controller and the labels it selects its pods by (equality part)."""

    model_config = ConfigDict(frozen=True)

    kind: str
    name: str
    match_labels: dict[str, str] = Field(default_factory=dict)
    match_expression_keys: tuple[str, ...] = ()
    replicas: int | None = None

    def selects_on(self, label: str) -> bool:
        return label in self.match_labels or label in self.match_expression_keys


class PoolObservation(BaseModel):
    snapshot: PoolSnapshot
    pods: dict[str, PodObservation] = Field(default_factory=dict)
    pod_uids: dict[str, str] = Field(
        default_factory=dict, description="pod -> metadata.uid (a recreated pod differs)"
    )
    pod_nodes: dict[str, str] = Field(default_factory=dict)
    service_selector: dict[str, str] = Field(default_factory=dict)
    publish_not_ready: bool = False
    workloads: list[WorkloadSelector] = Field(default_factory=list)
    routed_pods: list[str] = Field(default_factory=list, description="Pods in the router's routing set")
    router: RouterState | None = None
    gateway_admitted_total: int | None = Field(
        None, description="The gateway's counter of requests past admission (first attempts), if it keeps one"
    )
    gateway_counted_at: float | None = Field(None, description="When that counter was read (epoch seconds)")
    engines: dict[str, EngineSnapshot] = Field(
        default_factory=dict, description="group id -> leader's scrape"
    )
    pending_pods: dict[str, str] = Field(
        default_factory=dict, description="Pending pod -> latest FailedScheduling message"
    )
    router_label: str = Field(description="The router-only label this pool routes by")
    router_label_value: str = "true"
    warnings: list[str] = Field(default_factory=list, description="Parts that could not be observed")
    unread_engines: dict[str, str] = Field(
        default_factory=dict,
        description="group id -> why its leader's engine could not be read in this look (it answered too "
        "late: slow, not dead); such a group has no entry in ``engines``",
    )

    def controllers_selecting(self, label: str) -> list[WorkloadSelector]:
        """Workload controllers whose selector uses ``label``: removing it would orphan their pods."""
        return [w for w in self.workloads if w.selects_on(label)]


class LookVerdict(StrEnum):
    PROCEED = "proceed"  # enough was read to decide on (perhaps not everything: the rest is named)
    LOOK_AGAIN = "look-again"  # nothing the step needs was read; there is still time to wait
    ASK_OPERATOR = "ask-operator"  # nothing read for as long as the step can wait


class PartialLook(BaseModel):
    """What a step does with one look of which some engines could not be read."""

    model_config = ConfigDict(frozen=True)

    verdict: LookVerdict
    read: tuple[str, ...] = Field(default=(), description="Groups whose engines answered")
    unread: dict[str, str] = Field(default_factory=dict, description="group id -> why it was not read")
    reason: str


def judge_partial_look(
    wanted: Iterable[str],
    unread: Mapping[str, str],
    *,
    waited_s: float,
    patience_s: float,
    what: str,
) -> PartialLook:
    """May a step decide on this look of ``wanted`` groups' engines, of which ``unread`` did not answer?

    * everything read, or nothing wanted: proceed;
    * some read, some not: proceed on those read - the step names the unread ones in its decision
      and never counts them as idle (no load) nor as dead (no capacity);
    * none read: look again while ``waited_s`` (since the step's first look) is under ``patience_s``
      (one slow pass never stops a recovery); past it, ask an operator, with every group's reason.
    """
    if patience_s < 0 or waited_s < 0:
        raise ValueError(f"waited_s and patience_s must be >= 0 (got {waited_s}, {patience_s})")
    want = sorted(set(wanted))
    missing = {g: unread[g] for g in want if g in unread}
    read = tuple(g for g in want if g not in missing)
    named = "; ".join(f"{g}: {why}" for g, why in missing.items())
    if not missing:
        return PartialLook(verdict=LookVerdict.PROCEED, read=read, reason=f"{what}: all {len(read)} read")
    if read:
        return PartialLook(
            verdict=LookVerdict.PROCEED,
            read=read,
            unread=missing,
            reason=f"{what}: deciding on the {len(read)} of {len(want)} read; not read ({named}): "
            "counted neither idle nor dead",
        )
    if waited_s < patience_s:
        return PartialLook(
            verdict=LookVerdict.LOOK_AGAIN,
            unread=missing,
            reason=f"{what}: none of {len(want)} read yet ({named}); looking again "
            f"({waited_s:.0f} of {patience_s:.0f} s waited)",
        )
    return PartialLook(
        verdict=LookVerdict.ASK_OPERATOR,
        unread=missing,
        reason=f"none of {len(want)} read in {waited_s:.0f} s ({named})",
    )
