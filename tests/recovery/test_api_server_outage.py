"""A GPU node is lost while the API server restarts: the operator still sees one incident, and it recovers.

The fleet-level counterpart of ``tests/fastpath/test_api_server_restart.py`` (which shows the
informers re-list and report a loss that happened while they could not watch): here the whole
product runs (the fast path as the worker runs it, Envoy, Temporal, the ledger) and the test reads
what an operator reads. The simulated API server restarts as a real one does (open watches broken,
connections refused for ``DOWN_S``, a fresh watch cache after); the node dies while it is down.
The loss is reported through whichever of the fast path's sources sees it first (Envoy's view of
the engines, or the re-listed watches), ``fleetmend status`` lists the pool's incident and its
recovery, and the recovery completes although its first looks may meet a refusing API server.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from temporalio.client import Client

from fleet.incident import incident_workflow_id
from fleet.recovery import Phase
from fleet.vocabulary import FaultKind
from tests.support import (
    FAST_PATH_SETTINGS,
    POOL,
    cli_env,
    decisions,
    finish,
    gpu_pool,
    load_reaches,
    run_cli,
    until,
    wait_for_child,
)
from worker.fastpath.service import FAST_PATH_ALERT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DOWN_S = 3.0
NODE = "gpu-node-0"


async def test_a_node_lost_while_the_api_server_is_down_opens_one_incident_the_operator_sees_and_it_recovers(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with gpu_pool(temporal_client, task_queue, ledger_url, **FAST_PATH_SETTINGS) as rig:
        async with rig.fast_path() as fast:
            await rig.start_load(rate=40, duration_s=90, seed=5)
            await load_reaches(rig)

            restarted = await rig.http.post("/sim/v1/api-server/restart", json={"down_s": DOWN_S})
            assert restarted.status_code == 202 and restarted.json()["serving"] is False, restarted.text
            assert (await rig.inject(FaultKind.NODE_LOST, NODE))["accepted"]

            async def api_server() -> dict[str, Any]:
                r = await rig.http.get("/sim/v1/api-server")
                r.raise_for_status()
                return dict(r.json())

            back = await until(
                api_server,
                lambda state: bool(state["serving"]),
                lambda state: f"the API server did not come back: {state}",
                timeout_s=DOWN_S + 15,
            )
            assert back["restarts"] == 1, back

            incident = temporal_client.get_workflow_handle(incident_workflow_id(POOL))
            child = await wait_for_child(temporal_client, incident, timeout_s=60)

            # What the operator reads: the pool's incident and its recovery, open, in `fleetmend status`.
            env = cli_env(temporal_client, task_queue)

            async def listed() -> dict[str, dict[str, Any]]:
                shown = await run_cli(env, "status", "--json")
                assert shown.exit_code == 0, shown.output
                return {r["workflow_id"]: r for r in json.loads(shown.output)}

            rows = await until(
                listed,
                lambda rows: incident.id in rows and child.id in rows,
                lambda rows: f"`fleetmend status` does not list {incident.id} and {child.id}: {rows}",
                timeout_s=30,
            )
            assert rows[incident.id]["pool"] == POOL.key and child.id in rows[incident.id]["children"], rows
            assert rows[child.id]["pool"] == POOL.key and rows[child.id]["phase"] not in (
                Phase.ABORTED.value,
                Phase.FAILED.value,
            ), rows[child.id]

            status = await finish(child)
        text = decisions(status)
        assert status.phase == Phase.DONE, text
        assert FAST_PATH_ALERT in text, text  # the fast path opened it, not a later alert
        assert fast.counts["reports_delivered"] >= 1, fast.counts
