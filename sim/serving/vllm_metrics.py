"""vLLM's Prometheus exposition for one simulated engine, era by era.

Built from real ``prometheus_client`` metric objects in a per-engine registry,
exactly as vLLM defines them (names, HELP text, ``model_name``/``engine``
labels, bucket edges, ``_total``/``_created``), so scrapes of the simulator are
byte-shaped like scrapes of a real server. A restarted engine gets a fresh
registry: its counters reset, as a real process restart does.

Three name eras exist in the wild (reference §1.2) and fleetmend must read all:

* ``legacy``  (<= v0.9.1): ``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
  ``vllm:time_per_output_token_seconds``;
* ``both``    (v0.9.2 - v0.10.x): old and new cache names side by side, TPOT only;
* ``current`` (>= v0.12): ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_*``,
  ``vllm:inter_token_latency_seconds``.
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort")

KV_USAGE_NEW = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
PREFIX_QUERIES_NEW = "vllm:prefix_cache_queries"
PREFIX_HITS_NEW = "vllm:prefix_cache_hits"
PREFIX_QUERIES_OLD = "vllm:gpu_prefix_cache_queries"
PREFIX_HITS_OLD = "vllm:gpu_prefix_cache_hits"
TPOT = "vllm:time_per_output_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


class MetricsEra(StrEnum):
    LEGACY = "legacy"
    BOTH = "both"
    CURRENT = "current"


def era_for_version(version: str) -> MetricsEra:
    """The metric-name era a vLLM release exposes by default (reference §1.2)."""
    try:
        parts = tuple(int(p) for p in version.split(".")[:3])
    except ValueError as exc:
        raise ValueError(
            f"vLLM version {version!r} is not of the form MAJOR.MINOR[.PATCH] (e.g. '0.10.2')"
        ) from exc
    if parts < (0, 9, 2):
        return MetricsEra.LEGACY
    if parts < (0, 11):
        return MetricsEra.BOTH
    return MetricsEra.CURRENT


def family_names(era: MetricsEra) -> set[str]:
    """The era-specific metric family names (as a parser reports them) an era exposes."""
    old = {KV_USAGE_OLD, PREFIX_QUERIES_OLD, PREFIX_HITS_OLD}
    new = {KV_USAGE_NEW, PREFIX_QUERIES_NEW, PREFIX_HITS_NEW}
    if era is MetricsEra.LEGACY:
        return old | {TPOT}
    if era is MetricsEra.BOTH:
        return old | new | {TPOT}
    return new | {ITL}


class VllmMetrics:
    """One engine process's metrics registry; the engine reports events, scrapes render text."""

    def __init__(self, model_name: str, era: MetricsEra, engine_index: str = "0") -> None:
        self.era = era
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name", "engine"]
        lv = {"model_name": model_name, "engine": engine_index}
        r = self.registry
        old = era in (MetricsEra.LEGACY, MetricsEra.BOTH)
        new = era in (MetricsEra.BOTH, MetricsEra.CURRENT)

        self._running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels, registry=r
        ).labels(**lv)
        self._waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels, registry=r
        ).labels(**lv)
        self._kv_usage = []
        if new:
            self._kv_usage.append(
                Gauge(KV_USAGE_NEW, "KV-cache usage. 1 means 100 percent usage.", labels, registry=r).labels(
                    **lv
                )
            )
        if old:
            help_old = "GPU KV-cache usage. 1 means 100 percent usage."
            if new:
                help_old += "DEPRECATED: Use vllm:kv_cache_usage_perc instead."
            self._kv_usage.append(Gauge(KV_USAGE_OLD, help_old, labels, registry=r).labels(**lv))
        self._preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", labels, registry=r
        ).labels(**lv)
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        ).labels(**lv)
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        ).labels(**lv)
        self._prefix_queries: list = []
        self._prefix_hits: list = []
        if new:
            self._prefix_queries.append(
                Counter(
                    PREFIX_QUERIES_NEW,
                    "Prefix cache queries, in terms of number of queried tokens.",
                    labels,
                    registry=r,
                ).labels(**lv)
            )
            self._prefix_hits.append(
                Counter(
                    PREFIX_HITS_NEW,
                    "Prefix cache hits, in terms of number of cached tokens.",
                    labels,
                    registry=r,
                ).labels(**lv)
            )
        if old:
            suffix = "DEPRECATED: Use vllm:prefix_cache_queries instead." if new else ""
            self._prefix_queries.append(
                Counter(
                    PREFIX_QUERIES_OLD,
                    "GPU prefix cache queries, in terms of number of queried tokens." + suffix,
                    labels,
                    registry=r,
                ).labels(**lv)
            )
            suffix = "DEPRECATED: Use vllm:prefix_cache_hits instead." if new else ""
            self._prefix_hits.append(
                Counter(
                    PREFIX_HITS_OLD,
                    "GPU prefix cache hits, in terms of number of cached tokens." + suffix,
                    labels,
                    registry=r,
                ).labels(**lv)
            )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self._success = {reason: success.labels(finished_reason=reason, **lv) for reason in FINISHED_REASONS}
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        ).labels(**lv)
        if era is MetricsEra.CURRENT:
            self._itl = Histogram(
                ITL, "Histogram of inter-token latency in seconds.", labels, buckets=ITL_BUCKETS, registry=r
            ).labels(**lv)
        else:
            self._itl = Histogram(
                TPOT,
                "Histogram of time per output token in seconds.",
                labels,
                buckets=ITL_BUCKETS,
                registry=r,
            ).labels(**lv)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(**lv)
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        ).labels(**lv)

    # Events the engine reports.
    def prompt_processed(self, tokens: int, cached_tokens: int) -> None:
        self._prompt_tokens.inc(tokens)
        for c in self._prefix_queries:
            c.inc(tokens)
        for c in self._prefix_hits:
            c.inc(cached_tokens)

    def first_token(self, ttft_s: float, queue_s: float) -> None:
        self._ttft.observe(ttft_s)
        self._queue_time.observe(queue_s)

    def tokens_generated(self, count: int, inter_token_s: float | None) -> None:
        """``inter_token_s`` is None for the first token (it counts, but has no inter-token gap)."""
        self._generation_tokens.inc(count)
        if inter_token_s is not None:
            for _ in range(count):
                self._itl.observe(inter_token_s)

    def preempted(self) -> None:
        self._preemptions.inc()

    def request_finished(self, reason: str, e2e_s: float) -> None:
        self._success[reason].inc()
        self._e2e.observe(e2e_s)

    def render(self, running: int, waiting: int, kv_usage: float) -> bytes:
        """Prometheus text of the engine's current state (what GET /metrics returns)."""
        self._running.set(running)
        self._waiting.set(waiting)
        for g in self._kv_usage:
            g.set(round(kv_usage, 4))
        return generate_latest(self.registry)
