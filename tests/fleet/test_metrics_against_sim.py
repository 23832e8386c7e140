"""Contract check: fleetmend's parsers read the simulated fleet's pages (vLLM in three eras, DCGM)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleet.engine_metrics import KvMetricEra, parse_dcgm_metrics, parse_engine_metrics
from fleet.triage import FaultClass, triage_node
from sim.serving.telemetry import CLOCK_EVENT_HW_THERMAL, NodeTelemetry, render_dcgm
from sim.serving.vllm_metrics import MetricsEra, VllmMetrics


@pytest.mark.parametrize(
    "era,expected",
    [
        (MetricsEra.LEGACY, KvMetricEra.OLD),
        (MetricsEra.BOTH, KvMetricEra.BOTH),
        (MetricsEra.CURRENT, KvMetricEra.NEW),
    ],
)
def test_sim_vllm_page_in_every_era(era: MetricsEra, expected: KvMetricEra) -> None:
    m = VllmMetrics("llama", era)
    m.first_token(0.2, 0.01)
    m.tokens_generated(5, 0.02)
    m.preempted()
    m.request_finished("stop", 1.0)
    snap = parse_engine_metrics(m.render(3, 2, 0.91).decode())
    assert (snap.running, snap.waiting, snap.kv_usage, snap.kv_era) == (
        3.0,
        2.0,
        pytest.approx(0.91),
        expected,
    )
    assert (snap.preemptions_total, snap.generation_tokens_total, snap.request_success_total) == (
        1.0,
        5.0,
        1.0,
    )
    assert snap.ttft.count == 1.0
    # The page's other histograms (fleetmend's snapshot leaves them out) are vLLM's too.
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(m.render(3, 2, 0.91).decode())
        for s in family.samples
    }
    assert samples["vllm:e2e_request_latency_seconds_count"] == 1.0
    assert samples["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(1.0)
    assert samples["vllm:request_queue_time_seconds_count"] == 1.0
    assert samples["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.01)


def test_sim_dcgm_page_drives_triage() -> None:
    tel = NodeTelemetry.for_node("gpu-1", 4, "NVIDIA H100 80GB HBM3")
    tel.gpus[2].last_xid = 79
    tel.gpus[3].ecc_dbe_vol = 2
    parsed = parse_dcgm_metrics("gpu-1", render_dcgm(tel, {}, {}, now=0.0).decode())
    assert parsed.xids == {"2": 79}
    assert parsed.gpus[3].ecc_dbe_volatile == 2
    assert triage_node("gpu-1", now=0, telemetry=parsed).fault_class is FaultClass.XID_ECC

    hot = NodeTelemetry.for_node("gpu-2", 2, "NVIDIA H100 80GB HBM3")
    hot.gpus[0].clock_events = CLOCK_EVENT_HW_THERMAL
    hot.gpus[0].temp_c = 80.0  # under the temperature limit: the clock-event reason tells
    parsed = parse_dcgm_metrics("gpu-2", render_dcgm(hot, {}, {}, now=0.0).decode())
    assert parsed.thermal_throttled == ["0"]
    assert triage_node("gpu-2", now=0, telemetry=parsed).fault_class is FaultClass.THERMAL
