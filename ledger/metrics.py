"""Prometheus metrics of the ledger (exported by whichever process hosts the store)."""

from __future__ import annotations

from prometheus_client import Counter

PERFORMS = Counter(
    "fleetmend_ledger_perform_total",
    "perform() calls by effect kind and how they ended",
    ["kind", "outcome"],
)
FENCE_REJECTIONS = Counter(
    "fleetmend_ledger_fence_rejections_total",
    "Writes refused because the writer's lease had been taken over (zombie attempts blocked)",
    ["kind"],
)
PROBES = Counter(
    "fleetmend_ledger_probes_total",
    "Unknown outcomes resolved by probing the target, by whether the effect was found there",
    ["kind", "found"],
)
