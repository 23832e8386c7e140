"""Envoy's bootstrap for a fleetmend gateway: the static part a user deploys with their Envoy.

Static: the admin listener, the gateway listener (HTTP connection manager whose routes come from
fleetmend over ADS, a JSON access log of every request) and the cluster that reaches the control
plane. Everything else (one cluster, its endpoints and a virtual host per pool) is dynamic.
``fleetmend gateway bootstrap`` prints it; the dev stack writes it for the Envoy it starts.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fleet.vocabulary import TIER_HEADER
from gateway.resources import ROUTE_CONFIG_NAME

# The JSON access log's fields, for people reading Envoy's log (command operators, Envoy docs
# "Access logging"); fleetmend itself reads the same facts from the access-log service.
ACCESS_LOG_FORMAT: dict[str, str] = {
    "start_time": "%START_TIME(%s.%3f)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "authority": "%REQ(:AUTHORITY)%",
    "tier": f"%REQ({TIER_HEADER.upper()})%",
    "path": "%REQ(:PATH)%",
    "cluster": "%UPSTREAM_CLUSTER%",
    "upstream_host": "%UPSTREAM_HOST%",
    "upstream_host_name": "%UPSTREAM_HOST_NAME%",
    "response_code": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "bytes_sent": "%BYTES_SENT%",
    "duration_ms": "%DURATION%",
    "first_byte_ms": "%RESPONSE_DURATION%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "retry_after": "%RESP(RETRY-AFTER)%",
    "route": "%ROUTE_NAME%",
}


class BootstrapSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    node_id: str = Field(description="this Envoy's name in the control plane's ACK records")
    listen_address: str = "0.0.0.0"
    listen_port: int = 8080
    admin_address: str = "127.0.0.1"
    admin_port: int = 9901
    xds_host: str = Field(description="the control plane's address (a Service in a cluster)")
    xds_port: int = 18000
    access_log_path: str = "/dev/stdout"
    admin_url: str | None = Field(
        default=None, description="How fleetmend reaches this Envoy's admin (default: admin address:port)"
    )


def bootstrap(s: BootstrapSettings) -> dict[str, object]:
    ads = {"ads": {}, "resource_api_version": "V3"}
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "strip_any_host_port": True,
        "generate_request_id": True,
        "preserve_external_request_id": True,
        "rds": {"config_source": ads, "route_config_name": ROUTE_CONFIG_NAME},
        # Token streams are long: no stream idle cut while an engine is generating.
        "stream_idle_timeout": "300s",
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
        "access_log": [
            # Every request to the control plane's access-log service (fleetmend's in-flight record) ...
            {
                "name": "envoy.access_loggers.http_grpc",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                    "common_config": {
                        "log_name": "fleetmend",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "fleetmend_xds"}},
                        "transport_api_version": "V3",
                        "buffer_flush_interval": "0.2s",
                    },
                    "additional_request_headers_to_log": [TIER_HEADER],
                },
            },
            # ... and as JSON lines for people (stdout in a cluster).
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": s.access_log_path,
                    "log_format": {"json_format": ACCESS_LOG_FORMAT},
                },
            },
        ],
    }
    return {
        # The control plane records admin_url with this Envoy's ACKs; fleetmend reads host health there.
        "node": {
            "id": s.node_id,
            "cluster": "fleetmend-gateway",
            "metadata": {"admin_url": s.admin_url or f"http://{s.admin_address}:{s.admin_port}"},
        },
        "admin": {"address": {"socket_address": {"address": s.admin_address, "port_value": s.admin_port}}},
        "dynamic_resources": {
            "ads_config": {
                "api_type": "GRPC",
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": "fleetmend_xds"}}],
                "set_node_on_first_message_only": True,
            },
            "cds_config": ads,
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": s.listen_address, "port_value": s.listen_port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "fleetmend_xds",
                    "type": "STRICT_DNS",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "fleetmend_xds",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": s.xds_host,
                                                    "port_value": s.xds_port,
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        },
    }
