"""fleetmend's custom search attributes (registered by ``fleetmend dev``, checked by the worker).

An attribute the server does not know leaves a workflow stuck in Running
(DESIGN.md §6b), so this list is the single source the dev stack registers,
the worker verifies at start-up and docker-compose's setup job creates.
"""

from __future__ import annotations

from temporalio.common import SearchAttributeKey

FLEETMEND_KIND = SearchAttributeKey.for_keyword("FleetmendKind")
FLEETMEND_PHASE = SearchAttributeKey.for_keyword("FleetmendPhase")
FLEETMEND_NAMESPACE = SearchAttributeKey.for_keyword("FleetmendNamespace")
FLEETMEND_POOL = SearchAttributeKey.for_keyword("FleetmendPool")
FLEETMEND_REPLICA_GROUP = SearchAttributeKey.for_keyword("FleetmendReplicaGroup")
FLEETMEND_SEVERITY = SearchAttributeKey.for_keyword("FleetmendSeverity")
FLEETMEND_DRY_RUN = SearchAttributeKey.for_bool("FleetmendDryRun")

ALL_SEARCH_ATTRIBUTES: tuple[SearchAttributeKey, ...] = (
    FLEETMEND_KIND,
    FLEETMEND_PHASE,
    FLEETMEND_NAMESPACE,
    FLEETMEND_POOL,
    FLEETMEND_REPLICA_GROUP,
    FLEETMEND_SEVERITY,
    FLEETMEND_DRY_RUN,
)

# Names and types as the Temporal CLI spells them (--search-attribute Name=Type).
CLI_TYPE_NAMES: dict[str, str] = {
    "FleetmendKind": "Keyword",
    "FleetmendPhase": "Keyword",
    "FleetmendNamespace": "Keyword",
    "FleetmendPool": "Keyword",
    "FleetmendReplicaGroup": "Keyword",
    "FleetmendSeverity": "Keyword",
    "FleetmendDryRun": "Bool",
}
