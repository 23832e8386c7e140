"""Kubernetes API access: the official ``kubernetes`` client, one per cluster address.

Activities, the gateway's control plane and the worker's alert intake and fast path
all build their APIs here. The client is synchronous, so every activity that uses it
is a plain ``def`` run by the worker's thread-pool ``activity_executor`` (DESIGN.md
§6b). One ``ApiClient`` per process and address: the client pools connections and is
thread-safe for requests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kubernetes import client, config

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_PLURAL = "leaderworkersets"
USER_AGENT = "fleetmend-worker/0.1"


@dataclass(frozen=True)
class KubeApis:
    core: client.CoreV1Api
    apps: client.AppsV1Api
    discovery: client.DiscoveryV1Api
    custom: client.CustomObjectsApi
    policy: client.PolicyV1Api
    batch: client.BatchV1Api
    resource: client.ResourceV1Api  # Dynamic Resource Allocation: ResourceSlices, claims, DeviceTaintRules


_lock = threading.Lock()
_cache: dict[tuple[str | None, str | None, int | None], KubeApis] = {}


class ClusterAddress(Protocol):
    """Where the cluster is: the activities' config and the worker's settings both say it."""

    @property
    def kubeconfig(self) -> Path | None: ...

    @property
    def kube_context(self) -> str | None: ...


def kube_apis(settings: ClusterAddress, connections: int | None = None) -> KubeApis:
    """APIs for the configured cluster: kubeconfig (+context) if set, else in-cluster, else ~/.kube/config.

    ``connections``: connections kept to the API server (the client's default is 5 per core; more
    concurrent requests than that open and drop a connection each).
    """
    key = (str(settings.kubeconfig) if settings.kubeconfig else None, settings.kube_context, connections)
    with _lock:
        if key not in _cache:
            _cache[key] = _build(settings.kubeconfig, settings.kube_context, connections)
        return _cache[key]


def _build(kubeconfig: Path | None, context: str | None, connections: int | None = None) -> KubeApis:
    cfg = client.Configuration()
    if connections is not None:
        cfg.connection_pool_maxsize = connections
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig), context=context, client_configuration=cfg)
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(context=context, client_configuration=cfg)
    api = client.ApiClient(cfg)
    # The world's action log names who acted: reconcile counts fleetmend's own requests.
    api.user_agent = USER_AGENT
    return KubeApis(
        core=client.CoreV1Api(api),
        apps=client.AppsV1Api(api),
        discovery=client.DiscoveryV1Api(api),
        custom=client.CustomObjectsApi(api),
        policy=client.PolicyV1Api(api),
        batch=client.BatchV1Api(api),
        resource=client.ResourceV1Api(api),
    )
