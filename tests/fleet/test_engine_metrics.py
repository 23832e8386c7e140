"""Reading vLLM and DCGM metrics pages the way fleetmend's activities do."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.engine_metrics import (
    EngineSnapshot,
    KvMetricEra,
    MetricsParseError,
    engine_rates,
    parse_dcgm_metrics,
    parse_engine_metrics,
)

SAMPLE = (Path(__file__).parent / "vllm_v1_metrics_sample.txt").read_text()
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


def vllm_page(
    era: str,
    engines: dict[str, dict[str, float]],
    ttft: dict[str, list[float]] | None = None,
) -> str:
    """A /metrics page produced by prometheus_client itself, as vLLM does, for one name era."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels, registry=reg)
    kv_new = (
        Gauge("vllm:kv_cache_usage_perc", "KV.", labels, registry=reg) if era in ("new", "both") else None
    )
    kv_old = (
        Gauge("vllm:gpu_cache_usage_perc", "KV old.", labels, registry=reg)
        if era in ("old", "both")
        else None
    )
    pre = Counter("vllm:num_preemptions", "Preemptions.", labels, registry=reg)
    tokens = Counter("vllm:generation_tokens", "Tokens.", labels, registry=reg)
    success = Counter("vllm:request_success", "Success.", [*labels, "finished_reason"], registry=reg)
    hist = Histogram("vllm:time_to_first_token_seconds", "TTFT.", labels, buckets=TTFT_BUCKETS, registry=reg)
    for engine, f in engines.items():
        running.labels(MODEL, engine).set(f.get("running", 0))
        waiting.labels(MODEL, engine).set(f.get("waiting", 0))
        if kv_new is not None:
            kv_new.labels(MODEL, engine).set(f.get("kv", 0))
        if kv_old is not None:
            kv_old.labels(MODEL, engine).set(f.get("kv_old", f.get("kv", 0)))
        pre.labels(MODEL, engine).inc(f.get("preemptions", 0))
        tokens.labels(MODEL, engine).inc(f.get("tokens", 0))
        success.labels(MODEL, engine, "stop").inc(f.get("success", 0))
        success.labels(MODEL, engine, "length").inc(1)
        for value in (ttft or {}).get(engine, []):
            hist.labels(MODEL, engine).observe(value)
    return generate_latest(reg).decode()


def test_reads_the_reference_v1_sample() -> None:
    snap = parse_engine_metrics(SAMPLE)
    assert (snap.running, snap.waiting) == (8.0, 2.0)
    assert snap.kv_usage == pytest.approx(0.4213)
    assert snap.kv_era is KvMetricEra.NEW
    assert snap.request_success_total == 140.0  # stop + length + abort
    assert snap.generation_tokens_total == 27453.0
    assert snap.ttft.count == 5.0 and snap.ttft.sum == 1.25
    assert snap.ttft.quantile(0.5) == pytest.approx(0.07)
    assert "e2e" not in EngineSnapshot.model_fields  # read by no decision: not carried through Temporal
    assert snap.model_names == (MODEL,)
    assert snap.engines == 1


@pytest.mark.parametrize(
    "era,expected", [("old", KvMetricEra.OLD), ("both", KvMetricEra.BOTH), ("new", KvMetricEra.NEW)]
)
def test_all_three_kv_metric_eras(era: str, expected: KvMetricEra) -> None:
    snap = parse_engine_metrics(vllm_page(era, {"0": {"running": 3, "waiting": 1, "kv": 0.97}}))
    assert snap.kv_era is expected
    assert snap.kv_usage == pytest.approx(0.97)
    assert (snap.running, snap.waiting) == (3.0, 1.0)


def test_new_name_wins_when_both_are_exported() -> None:
    snap = parse_engine_metrics(vllm_page("both", {"0": {"kv": 0.5, "kv_old": 0.9}}))
    assert snap.kv_usage == pytest.approx(0.5)


def test_data_parallel_engines_are_summed_and_kv_averaged() -> None:
    page = vllm_page(
        "new",
        {
            "0": {"running": 4, "waiting": 2, "kv": 0.6, "preemptions": 3, "tokens": 100, "success": 10},
            "1": {"running": 6, "waiting": 1, "kv": 0.8, "preemptions": 1, "tokens": 50, "success": 5},
        },
        ttft={"0": [0.05, 0.05], "1": [0.3]},
    )
    snap = parse_engine_metrics(page)
    assert snap.engines == 2
    assert (snap.running, snap.waiting, snap.preemptions_total) == (10.0, 3.0, 4.0)
    assert snap.kv_usage == pytest.approx(0.7)
    assert snap.generation_tokens_total == 150.0
    assert snap.request_success_total == 17.0  # 10 + 5 stop, 1 + 1 length
    assert snap.ttft.count == 3.0


def test_label_order_does_not_matter() -> None:
    page = (
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m",engine="0"} 4.0\n'
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.98\n'
    )
    snap = parse_engine_metrics(page)
    assert snap.waiting == 4.0 and snap.kv_usage == pytest.approx(0.98) and snap.kv_era is KvMetricEra.OLD


def test_page_without_engine_metrics() -> None:
    snap = parse_engine_metrics("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n")
    assert snap.kv_usage is None and snap.kv_era is KvMetricEra.NONE and not snap.has_engine_data


def test_not_prometheus_text_is_a_clear_error() -> None:
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_engine_metrics("<html>502 Bad Gateway</html>\n")


def test_rates_between_two_scrapes_use_only_the_interval() -> None:
    before = parse_engine_metrics(
        vllm_page("new", {"0": {"tokens": 1000, "success": 10, "preemptions": 2}}, ttft={"0": [5.0] * 50})
    )
    after = parse_engine_metrics(
        vllm_page(
            "new",
            {"0": {"tokens": 3000, "success": 30, "preemptions": 2}},
            ttft={"0": [5.0] * 50 + [0.03] * 100},
        )
    )
    rates = engine_rates(before, after, seconds=10.0)
    assert rates.generation_tokens_per_s == pytest.approx(200.0)
    assert rates.requests_per_s == pytest.approx(2.0)
    assert rates.preemptions_per_s == 0.0
    assert rates.ttft_observations == 100
    assert (
        rates.ttft_p99_s is not None and rates.ttft_p99_s <= 0.04
    )  # the old 5 s TTFTs are not in the window
    assert not rates.restarted


def test_counter_reset_means_the_engine_restarted() -> None:
    before = EngineSnapshot(generation_tokens_total=5000, request_success_total=50)
    after = EngineSnapshot(generation_tokens_total=300, request_success_total=3)
    rates = engine_rates(before, after, seconds=3.0)
    assert rates.restarted and rates.generation_tokens_per_s == pytest.approx(100.0)
    with pytest.raises(ValueError):
        engine_rates(before, after, seconds=0)


def test_snapshot_survives_a_json_round_trip() -> None:
    snap = parse_engine_metrics(SAMPLE)
    assert EngineSnapshot.model_validate_json(snap.model_dump_json()) == snap


DCGM = """\
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-a",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-7",err_code="0",err_msg=""} 0
DCGM_FI_DEV_XID_ERRORS{gpu="3",UUID="GPU-d",device="nvidia3",modelName="NVIDIA H100 80GB HBM3",Hostname="gpu-7",err_code="79",err_msg="GPU has fallen off the bus"} 79
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a"} 41
DCGM_FI_DEV_GPU_TEMP{gpu="3",UUID="GPU-d"} 44
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="3",UUID="GPU-d"} 2
# TYPE DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS counter
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{gpu="3",UUID="GPU-d"} 1
# TYPE DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL counter
DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{gpu="0",UUID="GPU-a"} 5
DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL{gpu="0",UUID="GPU-a"} 7
"""


def test_dcgm_page_per_gpu() -> None:
    tel = parse_dcgm_metrics("gpu-7", DCGM)
    assert tel.node == "gpu-7"
    assert [g.gpu for g in tel.gpus] == ["0", "3"]
    assert tel.xids == {"3": 79}
    gpu3 = tel.gpus[1]
    assert gpu3.uuid == "GPU-d" and gpu3.model_name == "NVIDIA H100 80GB HBM3"
    assert gpu3.xid_message == "GPU has fallen off the bus"
    assert gpu3.ecc_dbe_volatile == 2 and gpu3.remapped_rows_uncorrectable == 1
    assert tel.gpus[0].nvlink_errors == 12 and tel.gpus[0].temperature_c == 41
    assert tel.gpus[0].ecc_dbe_volatile is None  # not exported: unknown, not zero
