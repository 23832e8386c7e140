"""What a planned scale-down is asked to do, and the pure decisions of its drain (DESIGN.md §4).

``ScaleDownInput`` is the start argument of ``PlannedScaleDown`` - from the CLI,
a Temporal Schedule or a test. ``drain_progress`` turns one scrape of the
victims' engines into "still streaming where", and ``deadline_choice`` says
what the procedure does when an operator does not answer at the drain
deadline: extend once by the original deadline, then keep asking.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.engine_metrics import EngineSnapshot
from fleet.incident import PoolRef
from fleet.recovery import RetryBudget

# Pods a scale-down is draining carry this annotation (value: the workflow id):
# the readiness keeper leaves their gate alone, so a drained replica never turns ready again.
DRAINING_ANNOTATION = "fleetmend.io/draining"


class ScaleDownInput(BaseModel):
    """One planned scale-down of a pool: to ``target_groups`` serving groups, or of named ``victims``."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    target_groups: int | None = Field(None, ge=0, description="Serving replica groups to keep")
    victims: list[str] | None = Field(None, description="Explicit victims: group ids or pod names")
    drain_deadline_s: float = Field(600.0, gt=0, description="How long the victims may take to drain")
    dry_run: bool = False
    warm_floor: int = Field(1, ge=0, description="Warm groups (serving or spare) that must remain")
    min_serving_groups: int = Field(1, ge=0, description="Capacity floor the guard protects")
    group_capacity_tokens_per_s: float | None = Field(
        None,
        gt=0,
        description="Tokens/s one warm group sustains (from load tests); None = the busiest group's "
        "current rate, a conservative lower bound",
    )
    capacity_headroom: float = Field(1.1, ge=1.0, description="Remaining capacity must exceed demand by this")
    poll_interval_s: float = Field(2.0, gt=0, description="Drain and termination polling interval")
    operator_timeout_s: float = Field(
        900.0,
        gt=0,
        description="How long to wait for an operator: at the drain deadline (then extend once by itself), "
        "and for an approval before anything was removed (then end, removing nothing)",
    )
    incident_poll_s: float = Field(5.0, gt=0, description="Re-check interval while yielding to an incident")
    incident_yield_max_s: float = Field(
        3600.0, gt=0, description="Give up (abort, with the reason) after yielding this long"
    )
    terminate_timeout_s: float = Field(600.0, gt=0, description="How long the victims may take to go away")
    verify_settle_s: float = Field(
        30.0,
        ge=0,
        description="How long the remaining groups may take to read ready and routed again after the "
        "termination (the gateway's health checks settling) before verification fails",
    )
    requested_by: str = Field("operator", max_length=200, description="Who asked (operator, schedule id)")
    retry: RetryBudget = Field(default_factory=RetryBudget)

    @model_validator(mode="after")
    def _one_way_to_name_victims(self) -> ScaleDownInput:
        if (self.target_groups is None) == (self.victims is None):
            raise ValueError(
                "give either target_groups (--to N) or explicit victims, not both and not neither"
            )
        if self.victims is not None and not self.victims:
            raise ValueError("victims: name at least one replica group or pod")
        return self


class DrainProgress(BaseModel):
    """The victims' in-flight requests at one look."""

    model_config = ConfigDict(frozen=True)

    running: dict[str, float] = Field(default_factory=dict)
    waiting: dict[str, float] = Field(default_factory=dict)
    unreachable: tuple[str, ...] = ()

    @property
    def in_flight(self) -> int:
        return int(sum(self.running.values()) + sum(self.waiting.values()))

    @property
    def drained(self) -> bool:
        return self.in_flight == 0

    def summary(self) -> str:
        busy = {p: int(self.running.get(p, 0) + self.waiting.get(p, 0)) for p in self.running}
        busy = {p: n for p, n in busy.items() if n}
        parts = [f"{p}: {n}" for p, n in sorted(busy.items())]
        text = f"{self.in_flight} request(s) in flight" + (f" ({', '.join(parts)})" if parts else "")
        if self.unreachable:
            text += f"; metrics unreachable on {', '.join(self.unreachable)} (counted as drained)"
        return text


def drain_progress(pods: list[str], scrapes: Mapping[str, EngineSnapshot]) -> DrainProgress:
    """Running + waiting per victim pod. A victim whose engine no longer answers holds nothing."""
    running = {p: scrapes[p].running for p in pods if p in scrapes}
    waiting = {p: scrapes[p].waiting for p in pods if p in scrapes}
    return DrainProgress(
        running=running, waiting=waiting, unreachable=tuple(p for p in pods if p not in scrapes)
    )


def deadline_choice(unanswered_asks: int) -> str:
    """At an unanswered deadline: extend once by the original deadline, then only ask again."""
    return "extend" if unanswered_asks == 0 else "ask-again"
