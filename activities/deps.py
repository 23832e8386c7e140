"""What every fleetmend activity needs, built once per worker process.

Activities are methods of small classes holding these dependencies (the
Temporal-recommended shape for injecting clients), so tests and the worker
wire the same code to real Postgres, the real Kubernetes client and httpx.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import httpx
from temporalio import activity

from activities.config import ActivityConfig
from activities.envoy_gateway import EnvoyGateway
from activities.gateway import Gateway
from fleet.vocabulary import PROCEDURE_OPERATION_PREFIX
from gateway.store import GatewayStore
from kube.allocation import GpuAllocation, gpu_allocation
from kube.cache import WatchedObjects, watched
from kube.client import USER_AGENT, KubeApis, kube_apis
from ledger.effect import EffectContext
from ledger.store import EffectLedger

log = logging.getLogger("fleetmend.activities")


@dataclass
class ActivityDeps:
    settings: ActivityConfig
    ledger: EffectLedger
    identity: str = "fleetmend-worker"
    _http: httpx.Client | None = field(default=None, repr=False)

    def warm_up(self) -> None:
        """Build the clients now (loading a kubeconfig takes about a second), not in the first incident.

        A cluster that cannot be configured is logged, not fatal: read-only and
        ledger-only activities still work, and the first Kubernetes activity
        fails with the client's own error.
        """
        try:
            _ = self.kube
        except Exception as exc:  # any configuration error: reported here, raised again per activity
            log.warning("Kubernetes client not configured at start-up: %s", exc)
        _ = self.gateway, self.http
        try:
            _ = self.allocation, self.nodes
        except Exception as exc:
            log.warning("Kubernetes watches not started: %s", exc)

    @cached_property
    def kube(self) -> KubeApis:
        return kube_apis(self.settings, self.settings.kube_connections)

    @property
    def _cluster(self) -> tuple[str | None, str | None]:
        s = self.settings
        return (str(s.kubeconfig) if s.kubeconfig else None, s.kube_context)

    @property
    def allocation(self) -> GpuAllocation:
        """GPUs allocated per node from one pod watch per cluster and process (kube.allocation)."""
        return gpu_allocation(self._cluster, self.kube.core.list_pod_for_all_namespaces)

    @property
    def nodes(self) -> WatchedObjects:
        """Every Node, from one watch per cluster and process (kube.cache): a look reads, not lists."""
        return watched(self._cluster, "nodes", lambda: WatchedObjects("nodes", self.kube.core.list_node))

    def deployments(self, namespace: str) -> WatchedObjects:
        """The namespace's Deployments, from one watch per namespace, cluster and process (kube.cache)."""
        return self._watched_in(namespace, "deployments", self.kube.apps.list_namespaced_deployment)

    def replica_sets(self, namespace: str) -> WatchedObjects:
        """The namespace's ReplicaSets, from one watch per namespace, cluster and process (kube.cache)."""
        return self._watched_in(namespace, "replicasets", self.kube.apps.list_namespaced_replica_set)

    def _watched_in(self, namespace: str, plural: str, list_namespaced: Callable[..., Any]) -> WatchedObjects:
        """Per namespace, as fleetmend's RBAC grants workloads (deploy/k8s: a Role in each pool's namespace)."""
        name = f"{plural}/{namespace}"
        return watched(self._cluster, name, lambda: WatchedObjects(name, partial(list_namespaced, namespace)))

    @cached_property
    def gateway(self) -> Gateway:
        """The gateway adapter the ``gateway`` setting names (activities.gateway)."""
        s = self.settings
        return EnvoyGateway(
            GatewayStore(self.ledger.engine),
            s.gateway_admin_urls,
            http=self.http,
            apply_timeout_s=s.gateway_apply_timeout_s,
        )

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            # One pool for every activity thread: engines, Envoy admin, the incident channel. A read
            # that finds no free connection within the timeout is reported unread, never as a dead engine.
            self._http = httpx.Client(
                timeout=httpx.Timeout(3.0, connect=1.0),
                limits=httpx.Limits(
                    max_connections=self.settings.http_connections, max_keepalive_connections=32
                ),
                headers={"User-Agent": USER_AGENT},
            )
        return self._http


def operation_id(scope: str, step: str, target: str) -> str:
    """The ledger's business key for a procedure step (DESIGN.md §5).

    ``fleetmend:<scope>/<step>/<target>``. The scope is what stays the same for one
    procedure's whole life and differs between incidents: the procedures pass
    ``<workflow id>@<first run id>`` (stable across retries, replays, worker restarts and
    continue-as-new; new for the pool's next incident, whose workflow id is the same).
    Without one, the current run names it. Never the activity id (it restarts at "1").
    The ``fleetmend:`` namespace is reserved: the inference effect API cannot claim it.
    """
    if not scope:
        info = activity.info()
        scope = f"{info.workflow_id}@{info.workflow_run_id}"
    return f"{PROCEDURE_OPERATION_PREFIX}{scope}/{step}/{target}"


def effect_context(
    step: str, fingerprints: list[str] | None = None, requested_by: str | None = None
) -> EffectContext:
    info = activity.info()
    return EffectContext(
        workflow_id=info.workflow_id,
        run_id=info.workflow_run_id,
        step=step,
        alert_fingerprints=list(fingerprints or []),
        requested_by=requested_by or "fleetmend-worker",
    )
