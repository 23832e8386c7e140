"""What the worker verifies before it polls, each failure naming its fix.

A worker that starts against the wrong cluster, a missing namespace, an
unregistered search attribute (workflows would hang in Running, DESIGN.md §6b)
or an unmigrated ledger fails in the middle of an incident. These checks move
that failure to start-up, with one line that says what to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from fleet.search_attributes import CLI_TYPE_NAMES
from worker.config import Settings


class StartupCheckError(RuntimeError):
    """The worker must not start; the message says why and how to fix it."""


# CLI type names (as in fleet.search_attributes) -> server enum.
_INDEXED_TYPES: dict[str, int] = {
    "Text": IndexedValueType.INDEXED_VALUE_TYPE_TEXT,
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
    "Double": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE,
    "Bool": IndexedValueType.INDEXED_VALUE_TYPE_BOOL,
    "Datetime": IndexedValueType.INDEXED_VALUE_TYPE_DATETIME,
    "KeywordList": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST,
}


def unreachable_message(settings: Settings, error: BaseException) -> str:
    """One line: where fleetmend dialled, what failed, and the setting to fix (TLS ones named)."""
    from worker.temporal_client import TemporalSettingError, connection, handshake_hint

    try:
        conn = connection(settings)
    except TemporalSettingError as err:
        return str(err)
    cause = " ".join(str(error).split())[:400]
    hint = handshake_hint(conn, error)
    if hint:
        return f"cannot connect to Temporal at {conn.describe()}: {hint} ({cause})"
    return (
        f"cannot reach Temporal at {conn.describe()} ({cause}): start the embedded stack with "
        "`fleetmend dev`, or set FLEETMEND_TEMPORAL_ADDRESS (TEMPORAL_ADDRESS) to your cluster's "
        "frontend host:port"
    )


async def check_namespace(client: Client, namespace: str) -> None:
    try:
        await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise StartupCheckError(
                f"Temporal namespace {namespace!r} does not exist: create it with "
                f"`temporal operator namespace create --namespace {namespace}` "
                "or set FLEETMEND_TEMPORAL_NAMESPACE to an existing one"
            ) from err
        raise


def missing_search_attributes(registered: Mapping[str, int], wanted: Mapping[str, str]) -> dict[str, str]:
    """Attributes in ``wanted`` (name -> CLI type) absent from the server or registered with another type."""
    return {name: kind for name, kind in wanted.items() if registered.get(name) != _INDEXED_TYPES[kind]}


async def check_search_attributes(
    client: Client, namespace: str, wanted: Mapping[str, str] = CLI_TYPE_NAMES
) -> None:
    response = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=namespace)
    )
    missing = missing_search_attributes(dict(response.custom_attributes), wanted)
    if missing:
        commands = "; ".join(
            f"temporal operator search-attribute create --namespace {namespace} --name {name} --type {kind}"
            for name, kind in missing.items()
        )
        raise StartupCheckError(
            f"fleetmend search attributes missing (or of the wrong type) in namespace {namespace!r}: "
            f"{', '.join(missing)} — workflows would hang in Running. Register them: {commands}"
        )


async def check_ledger_at_head(database_url: str) -> None:
    from ledger.migrate import is_at_head  # the ledger package owns its migrations

    try:
        at_head = await asyncio.to_thread(is_at_head, database_url)
    except Exception as err:
        raise StartupCheckError(
            f"cannot read the ledger schema version ({type(err).__name__}: {err}): check that "
            "FLEETMEND_DATABASE_URL points at a reachable Postgres"
        ) from err
    if not at_head:
        raise StartupCheckError(
            "the ledger database schema is not at the latest migration: apply the migrations "
            "(`fleetmend dev` does it at start; elsewhere run `alembic upgrade head` with the ledger's alembic.ini)"
        )


async def run_startup_checks(client: Client, settings: Settings, *, database_url: str | None) -> None:
    """Namespace, search attributes, then (when a database URL is given) the ledger schema."""
    await check_namespace(client, settings.temporal_namespace)
    await check_search_attributes(client, settings.temporal_namespace)
    if database_url is not None:
        await check_ledger_at_head(database_url)
