"""Planned scale-down end to end: real Temporal dev server, real Postgres, the simulated fleet over HTTP
under streaming load, a real worker. Asserted as an SRE would check it: the users' streams, the
routing set, the pods, the gateway's request record, and the ledger against the world's action log.
The first two tests send every user request through a real Envoy that fleetmend configures (the
naive baseline too) and count cut streams from Envoy's access log."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.service import RPCError
from temporalio.worker import Replayer

from fleet.incident import scale_down_workflow_id
from fleet.recovery import OperatorAction, Phase
from fleet.search_attributes import FLEETMEND_KIND, FLEETMEND_PHASE
from tests.scale_down.support import (
    STREAMING,
    scale_down_input,
    start_scale_down,
    vllm_default_scenario,
)
from tests.support import (
    POOL,
    cli_env,
    decisions,
    execute_update,
    finish,
    load_reaches,
    posted,
    reconcile_with_world,
    routed,
    run_cli,
    status_of,
    wait_for_phase,
)
from worker.devstack.rig import fleet_rig
from worker.payloads import data_converter
from workflows.readiness_keeper import KeeperInput, KeeperStatus, ReadinessKeeper
from workflows.scale_down import PlannedScaleDown

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


async def _naive_baseline(client: Client, task_queue: str, ledger_url: str) -> int:
    """Delete two streaming pods directly (what `kubectl delete pod` / a plain scale-down does)."""
    async with fleet_rig(
        client,
        scenario=vllm_default_scenario(),
        database_url=ledger_url,
        task_queue=task_queue,
        run_worker=False,
    ) as rig:
        load = await rig.start_load(rate=16, duration_s=60, seed=5, **STREAMING)
        victims = (await rig.routing_set(POOL))[:2]
        await load_reaches(rig, pods=victims, in_flight=True)  # streams on both when they go
        core = rig.core
        for pod in victims:
            await asyncio.to_thread(core.delete_namespaced_pod, pod, POOL.namespace)
        # Envoy's access log and the users' own count each learn of the cuts in their own time: both waited for.
        # Envoy calls a stream cut once its response began (the first byte); a user whose stream was cut
        # before its first token counts a terminal error, not a truncated answer: every cut is one or the other.
        deadline = time.monotonic() + 10
        while True:
            cut = await rig.cut_streams(POOL, victims)
            report = await rig.load_report(load)
            if (cut and report["terminal_errors"] >= cut) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert report["terminal_errors"] >= cut, (report, cut)
        return cut


async def test_8_to_6_under_streaming_load_cuts_nothing_where_the_naive_way_cuts(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    naive_cut = await _naive_baseline(temporal_client, task_queue + "-naive", ledger_url)

    async with fleet_rig(
        temporal_client,
        scenario=vllm_default_scenario(),
        database_url=ledger_url,
        task_queue=task_queue,
    ) as rig:
        before = await rig.routing_set(POOL)
        assert len(before) == 8
        # The readiness keeper runs alongside: it must leave the victims' gates alone once they are claimed.
        keeper = await temporal_client.start_workflow(
            "ReadinessKeeper",
            KeeperInput(pool=POOL, interval_s=0.3),
            id=f"readiness-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        load = await rig.start_load(rate=16, duration_s=60, seed=5, **STREAMING)
        await load_reaches(rig, in_flight=True)  # whichever replicas go, streams are on them
        handle = await start_scale_down(
            temporal_client, rig, scale_down_input(), f"sd-{uuid.uuid4().hex[:8]}"
        )
        status = await finish(handle)
        kept = await keeper.query("status", result_type=KeeperStatus)
        await keeper.cancel()
        replayer = Replayer(workflows=[PlannedScaleDown, ReadinessKeeper], data_converter=data_converter)
        await replayer.replay_workflow(await handle.fetch_history())
        text = decisions(status)
        victims = status.figures["victims"]
        report = await rig.load_report(load)
        fleetmend_cut = await rig.cut_streams(POOL, victims)
        print(
            f"\nscale-down 8 -> 6 under streaming load (16 req/s, 100-300 tokens, shutdown timeout 0): "
            f"naive pod deletion cut {naive_cut} stream(s); fleetmend cut {fleetmend_cut} "
            f"({status.figures['victim_requests_completed']} victim requests completed, drain "
            f"{status.figures['drain_seconds']} s)"
        )

        assert status.phase == Phase.DONE, text
        assert status.verification is not None and status.verification.passed, text
        assert naive_cut > 0, "the baseline must show what fleetmend prevents"
        assert fleetmend_cut == 0 and status.figures["cut_streams"] == 0, text
        assert report["truncated_streams"] == 0, report
        # Every in-flight request of the victims completed on them.
        assert status.figures["victim_requests_completed"] > 0, text
        after = await rig.routing_set(POOL)
        assert len(after) == 6 and not set(victims) & set(after)
        pods = [
            p.metadata.name if p.metadata else ""
            for p in (await asyncio.to_thread(rig.core.list_namespaced_pod, POOL.namespace)).items
        ]
        assert len(pods) == 6 and not set(victims) & set(pods), pods
        # Lock the door first: gate false, router label off, deletion cost; then one absolute scale to 6.
        reconciled = await reconcile_with_world(rig, ledger_url)
        assert reconciled.duplicates == [] and reconciled.orphans == [], reconciled
        actions = [a for a in await rig.actions() if "fleetmend-worker" in a["client"]]
        paths = [a["path"] for a in actions]
        scale_at = [i for i, p in enumerate(paths) if p.endswith("/deployments/llama/scale")]
        assert len(scale_at) == 1, paths
        for pod in victims:
            gate_at = paths.index(f"/api/v1/namespaces/{POOL.namespace}/pods/{pod}/status")
            assert gate_at < scale_at[0], "the readiness gate goes false before anything is terminated"
        assert not [w for w in kept.recent_writes if w.pod in victims and w.ready], kept.recent_writes
        assert status.figures["stop_routing_seconds"] < 5
        described = await handle.describe()
        assert described.typed_search_attributes.get(FLEETMEND_PHASE) == Phase.DONE.value
        assert described.typed_search_attributes.get(FLEETMEND_KIND) == "scale-down"


async def test_drain_past_deadline_waits_for_the_operator_extend_then_accept_cut(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client,
        scenario=vllm_default_scenario(),
        database_url=ledger_url,
        task_queue=task_queue,
    ) as rig:
        # Long generations (40-50 s each) cannot drain within a 1.5 s deadline.
        await rig.start_load(
            rate=6, duration_s=60, seed=7, tiers={"standard": 1.0}, output_tokens=[1600, 2000]
        )
        await load_reaches(rig, requests=1, in_flight=True)
        inp = scale_down_input(target_groups=7, drain_deadline_s=1.5, operator_timeout_s=2.0)
        handle = await start_scale_down(temporal_client, rig, inp, f"sd-{uuid.uuid4().hex[:8]}")

        # Nothing to extend or cut before the deadline.
        await wait_for_phase(handle, Phase.DRAINING, 30)
        with pytest.raises(WorkflowUpdateFailedError):
            await execute_update(handle, "accept_cut", OperatorAction(operator="sre", reason="too early"))

        status = await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 30)
        assert status.awaiting and "in flight" in status.awaiting, status.awaiting
        in_flight = status.figures["in_flight_at_deadline"]
        assert in_flight > 0

        # No answer within the operator timeout: it extends once by itself, then asks again and keeps waiting.
        t0 = time.monotonic()
        await wait_for_phase(handle, Phase.DRAINING, 10)
        await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 10)
        status = await status_of(handle)
        assert "extending the drain once" in decisions(status), decisions(status)
        assert time.monotonic() - t0 >= 1.0

        # extend: the drain goes on for the extra time, then asks again.
        env = cli_env(temporal_client, task_queue)
        extended = await run_cli(
            env, "scale-down", "extend", handle.id, "--by", "3s", "--reason", "let them finish"
        )
        assert extended.exit_code == 0, extended.output
        t1 = time.monotonic()
        await wait_for_phase(handle, Phase.DRAINING, 10)
        await asyncio.sleep(0.5)
        # A cut needs a reason, and only at the deadline.
        with pytest.raises(WorkflowUpdateFailedError):
            await execute_update(handle, "accept_cut", OperatorAction(operator="sre", reason="x"))
        status = await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 20)
        assert time.monotonic() - t1 >= 2.5, "extend must wait the extra time"
        assert "drain extended by 3 s by" in decisions(status)
        refused = await run_cli(env, "scale-down", "accept-cut", handle.id, "--reason", "")
        assert refused.exit_code == 2 and "needs a reason" in refused.output, refused.output

        # accept-cut: terminate now; the cut streams are recorded in the report.
        accepted = await run_cli(
            env, "scale-down", "accept-cut", handle.id, "--reason", "maintenance window closes"
        )
        assert accepted.exit_code == 0, accepted.output
        status = await finish(handle)
        text = decisions(status)
        assert status.phase == Phase.DONE, text
        assert "(maintenance window closes): terminating with" in text
        cut = await rig.cut_streams(POOL, status.figures["victims"])
        assert cut > 0 and status.figures["cut_streams"] == cut, (cut, status.figures)
        assert len(status.figures["cut_request_ids"]) == min(cut, 50)
        assert status.verification is not None and status.verification.passed
        no_cut = next(c for c in status.verification.checks if c.name == "no cut stream")
        assert no_cut.observed == cut and "operator accepted" in str(no_cut.expected)
        await routed(rig, lambda pods: len(pods) == 7, "7 replicas")
        # The history (timeouts, Updates, extensions) replays deterministically: what a worker restart relies on.
        replayer = Replayer(workflows=[PlannedScaleDown], data_converter=data_converter)
        await replayer.replay_workflow(await handle.fetch_history())


async def test_dry_run_plans_everything_and_touches_nothing_and_operators_steer_it(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    async with fleet_rig(
        temporal_client, scenario=vllm_default_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        # Bad input is refused before anything happens, with what to do.
        with pytest.raises(ValueError, match="not both"):
            scale_down_input(victims=["llama-x"])
        bad = await start_scale_down(
            temporal_client,
            rig,
            scale_down_input(target_groups=None, victims=["no-such-pod"]),
            f"sd-{uuid.uuid4().hex[:8]}",
        )
        with pytest.raises(WorkflowFailureError) as failed:
            await bad.result()
        assert "neither a replica group nor a pod" in str(failed.value.cause)

        # An explicit victim, in dry-run: every effect recorded as planned, none performed.
        victim = (await rig.routing_set(POOL))[3]
        env = cli_env(temporal_client, task_queue)
        started = await run_cli(
            env,
            "scale-down",
            "start",
            "--pool",
            POOL.key,
            "--victim",
            victim,
            "--dry-run",
            "--drain-deadline",
            "30s",
        )
        assert started.exit_code == 0, started.output
        handle = temporal_client.get_workflow_handle(scale_down_workflow_id(POOL))
        status = await finish(handle)
        assert status.phase == Phase.DONE and status.dry_run, decisions(status)
        assert status.figures["victims"] == [victim]
        assert status.figures.get("effects_planned", 0) >= 4, status.figures
        assert not status.figures.get("effects_applied"), status.figures
        assert [a for a in await rig.actions() if "fleetmend-worker" in a["client"]] == []
        await routed(rig, lambda pods: len(pods) == 8, "all 8 replicas")

        # pause / abort: validated, recorded, honoured at the next step boundary; nothing removed.
        handle = await start_scale_down(
            temporal_client, rig, scale_down_input(target_groups=7), f"sd-{uuid.uuid4().hex[:8]}"
        )
        await execute_update(handle, "pause", OperatorAction(operator="sre", reason="hold on"))
        with pytest.raises(WorkflowUpdateFailedError):
            await execute_update(handle, "pause", OperatorAction(operator="sre", reason="again"))
        with pytest.raises(WorkflowUpdateFailedError):
            await execute_update(handle, "abort", OperatorAction(operator="sre", reason=""))
        await execute_update(handle, "abort", OperatorAction(operator="sre", reason="change freeze"))
        status = await finish(handle)
        assert status.phase == Phase.ABORTED, decisions(status)
        assert "abort requested by sre: change freeze" in decisions(status)
        with pytest.raises(RPCError, match="already completed"):
            await execute_update(handle, "resume", OperatorAction(operator="sre", reason="too late"))
        await routed(rig, lambda pods: len(pods) == 8, "all 8 replicas")

        # The capacity guard: the remaining groups could not carry today's demand -> stop and ask, with the
        # reason; nobody approves in time -> the scale-down ends having removed nothing.
        await rig.start_load(rate=8, duration_s=30, seed=9, **STREAMING)
        await load_reaches(rig, requests=1)
        tight = scale_down_input(target_groups=4, group_capacity_tokens_per_s=1.0, operator_timeout_s=2.0)
        handle = await start_scale_down(temporal_client, rig, tight, f"sd-{uuid.uuid4().hex[:8]}")
        asking = await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 30)
        assert asking.awaiting and asking.awaiting.startswith("refuse scale-down"), asking.awaiting
        assert "tokens/s < demand" in asking.awaiting
        status = await finish(handle)
        assert status.phase == Phase.ABORTED and "nothing was removed" in decisions(status), decisions(status)
        await routed(rig, lambda pods: len(pods) == 8, "all 8 replicas")


async def test_a_refused_scale_stops_the_terminate_step_and_retry_after_the_fix_completes(
    temporal_client: Client, task_queue: str, ledger_url: str
) -> None:
    """The drained victims are out of routing when the world refuses the scale (422 from an admission
    policy): the scale-down stops there and asks, says what was refused, and removes nothing until retry."""
    async with fleet_rig(
        temporal_client, scenario=vllm_default_scenario(), database_url=ledger_url, task_queue=task_queue
    ) as rig:
        load = await rig.start_load(rate=8, duration_s=60, seed=11, **STREAMING)
        await rig.refuse({"verbs": ["PATCH"], "path_contains": "/scale", "error": "422"})
        handle = await start_scale_down(
            temporal_client, rig, scale_down_input(target_groups=7), f"sd-{uuid.uuid4().hex[:8]}"
        )
        waiting = await wait_for_phase(handle, Phase.AWAITING_OPERATOR, 60)
        assert waiting.refusal is not None, decisions(waiting)
        assert "scale" in waiting.refusal.what and "Invalid" in waiting.refusal.error, waiting.refusal
        await posted(rig, "waits for an operator")  # the phase is entered just before the post goes out
        # Nothing was removed: the pods are all still there, only the victim is out of routing.
        victims = waiting.figures["victims"]
        pods = {
            p.metadata.name
            for p in (await asyncio.to_thread(rig.core.list_namespaced_pod, POOL.namespace)).items
        }
        assert set(victims) <= pods, (victims, pods)  # a Deployment's group id is its pod's name
        with pytest.raises(WorkflowUpdateFailedError) as no_reason:
            await execute_update(handle, "skip", OperatorAction(operator="sre", reason=""))
        assert "needs a reason" in str(no_reason.value.cause)
        await rig.refuse()
        await execute_update(handle, "retry", OperatorAction(operator="sre", reason="policy exempted"))
        status = await finish(handle)
        assert status.phase == Phase.DONE, decisions(status)
        assert status.verification is not None and status.verification.passed, decisions(status)
        assert status.figures["cut_streams"] == 0
        await routed(rig, lambda pods: len(pods) == 7, "7 replicas")
        report = await reconcile_with_world(rig, ledger_url)
        assert report.duplicates == [] and report.orphans == [], report
        users = await rig.load_report(load)
        assert users["truncated_streams"] == 0, users
