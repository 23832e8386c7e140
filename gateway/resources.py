"""Envoy resources for one snapshot of the fleet: pure functions from pools to xDS JSON.

Each function returns the resource in Envoy's v3 JSON form (what ``/config_dump`` shows), so the
rendering is readable, testable without Envoy, and turned into protobuf only at the wire
(``gateway.server``). Names: the cluster and the endpoint assignment of pool ``ns/svc`` are both
called ``ns/svc``; the one route configuration is ``ROUTE_CONFIG_NAME``.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from fleet.gateway import GatewayPolicy
from fleet.vocabulary import SHED_ORDER, TIER_HEADER, Tier

ROUTE_CONFIG_NAME = "fleetmend"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
# A retry goes to a host the request has not tried yet (Envoy's previous_hosts retry host predicate).
PREVIOUS_HOSTS_PREDICATE = "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# Response header naming the engine that served the request (Envoy fills it in).
UPSTREAM_HEADER = "x-fleetmend-upstream"
# Ramp weights are floats; Envoy's load_balancing_weight is an integer >= 1.
WEIGHT_SCALE = 100
# A shed tier is answered 429 Too Many Requests + Retry-After: a client tells "fleetmend refused this
# tier for now" from Envoy's own 503 (no healthy upstream, circuit breaker overflow).
SHED_STATUS = 429


class RoutedHost(BaseModel):
    """One engine the pool routes to: a ready EndpointSlice endpoint whose pod carries the router label."""

    model_config = ConfigDict(frozen=True)

    pod: str
    address: str
    port: int
    node: str | None = None


class PoolSnapshot(BaseModel):
    """Everything Envoy needs about one pool at one moment."""

    model_config = ConfigDict(frozen=True)

    pool: str = Field(description="namespace/service")
    hosts: tuple[RoutedHost, ...] = ()
    policy: GatewayPolicy = Field(default_factory=GatewayPolicy)


class DataPlaneSettings(BaseModel):
    """How Envoy itself watches the engines (the data plane reacts before any alert fires)."""

    model_config = ConfigDict(frozen=True)

    health_check_interval_s: float = Field(default=0.5, gt=0)
    health_check_timeout_s: float = Field(default=0.5, gt=0)
    unhealthy_threshold: int = Field(default=2, ge=1)
    healthy_threshold: int = Field(default=1, ge=1)
    consecutive_gateway_failure: int = Field(default=2, ge=1)
    outlier_interval_s: float = Field(default=1.0, gt=0)
    base_ejection_s: float = Field(default=10.0, gt=0)
    max_ejection_percent: int = Field(default=50, ge=0, le=100)
    connect_timeout_s: float = Field(default=1.0, gt=0)
    retry_after_s: int = Field(default=2, ge=0, description="Retry-After on a shed request")
    # Envoy closes an idle connection to an engine before the engine would: vLLM's API server (uvicorn)
    # closes one after VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default, and a request Envoy sends on a
    # connection the engine is closing at that moment is reset before any response (503 UC). Envoy's
    # default is an hour. Keep it below the engines' keep-alive.
    upstream_idle_timeout_s: float = Field(default=4.0, gt=0)
    # Envoy's own time-based ramp for a new host (the peer baseline for step 9); off by default
    # because fleetmend's ramp sets measured-rate weights instead.
    slow_start_window_s: float | None = Field(default=None, gt=0)
    # How Envoy picks an engine: least request (fleetmend's default; a survivor whose batch grew is
    # left to drain) or round robin (an equal share each, what a plain Service or router gives: the
    # baseline of the runbook's "equal share makes a cold replica late").
    balancing: Literal["least-request", "round-robin"] = "least-request"


def duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def envoy_weight(weight: float) -> int:
    return max(1, math.ceil(weight * WEIGHT_SCALE - 1e-9))


def host_weights(snapshot: PoolSnapshot) -> dict[str, float]:
    """The weight of every routed host: the policy's, or the mean of the named ones for a new host."""
    named = [w for pod, w in snapshot.policy.weights.items() if any(h.pod == pod for h in snapshot.hosts)]
    default = sum(named) / len(named) if named else 1.0
    return {h.pod: snapshot.policy.weights.get(h.pod, default) for h in snapshot.hosts}


def cluster(snapshot: PoolSnapshot, dp: DataPlaneSettings) -> dict[str, object]:
    policy = snapshot.policy
    thresholds: dict[str, object] = {"priority": "DEFAULT"}
    if policy.retry.retry_before_first_byte:
        thresholds["retry_budget"] = {
            "budget_percent": {"value": round(policy.retry.budget_fraction * 100, 3)},
            # Envoy's own default floor: the burst of refused connections at the moment a host
            # dies is retried even while the budget's share of few active requests rounds to 0-1.
            "min_retry_concurrency": 3,
        }
    else:
        thresholds["max_retries"] = 0
    if policy.admission.queue_bound is not None:
        # The per-replica queue bound, pooled: requests waiting in Envoy for an engine connection.
        thresholds["max_pending_requests"] = max(
            1, policy.admission.queue_bound * max(1, len(snapshot.hosts))
        )
    out: dict[str, object] = {
        "name": snapshot.pool,
        "type": "EDS",
        "eds_cluster_config": {"eds_config": {"ads": {}, "resource_api_version": "V3"}},
        "connect_timeout": duration(dp.connect_timeout_s),
        "typed_extension_protocol_options": {
            HTTP_PROTOCOL_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_PROTOCOL_OPTIONS}",
                "common_http_protocol_options": {"idle_timeout": duration(dp.upstream_idle_timeout_s)},
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        # Least request: with equal weights, the fewer active requests of two random hosts (P2C); a
        # host with the most active requests is picked only when both draws land on it. Under
        # a capacity gap the survivors' grown batches drain onto a promoted spare or a replacement
        # instead of getting an equal share of new arrivals (a peak-demo run under round robin kept
        # 200 streams per survivor for 20 s while the spare beside them carried 40). With unequal
        # weights (a ramp) each pick scales a host's weight by 1 / (active + 1) (Envoy's
        # active_request_bias, default 1.0).
        "lb_policy": "LEAST_REQUEST" if dp.balancing == "least-request" else "ROUND_ROBIN",
        # A host fleetmend removed leaves at once, even while its health checks still pass.
        "ignore_health_on_host_removal": True,
        "health_checks": [
            {
                "timeout": duration(dp.health_check_timeout_s),
                "interval": duration(dp.health_check_interval_s),
                "no_traffic_interval": duration(dp.health_check_interval_s),
                "unhealthy_threshold": dp.unhealthy_threshold,
                "healthy_threshold": dp.healthy_threshold,
                "http_health_check": {"path": "/health"},
            }
        ],
        "outlier_detection": {
            "consecutive_gateway_failure": dp.consecutive_gateway_failure,
            "enforcing_consecutive_gateway_failure": 100,
            "interval": duration(dp.outlier_interval_s),
            "base_ejection_time": duration(dp.base_ejection_s),
            "max_ejection_percent": dp.max_ejection_percent,
        },
        "circuit_breakers": {"thresholds": [thresholds]},
    }
    if dp.slow_start_window_s is not None:
        lb_config = "least_request_lb_config" if dp.balancing == "least-request" else "round_robin_lb_config"
        out[lb_config] = {"slow_start_config": {"slow_start_window": duration(dp.slow_start_window_s)}}
    return out


def load_assignment(snapshot: PoolSnapshot) -> dict[str, object]:
    weights = host_weights(snapshot)
    return {
        "cluster_name": snapshot.pool,
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": h.address, "port_value": h.port}},
                            "hostname": h.pod,
                        },
                        "load_balancing_weight": envoy_weight(weights[h.pod]),
                        "metadata": {"filter_metadata": {"fleetmend": {"pod": h.pod, "node": h.node or ""}}},
                    }
                    for h in sorted(snapshot.hosts, key=lambda h: h.pod)
                ]
            }
        ],
    }


def pool_domains(pool: str) -> list[str]:
    """The names a request for the pool's Service may carry in Host (as cluster DNS spells them)."""
    namespace, _, service = pool.partition("/")
    base = f"{service}.{namespace}"
    return [base, f"{base}.svc", f"{base}.svc.cluster.local"]


def _tier_match(tier: Tier) -> dict[str, object]:
    return {"name": TIER_HEADER, "string_match": {"exact": tier.value}}


def _shed_route(snapshot: PoolSnapshot, tier: Tier, share: float, dp: DataPlaneSettings) -> dict[str, object]:
    match: dict[str, object] = {"prefix": "/", "headers": [_tier_match(tier)]}
    if share < 1.0:
        namespace, _, service = snapshot.pool.partition("/")
        match["runtime_fraction"] = {
            "default_value": {"numerator": round(share * 10_000), "denominator": "TEN_THOUSAND"},
            "runtime_key": f"fleetmend.shed.{namespace}.{service}.{tier.value}",
        }
    body = (
        '{"error":{"type":"shed","message":"the pool is shedding '
        f"{round(share * 100)}% of {tier.value} requests while it recovers capacity; retry after "
        f'{dp.retry_after_s} s"}}}}'
    )
    return {
        "name": f"shed-{tier.value}",
        "match": match,
        "direct_response": {"status": SHED_STATUS, "body": {"inline_string": body}},
        "response_headers_to_add": [
            {"header": {"key": "retry-after", "value": str(dp.retry_after_s)}},
            {"header": {"key": "content-type", "value": "application/json"}},
        ],
    }


def virtual_host(snapshot: PoolSnapshot, dp: DataPlaneSettings) -> dict[str, object]:
    admission, retry = snapshot.policy.admission, snapshot.policy.retry
    routes: list[dict[str, object]] = []
    for tier in SHED_ORDER:
        share = admission.shed_share(tier)
        if share > 0:
            routes.append(_shed_route(snapshot, tier, share, dp))
    forward: dict[str, object] = {"cluster": snapshot.pool, "timeout": "0s"}
    if retry.retry_before_first_byte and retry.max_attempts > 1:
        # Only failures before any response byte: Envoy never retries once headers went downstream.
        forward["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset-before-request",
            "num_retries": retry.max_attempts - 1,
            # Never the host that just refused: without this a weighted pick (a ramp gives the lost
            # replica's neighbours uneven weights) can hand the retry to the same dead host.
            "retry_host_predicate": [
                {
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {"@type": f"type.googleapis.com/{PREVIOUS_HOSTS_PREDICATE}"},
                }
            ],
            "host_selection_retry_max_attempts": "10",  # picks per retry before taking a tried host
            "retry_back_off": {
                "base_interval": duration(max(retry.backoff_base_s, 0.001)),
                "max_interval": duration(max(retry.backoff_max_s, retry.backoff_base_s, 0.001)),
            },
        }
    routes.append(
        {
            "name": "serve",
            "match": {"prefix": "/"},
            "route": forward,
            "response_headers_to_add": [
                {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"}}
            ],
        }
    )
    return {"name": snapshot.pool, "domains": pool_domains(snapshot.pool), "routes": routes}


def route_configuration(pools: list[PoolSnapshot], dp: DataPlaneSettings) -> dict[str, object]:
    return {
        "name": ROUTE_CONFIG_NAME,
        "virtual_hosts": [virtual_host(p, dp) for p in sorted(pools, key=lambda p: p.pool)],
    }
