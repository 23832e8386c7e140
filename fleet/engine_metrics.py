"""What a replica's engine and a GPU node report, read from their Prometheus text.

* ``parse_engine_metrics(text)`` reads a vLLM ``/metrics`` page into an
  ``EngineSnapshot``: requests running and waiting, KV-cache usage, preemptions,
  the TTFT histogram, generation tokens and successful requests: what the
  procedures decide on, and no more (a snapshot of every engine travels in every
  look at a pool, through Temporal's history). It copes with
  all three metric-name eras of KV-cache usage (reference fleet-protocols §1.2):
  old ``vllm:gpu_cache_usage_perc`` only (<= v0.9.1), both names (v0.9.2-v0.10),
  new ``vllm:kv_cache_usage_perc`` only (>= v0.11). Under data parallelism a pod
  reports one series per ``engine`` label: counts are summed, KV usage is the
  mean over engines (each engine has its own cache), so 1.0 still means full.
* ``engine_rates(before, after, seconds)`` turns two snapshots into what the
  procedures decide on: requests/s, tokens/s, preemptions/s and the TTFT p99
  of the interval (not since process start).
* ``parse_dcgm_metrics(node, text)`` reads a DCGM-exporter page into
  ``NodeGpuTelemetry``: per GPU the last Xid, ECC and row-remap counters,
  temperature, thermal violation time, clock-event (throttle) reasons and
  NVLink error counters.

The models are plain pydantic and safe to import anywhere (workflows pass them
around); ``prometheus_client`` - the parser - is imported only inside the two
parse functions, which only activities call.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE_NEW = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"
# Prefix-cache counters (tokens): the new names from v0.10, the gpu_ ones before; both in between.
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
TTFT = "vllm:time_to_first_token_seconds"
_HISTOGRAMS = {TTFT: "ttft"}


class KvMetricEra(StrEnum):
    """Which KV-cache usage name(s) the engine exported."""

    OLD = "gpu_cache_usage_perc"
    BOTH = "both"
    NEW = "kv_cache_usage_perc"
    NONE = "none"


class HistogramBucket(BaseModel):
    model_config = ConfigDict(frozen=True)

    le: float  # finite upper bound
    count: float  # cumulative


class Histogram(BaseModel):
    """A cumulative Prometheus histogram, summed over label sets.

    Only finite buckets are kept; the ``+Inf`` bucket is ``count``. (Infinity has
    no JSON form, and these models travel through Temporal as JSON.)
    """

    model_config = ConfigDict(frozen=True)

    buckets: tuple[HistogramBucket, ...] = ()
    sum: float = 0.0
    count: float = 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile`` semantics (linear within a bucket); None without data."""
        return _bucket_quantile(q, [*((b.le, b.count) for b in self.buckets), (math.inf, self.count)])

    def minus(self, earlier: Histogram) -> Histogram:
        """Observations made between ``earlier`` and this one (a counter reset yields this one)."""
        prev = {b.le: b.count for b in earlier.buckets}
        if self.count < earlier.count:  # process restarted: counters began again
            return self
        return Histogram(
            buckets=tuple(
                HistogramBucket(le=b.le, count=max(0.0, b.count - prev.get(b.le, 0.0))) for b in self.buckets
            ),
            sum=max(0.0, self.sum - earlier.sum),
            count=self.count - earlier.count,
        )


def _bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    if not buckets or not 0.0 <= q <= 1.0:
        return None
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                # Above the highest finite bucket: Prometheus answers with that bucket's bound.
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return buckets[-1][0]


class EngineSnapshot(BaseModel):
    """One scrape of a vLLM engine's ``/metrics`` (all ``engine`` labels combined)."""

    model_config = ConfigDict(frozen=True)

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = Field(
        default=None, description="0..1; None when the engine exports neither name"
    )
    kv_era: KvMetricEra = KvMetricEra.NONE
    preemptions_total: float = 0.0
    generation_tokens_total: float = 0.0
    prompt_tokens_total: float = 0.0
    request_success_total: float = 0.0
    prefix_queries_total: float = Field(
        default=0.0, description="Prompt tokens looked up in the prefix cache"
    )
    prefix_hits_total: float = Field(default=0.0, description="Of those, tokens found cached")
    ttft: Histogram = Field(default_factory=Histogram)
    engines: int = Field(default=0, description="Distinct engine labels seen (data-parallel ranks)")
    model_names: tuple[str, ...] = ()

    @property
    def in_flight(self) -> float:
        return self.running + self.waiting

    @property
    def has_engine_data(self) -> bool:
        return self.engines > 0 or self.kv_era is not KvMetricEra.NONE


class EngineRates(BaseModel):
    """What an engine did between two scrapes."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    requests_per_s: float
    generation_tokens_per_s: float
    preemptions_per_s: float
    ttft_p99_s: float | None
    ttft_observations: float
    restarted: bool = False


def _counter_delta(before: float, after: float) -> tuple[float, bool]:
    if after < before:  # counter reset: the process restarted in between
        return after, True
    return after - before, False


def engine_rates(before: EngineSnapshot, after: EngineSnapshot, seconds: float) -> EngineRates:
    """Rates over the interval between two scrapes ``seconds`` apart (must be > 0)."""
    if not seconds > 0:
        raise ValueError(f"interval between scrapes must be > 0 s, got {seconds!r}")
    req, r1 = _counter_delta(before.request_success_total, after.request_success_total)
    tok, r2 = _counter_delta(before.generation_tokens_total, after.generation_tokens_total)
    pre, r3 = _counter_delta(before.preemptions_total, after.preemptions_total)
    window = after.ttft.minus(before.ttft)
    return EngineRates(
        seconds=seconds,
        requests_per_s=req / seconds,
        generation_tokens_per_s=tok / seconds,
        preemptions_per_s=pre / seconds,
        ttft_p99_s=window.quantile(0.99),
        ttft_observations=window.count,
        restarted=r1 or r2 or r3,
    )


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format."""


def _families(text: str):  # type: ignore[no-untyped-def]
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"not Prometheus text exposition format: {exc}") from exc


# The families ``parse_engine_metrics`` reads. A vLLM page carries many more (inter-token latency,
# request sizes, iteration tokens, ...), and prometheus_client's parser spends its time reading every
# label of every line it is given, so the page is cut to these families' lines first: a look at a
# pool reads every engine's page, and the cut halves what each costs.
_ENGINE_FAMILIES = frozenset(
    {
        RUNNING,
        WAITING,
        KV_USAGE_NEW,
        KV_USAGE_OLD,
        *(
            name.removesuffix("_total")
            for name in (PREEMPTIONS, GENERATION_TOKENS, PROMPT_TOKENS, REQUEST_SUCCESS)
        ),
        *(name.removesuffix("_total") for name in (*PREFIX_QUERIES, *PREFIX_HITS)),
        *_HISTOGRAMS,
    }
)
_SAMPLE_SUFFIXES = ("_total", "_created", "_bucket", "_sum", "_count")
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?=[{\s]|$)")


def _engine_lines(text: str) -> str:
    """The lines of ``text`` that belong to ``_ENGINE_FAMILIES`` (their samples, HELP and TYPE), and any
    line that is not a metric at all, which the parser then refuses as it would have."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            words = line.split(None, 3)
            if len(words) < 3 or words[1] not in ("HELP", "TYPE"):
                continue
            name = words[2]
        elif not line.strip():
            continue
        else:
            match = _METRIC_NAME.match(line)
            if match is None:
                kept.append(line)
                continue
            name = match.group(0)
        if name in _ENGINE_FAMILIES or any(
            name.endswith(s) and name[: -len(s)] in _ENGINE_FAMILIES for s in _SAMPLE_SUFFIXES
        ):
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_engine_metrics(text: str) -> EngineSnapshot:
    """Read a vLLM ``/metrics`` page. Unknown families are ignored; label order does not matter."""
    text = _engine_lines(text)
    sums: dict[str, float] = defaultdict(float)
    kv: dict[str, dict[str, float]] = {KV_USAGE_NEW: {}, KV_USAGE_OLD: {}}
    engines: set[str] = set()
    prefix: dict[str, dict[str, float]] = {n: {} for n in (*PREFIX_QUERIES, *PREFIX_HITS)}
    models: set[str] = set()
    hist_buckets: dict[str, dict[float, float]] = {h: defaultdict(float) for h in _HISTOGRAMS}
    hist_sum: dict[str, float] = dict.fromkeys(_HISTOGRAMS, 0.0)
    hist_count: dict[str, float] = dict.fromkeys(_HISTOGRAMS, 0.0)
    for family in _families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if not name.startswith("vllm:"):
                continue
            engine = labels.get("engine", "0")
            if "model_name" in labels:
                models.add(labels["model_name"])
            if name in (RUNNING, WAITING, PREEMPTIONS, GENERATION_TOKENS, PROMPT_TOKENS, REQUEST_SUCCESS):
                sums[name] += value
            elif name in PREFIX_QUERIES or name in PREFIX_HITS:
                prefix[name][engine] = value
                engines.add(engine)
            elif name in kv:
                kv[name][engine] = value
                engines.add(engine)
            else:
                base, _, suffix = name.rpartition("_")
                if base not in _HISTOGRAMS:
                    continue
                if suffix == "bucket":
                    le = float(labels["le"])
                    if math.isfinite(le):
                        hist_buckets[base][le] += value
                elif suffix == "sum":
                    hist_sum[base] += value
                elif suffix == "count":
                    hist_count[base] += value
    # Prefer the new name when both are exported (v0.9.2-v0.10 export the same value twice).
    new, old = kv[KV_USAGE_NEW], kv[KV_USAGE_OLD]
    era = {
        (True, True): KvMetricEra.BOTH,
        (True, False): KvMetricEra.NEW,
        (False, True): KvMetricEra.OLD,
        (False, False): KvMetricEra.NONE,
    }[(bool(new), bool(old))]
    chosen = new or old
    kv_usage = sum(chosen.values()) / len(chosen) if chosen else None
    return EngineSnapshot(
        running=sums[RUNNING],
        waiting=sums[WAITING],
        kv_usage=kv_usage,
        kv_era=era,
        preemptions_total=sums[PREEMPTIONS],
        generation_tokens_total=sums[GENERATION_TOKENS],
        prompt_tokens_total=sums[PROMPT_TOKENS],
        request_success_total=sums[REQUEST_SUCCESS],
        # When an engine exports both names they count the same tokens: prefer the new one.
        prefix_queries_total=sum((prefix[PREFIX_QUERIES[0]] or prefix[PREFIX_QUERIES[1]]).values()),
        prefix_hits_total=sum((prefix[PREFIX_HITS[0]] or prefix[PREFIX_HITS[1]]).values()),
        **{
            field: Histogram(
                buckets=tuple(
                    HistogramBucket(le=le, count=c) for le, c in sorted(hist_buckets[name].items())
                ),
                sum=hist_sum[name],
                count=hist_count[name],
            )
            for name, field in _HISTOGRAMS.items()
        },
        engines=len(engines),
        model_names=tuple(sorted(models)),
    )


# --- DCGM exporter -----------------------------------------------------------------------------

DCGM_XID = "DCGM_FI_DEV_XID_ERRORS"
DCGM_TEMP = "DCGM_FI_DEV_GPU_TEMP"
DCGM_CLOCK_THROTTLE = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # renamed CLOCK_EVENT_REASONS in newer DCGM
DCGM_CLOCK_EVENT = "DCGM_FI_DEV_CLOCK_EVENT_REASONS"
CLOCK_EVENT_SW_THERMAL = 0x20
CLOCK_EVENT_HW_THERMAL = 0x40
DCGM_THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"
DCGM_ECC_SBE_VOL = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
DCGM_ECC_DBE_VOL = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
DCGM_ECC_SBE_AGG = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
DCGM_ECC_DBE_AGG = "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"
DCGM_REMAP_UNCORRECTABLE = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
DCGM_REMAP_CORRECTABLE = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
DCGM_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
DCGM_NVLINK_CRC_FLIT = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
DCGM_NVLINK_CRC_DATA = "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"
DCGM_NVLINK_REPLAY = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
DCGM_NVLINK_RECOVERY = "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"

_GPU_FIELDS = {
    DCGM_TEMP: "temperature_c",
    DCGM_THERMAL_VIOLATION: "thermal_violation_us",
    DCGM_ECC_SBE_VOL: "ecc_sbe_volatile",
    DCGM_ECC_DBE_VOL: "ecc_dbe_volatile",
    DCGM_ECC_SBE_AGG: "ecc_sbe_aggregate",
    DCGM_ECC_DBE_AGG: "ecc_dbe_aggregate",
    DCGM_REMAP_UNCORRECTABLE: "remapped_rows_uncorrectable",
    DCGM_REMAP_CORRECTABLE: "remapped_rows_correctable",
    DCGM_REMAP_FAILURE: "row_remap_failure",
}
_NVLINK_FIELDS = (DCGM_NVLINK_CRC_FLIT, DCGM_NVLINK_CRC_DATA, DCGM_NVLINK_REPLAY, DCGM_NVLINK_RECOVERY)


class GpuTelemetry(BaseModel):
    """One GPU as the DCGM exporter reports it. Counters absent from the page stay None."""

    model_config = ConfigDict(frozen=True)

    gpu: str
    uuid: str | None = None
    model_name: str | None = None
    last_xid: int | None = Field(
        default=None, description="DCGM_FI_DEV_XID_ERRORS: the last Xid (0 = none); sticky"
    )
    xid_message: str | None = None
    temperature_c: float | None = None
    thermal_violation_us: float | None = None
    ecc_sbe_volatile: float | None = None
    ecc_dbe_volatile: float | None = None
    ecc_sbe_aggregate: float | None = None
    ecc_dbe_aggregate: float | None = None
    remapped_rows_uncorrectable: float | None = None
    remapped_rows_correctable: float | None = None
    row_remap_failure: float | None = None
    clock_event_reasons: int | None = Field(default=None, description="Clock throttle/event reason bitmask")
    nvlink_errors: float | None = Field(
        default=None, description="Sum of NVLink CRC/replay/recovery error counters"
    )


class NodeGpuTelemetry(BaseModel):
    """Every GPU of one node, from one DCGM-exporter scrape."""

    model_config = ConfigDict(frozen=True)

    node: str
    gpus: tuple[GpuTelemetry, ...] = ()

    @property
    def thermal_throttled(self) -> list[str]:
        """GPUs whose clocks are held down for temperature (software or hardware thermal slowdown)."""
        bits = CLOCK_EVENT_SW_THERMAL | CLOCK_EVENT_HW_THERMAL
        return [g.gpu for g in self.gpus if (g.clock_event_reasons or 0) & bits]

    @property
    def xids(self) -> dict[str, int]:
        """GPU -> last Xid, only GPUs that reported one."""
        return {g.gpu: g.last_xid for g in self.gpus if g.last_xid}


def parse_dcgm_metrics(node: str, text: str) -> NodeGpuTelemetry:
    """Read a DCGM-exporter page; GPUs are keyed by the ``gpu`` label (index)."""
    per_gpu: dict[str, dict[str, object]] = defaultdict(dict)
    for family in _families(text):
        for sample in family.samples:
            # DCGM declares counters named ..._TOTAL (upper case); the parser appends "_total" to those
            # samples, so read the family's own name.
            if sample.name not in (family.name, family.name + "_total"):
                continue
            name, labels, value = family.name, sample.labels, float(sample.value)
            if not name.startswith("DCGM_"):
                continue
            gpu = labels.get("gpu")
            if gpu is None:
                continue
            fields = per_gpu[gpu]
            if "UUID" in labels:
                fields.setdefault("uuid", labels["UUID"])
            if "modelName" in labels:
                fields.setdefault("model_name", labels["modelName"])
            if name == DCGM_XID:
                fields["last_xid"] = int(value)
                if labels.get("err_msg"):
                    fields["xid_message"] = labels["err_msg"]
            elif name in (DCGM_CLOCK_THROTTLE, DCGM_CLOCK_EVENT):
                fields["clock_event_reasons"] = int(value)
            elif name in _GPU_FIELDS:
                fields[_GPU_FIELDS[name]] = value
            elif name in _NVLINK_FIELDS:
                fields["nvlink_errors"] = float(fields.get("nvlink_errors") or 0.0) + value  # type: ignore[arg-type]
    gpus = tuple(
        GpuTelemetry(gpu=gpu, **fields)  # type: ignore[arg-type]
        for gpu, fields in sorted(per_gpu.items(), key=lambda kv: (len(kv[0]), kv[0]))
    )
    return NodeGpuTelemetry(node=node, gpus=gpus)
