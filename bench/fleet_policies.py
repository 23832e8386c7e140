"""How long fleetmend's pure decisions take on a large pool (they run inside workflow tasks).

    .venv/bin/python -m bench.fleet_policies [--groups 1000]

Prints the median wall time of each policy over a synthetic pool: N replica
groups (TP=4, 2 per 8-GPU node), spares, several revisions and NVLink domains.
Workflow tasks have a 10 s default timeout; these should be milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from fleet.capacity import Demand, GroupCapacity, check_capacity
from fleet.incident import PoolRef
from fleet.loss import LossEvent, correlate, size_loss
from fleet.placement import GroupShape, place_group
from fleet.pool import GroupRole, NodeInfo, PoolSnapshot, ReplicaGroup
from fleet.ramp import RampParams, RampPolicy, simulate_ramp
from fleet.shedding import SurvivorLoad, decide_shedding
from fleet.spares import pick_spares
from fleet.victims import GroupLoad, choose_victims
from fleet.vocabulary import NVLINK_DOMAIN_LABEL


def build(groups: int) -> PoolSnapshot:
    nodes = [
        NodeInfo(
            name=f"n{i}",
            labels={NVLINK_DOMAIN_LABEL: f"d{i // 8}"},
            gpu_allocatable=8,
            gpu_allocated=8 if i < groups // 2 else (i % 3) * 2,
        )
        for i in range(groups // 2 + groups // 4)
    ]
    out = []
    for i in range(groups):
        role = GroupRole.SPARE if i % 10 == 0 else GroupRole.SERVING
        out.append(
            ReplicaGroup(
                id=f"g{i}",
                model="llama-70b",
                revision=f"r{i % 3}",
                role=role,
                pods=(f"g{i}-0",),
                nodes=(f"n{i // 2}",),
                leader_pod=f"g{i}-0",
                gpus_per_pod=4,
                workload_name="llama",
            )
        )
    return PoolSnapshot(
        pool=PoolRef(namespace="llm", service="llama"), observed_at=0.0, groups=tuple(out), nodes=tuple(nodes)
    )


def timed(fn: Callable[[], object], repeat: int = 7) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=1000)
    args = parser.parse_args()
    snap = build(args.groups)
    lost = [g.id for g in snap.serving[:8]]
    loads = {
        g.id: GroupLoad(running=i % 17, waiting=i % 5, kv_usage=(i % 10) / 10)
        for i, g in enumerate(snap.groups)
    }
    survivors = [SurvivorLoad(group_id=g.id, waiting=1, running=8, kv_usage=0.5) for g in snap.serving[8:]]
    capacity = {g.id: GroupCapacity(tokens_per_s=2000, requests_per_s=20) for g in snap.serving}
    events = [
        LossEvent(group_id=g, revision="r1", nodes=snap.group(g).nodes, at=float(i))
        for i, g in enumerate(lost)
    ]
    cases: list[tuple[str, Callable[[], object]]] = [
        ("size_loss (8 lost)", lambda: size_loss(snap, lost)),
        ("correlate (8 events)", lambda: correlate(events, snap, 60.0)),
        ("decide_shedding", lambda: decide_shedding(1000.0, survivors, 160.0, 20.0)),
        ("pick_spares (8 lost)", lambda: pick_spares(snap, lost)),
        (
            "place_group 2x8 GPU in one domain",
            lambda: place_group(GroupShape(pods=2, gpus_per_pod=8), snap.nodes),
        ),
        ("check_capacity", lambda: check_capacity("x", capacity, lost, Demand(tokens_per_s=1e6))),
        (
            "choose_victims (remove 10%)",
            lambda: choose_victims(snap, target_groups=len(snap.serving) * 9 // 10, loads=loads),
        ),
        (
            "ramp model, default 600 s, both policies",
            lambda: [simulate_ramp(RampParams(), p) for p in RampPolicy],
        ),
    ]
    print(f"pool: {len(snap.groups)} replica groups ({len(snap.spares)} spares), {len(snap.nodes)} nodes")
    for name, fn in cases:
        print(f"{name:45s} {timed(fn):9.2f} ms")


if __name__ == "__main__":
    main()
