"""What a replica-loss recovery observed of its own outcome, for the record and for step 10.

``in_flight_record`` says what happened to the lost replicas' requests (from
the gateway's journal), ``warm_groups_before`` the warm floor a recovery
restores, and ``recovery_observations`` gathers what step 10's verification
(``fleet.verification.verify_recovery``) checks: ready and serving groups, the
survivors' queues, preemptions and TTFT, the ledger and the failed nodes' quarantine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from fleet.gateway import JournalEntry, Outcome
from fleet.observation import PoolObservation
from fleet.service_rate import window_ttft_p99
from fleet.survivor_load import survivor_load
from fleet.verification import (
    LedgerReconcile,
    NodeQuarantine,
    RecoveryObservations,
    ReplicaObservation,
)
from fleet.vocabulary import QUARANTINE_LABEL, QUARANTINE_TAINT_KEY


def in_flight_record(journal: Iterable[JournalEntry], since: float) -> dict[str, Any]:
    """What happened to the lost replicas' requests, from the gateway's journal."""
    entries = [e for e in journal if e.ended_at >= since]
    counts = {o.value: 0 for o in Outcome}
    effect_ids: set[str] = set()
    for e in entries:
        counts[e.outcome.value] += 1
        effect_ids.update(e.effect_operation_ids)
    return {
        "attempts": len(entries),
        "retried": counts[Outcome.RETRIED.value],
        "terminal_errors": counts[Outcome.TERMINAL_ERROR.value],
        "completed": counts[Outcome.COMPLETED.value] + counts[Outcome.LATE.value],
        "truncated": sum(1 for e in entries if e.truncated),
        "effect_operation_ids": len(effect_ids),
    }


def warm_groups_before(initial: PoolObservation) -> int:
    """The warm floor a recovery restores: the ready groups (serving + spare) before the loss."""
    return len([g for g in initial.snapshot.groups if g.ready])


def recovery_observations(
    initial: PoolObservation,
    before: PoolObservation,
    after: PoolObservation,
    lost_ids: set[str],
    *,
    baseline_waiting: Mapping[str, float],
    quarantined: Iterable[str],
    reconcile: LedgerReconcile,
) -> RecoveryObservations:
    """What step 10's verification checks, from the pool before the loss and two scrapes now."""
    seconds = max(1e-3, after.snapshot.observed_at - before.snapshot.observed_at)
    target = len([g for g in initial.snapshot.serving if g.routed or g.id in lost_ids])
    serving_now = [g for g in after.snapshot.serving if g.id not in lost_ids or g.ready]
    routed_ready = [g for g in serving_now if g.ready and g.routed]
    # The routed endpoint is the group's leader (a Service may select only leaders).
    endpoint_ok = [
        g
        for g in routed_ready
        if (o := after.pods.get(g.leader_pod)) is not None
        and o.endpoint is not None
        and o.endpoint.serving is not False
        and o.endpoint.terminating is not True
    ]
    replicas = []
    for g in routed_ready:
        if g.id not in after.engines:
            continue
        now_e = after.engines[g.id]
        load = survivor_load(g.id, before.engines.get(g.id, now_e), now_e, seconds)
        replicas.append(
            ReplicaObservation(
                group_id=g.id,
                waiting=load.waiting,
                baseline_waiting=baseline_waiting.get(g.id, 0.0),
                preemptions_per_s=load.preemptions_per_s,
                ttft_p99_s=window_ttft_p99(before.engines.get(g.id), now_e),
            )
        )
    failed_nodes = {}
    for node in quarantined:
        info = after.snapshot.node(node)
        failed_nodes[node] = NodeQuarantine(
            cordoned=bool(info and info.unschedulable),
            tainted=bool(info and any(t.key == QUARANTINE_TAINT_KEY for t in info.taints)),
            labelled=bool(info and QUARANTINE_LABEL in info.labels),
        )
    return RecoveryObservations(
        target_groups=target,
        workload_ready_groups=len(routed_ready),
        endpoint_serving_groups=len(endpoint_ok),
        replicas=tuple(replicas),
        ledger=reconcile,
        warm_groups=sum(1 for g in after.snapshot.groups if g.ready),
        failed_nodes=failed_nodes,
    )
