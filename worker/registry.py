"""Which workflows and activities the fleetmend worker serves.

The single list the worker, tests and replay checks share: add a workflow class
to ``WORKFLOWS`` and its activities to ``build_activities`` and every worker
picks them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from activities.smoke import smoke_probe
from worker.config import Settings
from workflows.smoke import FleetmendSmoke

WORKFLOWS: list[type] = [FleetmendSmoke]


def build_activities(settings: Settings) -> list[Callable[..., Any]]:
    """The activity callables, bound to the clients ``settings`` describes."""
    return [smoke_probe]
