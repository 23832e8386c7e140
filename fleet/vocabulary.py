"""Names shared by fleetmend, its deployment manifests and the simulated cluster.

These are the Kubernetes label, annotation and condition names fleetmend reads
and writes. They are configurable in production (see ``worker.config``); the
defaults here are what the shipped scenarios and manifests use.
"""

from __future__ import annotations

from enum import StrEnum

# Router-only label: the gateway routes to a pod only while it carries
# ROUTER_LABEL=ROUTER_LABEL_VALUE. No workload controller may select on it, so
# removing it never orphans a pod (fleetmend checks every selector first).
ROUTER_LABEL = "fleetmend.io/serving"
ROUTER_LABEL_VALUE = "true"

# Identity of what a pod serves.
MODEL_LABEL = "fleetmend.io/model"
REVISION_LABEL = "fleetmend.io/revision"
# "serving" for pool members, "spare" for warm spares (loaded, Ready, not routed).
ROLE_LABEL = "fleetmend.io/role"
ROLE_SERVING = "serving"
ROLE_SPARE = "spare"

# Readiness gate fleetmend keeps in sync from engine metrics (KV headroom, bounded queue).
SERVING_READY_CONDITION = "fleetmend.io/serving-ready"

# Node quarantine markers written by triage.
QUARANTINE_LABEL = "fleetmend.io/quarantine"
QUARANTINE_TAINT_KEY = "fleetmend.io/quarantine"
REMEDIATED_AT_ANNOTATION = "fleetmend.io/remediated-at"
FAULT_CLASS_ANNOTATION = "fleetmend.io/fault-class"

# Topology labels a multi-node replica group must share.
ZONE_LABEL = "topology.kubernetes.io/zone"
NVLINK_DOMAIN_LABEL = "fleetmend.io/nvlink-domain"

GPU_RESOURCE = "nvidia.com/gpu"

# LeaderWorkerSet pod labels (kubernetes-sigs/lws).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"

POD_DELETION_COST_ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"


class Tier(StrEnum):
    """Request priority tiers at the gateway; shedding drops from the bottom."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


# Lowest priority first: the order in which admission control sheds tiers.
SHED_ORDER: tuple[Tier, ...] = (Tier.SHEDDABLE, Tier.STANDARD)

# The request header that carries a request's tier (a ``Tier`` value) to the gateway, where
# routes match on it (e.g. Envoy: shed a tier with a direct 429/503 response).
TIER_HEADER = "x-fleetmend-tier"


class FaultKind(StrEnum):
    """Faults the simulated fleet can suffer (and fleetmend must recognise)."""

    NODE_LOST = "node-lost"
    GPU_XID = "gpu-xid"
    POD_OOMKILLED = "pod-oomkilled"
    RANK_LOST = "rank-lost"
    SLOW_REPLICA = "slow-replica"
    SLOW_METRICS = "slow-metrics"
    WEDGED_ENGINE = "wedged-engine"
    NVLINK_ERROR = "nvlink-error"
    THERMAL = "thermal"
    BAD_ROLLOUT = "bad-rollout"
    FALSE_GPU_CONDITION = "false-gpu-condition"  # a health check's wrong verdict: the GPUs are fine


# Pod-deletion-cost fleetmend sets on a pod right before scaling its workload down
# (a lost pod, a drained victim): the ReplicaSet removes the cheapest pods first.
REMOVE_FIRST_DELETION_COST = "-1000"

# Operation ids of fleetmend's own procedures start with this prefix (DESIGN.md §5):
# ``fleetmend:<workflow id>@<first run id>/<step>/<target>``. The inference effect API
# (``POST /v1/effects``) refuses to claim any id in this namespace (403), so no caller
# can pre-claim a future recovery's action.
PROCEDURE_OPERATION_PREFIX = "fleetmend:"

# Dynamic Resource Allocation (resource.k8s.io/v1)
DRA_GROUP = "resource.k8s.io"
DRA_VERSION = "v1"
GPU_DRIVER = "gpu.nvidia.com"
GPU_DEVICE_CLASS = "gpu.nvidia.com"
DRIVER_UNHEALTHY_TAINT_KEY = "gpu.nvidia.com/unhealthy"
