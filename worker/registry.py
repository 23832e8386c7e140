"""Which workflows and activities the fleetmend worker serves.

The single list the worker, tests and replay checks share: add a workflow class
to ``WORKFLOWS`` and its activities to ``build_activities`` and every worker
picks them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from activities.act import ActActivities
from activities.audit import AuditActivities
from activities.config import ActivityConfig
from activities.coordination import ask_breaker, incident_on_pool
from activities.deps import ActivityDeps
from activities.device_quarantine import DeviceActivities
from activities.drain import DrainActivities
from activities.observe import ObserveActivities
from activities.qualification import QualificationActivities
from activities.readiness import ReadinessActivities
from activities.smoke import smoke_probe
from ledger.store import EffectLedger
from worker.config import Settings
from workflows.breaker import RemovalBreaker
from workflows.fence import NodeFence
from workflows.fleet_event import FleetEvent
from workflows.incident import FleetIncident
from workflows.node_qualification import NodeQualification
from workflows.readiness_keeper import ReadinessKeeper
from workflows.replica_loss import ReplicaLossRecovery
from workflows.scale_down import PlannedScaleDown
from workflows.smoke import FleetmendSmoke

WORKFLOWS: list[type] = [
    FleetmendSmoke,
    FleetIncident,
    ReplicaLossRecovery,
    NodeQualification,
    NodeFence,
    FleetEvent,
    RemovalBreaker,
    PlannedScaleDown,
    ReadinessKeeper,
]


def _methods(obj: object) -> list[Callable[..., Any]]:
    """The bound ``@activity.defn`` methods of an activities object."""
    out = []
    for name in dir(type(obj)):
        member = getattr(type(obj), name)
        if callable(member) and hasattr(member, "__temporal_activity_definition"):
            out.append(getattr(obj, name))
    return out


def activity_config(settings: Settings) -> ActivityConfig:
    """The activities' view of the world, taken from the worker's settings (the one place that maps them)."""
    return ActivityConfig.model_validate(
        {name: getattr(settings, name) for name in ActivityConfig.model_fields}
    )


def build_activities(settings: Settings, database_url: str | None = None) -> list[Callable[..., Any]]:
    """The activity callables, bound to the clients ``settings`` describes.

    Without a ledger database only the smoke activity is served: every other
    activity may mutate the world and must go through the ledger.
    """
    url = database_url or settings.database_url_value()
    if not url:
        return [smoke_probe]
    deps = ActivityDeps(settings=activity_config(settings), ledger=EffectLedger(url))
    deps.warm_up()
    return [
        smoke_probe,
        *_methods(ObserveActivities(deps)),
        *_methods(ActActivities(deps)),
        *_methods(QualificationActivities(deps)),
        *_methods(DeviceActivities(deps)),
        *_methods(AuditActivities(deps)),
        *_methods(ReadinessActivities(deps)),
        *_methods(DrainActivities(deps)),
        incident_on_pool,
        ask_breaker,
    ]
