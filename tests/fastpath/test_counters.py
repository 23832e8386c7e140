"""The fast path keeps each pool's admitted-requests counter for a few seconds, from the same
Envoy ``/stats`` answer it reads for health, so a loss it reports carries the arrivals from before
the loss. The traffic counters move with every request; they never make a cluster's health "moved"."""

from __future__ import annotations

import re

from worker.fastpath.envoy import STATS_FILTER, CounterHistory, cluster_figures, cluster_first_attempts


def _stats(total: int, retry: int, failures: int = 0) -> dict[str, object]:
    return {
        "stats": [
            {"name": "cluster.inference/llama.upstream_rq_total", "value": total},
            {"name": "cluster.inference/llama.upstream_rq_retry", "value": retry},
            {"name": "cluster.inference/llama.health_check.failure", "value": failures},
            {"name": "cluster.inference/llama.membership_total", "value": 5},
        ]
    }


def test_first_attempts_come_from_the_health_answer_and_leave_the_health_figures_alone() -> None:
    for name in ("cluster.inference/llama.upstream_rq_total", "cluster.inference/llama.upstream_rq_retry"):
        assert re.match(STATS_FILTER, name), name  # one /stats call carries both
    assert not re.match(STATS_FILTER, "cluster.inference/llama.upstream_rq_pending_total")
    assert cluster_first_attempts(_stats(1200, 15)) == {"inference/llama": 1185}
    # A thousand more requests do not move the cluster's health figures (no /clusters read).
    assert cluster_figures(_stats(1200, 15)) == cluster_figures(_stats(2200, 40))
    assert cluster_figures(_stats(1200, 15)) != cluster_figures(_stats(1200, 15, failures=1))


def test_the_history_keeps_a_reading_a_second_for_a_few_seconds_and_forgets_a_gone_pool() -> None:
    history = CounterHistory(keep_s=5.0, every_s=1.0)
    for step in range(41):  # every 0.25 s for 10 s, as the fast path reads Envoy
        at = 100.0 + step * 0.25
        history.record(at, {"inference/llama": 60 * step, "inference/other": 5 * step})
    kept = history.readings("inference/llama")
    assert [r.at for r in kept] == [105.0, 106.0, 107.0, 108.0, 109.0, 110.0]
    history.record(111.0, {"inference/llama": 60 * 45})
    assert history.readings("inference/other") == []


def test_a_change_in_the_set_of_envoys_starts_every_pools_history_anew() -> None:
    # A second Envoy joins with its own lifetime count: the sum jumps, and is no rate.
    history = CounterHistory(keep_s=30.0, every_s=1.0)
    one, two = (
        frozenset({"http://127.0.0.1:9901"}),
        frozenset({"http://127.0.0.1:9901", "http://127.0.0.1:9902"}),
    )
    for t in range(5):
        history.record(100.0 + t, {"inference/llama": 50 * t}, one)
    history.record(105.0, {"inference/llama": 250 + 90_000}, two)
    assert [r.total for r in history.readings("inference/llama")] == [90_250]
