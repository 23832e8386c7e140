"""The production-shaped docker-compose stack, checked without a Docker engine.

No Docker engine runs here, so these tests read the compose file and check what
``docker compose up`` would trip over: settings names that do not exist, host
ports used twice, dependencies on services that are not defined, files that are
not in the repository, and a search-attribute job that drifted from the code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf.duration_pb2 import Duration
from temporalio.api.workflowservice.v1 import RegisterNamespaceRequest
from temporalio.client import Client

from fleet.search_attributes import CLI_TYPE_NAMES
from worker.config import Settings
from worker.startup_checks import check_search_attributes

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
REGISTER_SCRIPT = ROOT / "deploy" / "temporal" / "register-search-attributes.sh"
FLEETMEND_SERVICES = {"worker", "webhook", "sim", "ledger-migrate", "temporal-setup", "gateway", "envoy"}


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    return dict(compose["services"])


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the "KEY=value" list form
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): str(value) for key, value in env.items()}


def host_port(mapping: str | dict[str, Any]) -> int:
    if isinstance(mapping, dict):
        return int(mapping["published"])
    parts = str(mapping).split(":")
    return int(parts[-2])


def test_every_fleetmend_variable_is_a_real_setting(services: dict[str, dict[str, Any]]) -> None:
    known = {f"FLEETMEND_{name.upper()}" for name in Settings.model_fields}
    used = {
        (name, key)
        for name, svc in services.items()
        for key in environment(svc)
        if key.startswith("FLEETMEND_")
    }
    assert used, "the fleetmend services configure nothing"
    assert [pair for pair in used if pair[1] not in known] == []


def test_fleetmend_services_reach_temporal_and_the_ledger_by_service_name(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in ("worker", "webhook"):
        env = environment(services[name])
        assert env["FLEETMEND_TEMPORAL_ADDRESS"].split(":")[0] in services
        database_host = re.search(r"@([^:/]+)", env["FLEETMEND_DATABASE_URL"])
        assert database_host and database_host.group(1) in services
    # Bound to all interfaces inside their containers, or the published ports reach nothing.
    assert environment(services["worker"])["FLEETMEND_WORKER_METRICS_HOST"] == "0.0.0.0"
    assert environment(services["webhook"])["FLEETMEND_WEBHOOK_HOST"] == "0.0.0.0"


def test_host_ports_do_not_collide(services: dict[str, dict[str, Any]]) -> None:
    published = [host_port(p) for svc in services.values() for p in svc.get("ports", [])]
    assert len(published) == len(set(published)), published
    assert {7233, 8233, 9090, 9093, 8088, 9464} <= set(published)


def test_dependencies_exist_and_one_shot_jobs_gate_the_worker(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        depends = svc.get("depends_on") or []
        for target in depends:
            assert target in services, f"{name} depends on undefined service {target}"
            assert target != name
    worker_deps = services["worker"]["depends_on"]
    assert worker_deps["temporal-setup"]["condition"] == "service_completed_successfully"
    assert worker_deps["ledger-migrate"]["condition"] == "service_completed_successfully"


def test_fleetmend_services_build_from_the_one_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    assert (ROOT / "Dockerfile").is_file()
    for name in FLEETMEND_SERVICES:
        assert services[name]["build"] == ".", name


def test_bind_mounts_point_into_the_repository(services: dict[str, dict[str, Any]]) -> None:
    mounts = [str(v).split(":")[0] for svc in services.values() for v in svc.get("volumes", [])]
    local = [m for m in mounts if m.startswith("./")]
    assert "./deploy/temporal/dynamicconfig" in local
    assert {
        "./deploy/prometheus/prometheus.yml",
        "./deploy/prometheus/rules.yml",
        "./deploy/alertmanager/alertmanager.yml",
    } <= set(local)
    for mount in local:
        assert (ROOT / mount).exists(), mount
    assert (ROOT / "deploy/temporal/dynamicconfig/development-sql.yaml").is_file()


def test_search_attribute_job_registers_exactly_the_code_list() -> None:
    listed = dict(re.findall(r"^\s+(Fleetmend\w+)=(\w+)\s*$", REGISTER_SCRIPT.read_text(), re.MULTILINE))
    assert listed == CLI_TYPE_NAMES


async def test_search_attribute_job_makes_the_worker_check_pass(
    temporal_client: Client, temporal_cli: Path
) -> None:
    """Run the compose job's script against a real server: a fresh namespace ends up passing the check."""
    namespace = f"compose-{uuid.uuid4().hex[:8]}"
    await temporal_client.workflow_service.register_namespace(
        RegisterNamespaceRequest(
            namespace=namespace, workflow_execution_retention_period=Duration(seconds=86400)
        )
    )
    env = {
        **os.environ,
        "TEMPORAL_ADDRESS": temporal_client.service_client.config.target_host,
        "TEMPORAL_NAMESPACE": namespace,
        "TEMPORAL_CLI": str(temporal_cli),
        "WAIT_S": "60",
    }
    for _ in range(2):  # idempotent: a second deploy changes nothing and succeeds
        done = subprocess.run(
            ["bash", str(REGISTER_SCRIPT)], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
    assert "already registered" in done.stdout
    await check_search_attributes(temporal_client, namespace)


def test_the_image_copies_every_package_the_distribution_ships() -> None:
    """``pip install .`` in the image silently leaves out a package whose sources were not copied
    (the image once lacked ``gateway/``, so ``fleetmend gateway serve`` could not start in it)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    shipped = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    build_stage = dockerfile.split("RUN pip install", 1)[0]
    missing = [p for p in shipped if f"COPY {p} {p}\n" not in build_stage]
    assert not missing, f"Dockerfile does not COPY {missing} before pip install"


def test_the_sim_service_loads_a_shipped_scenario(services: dict[str, dict[str, Any]]) -> None:
    script = "\n".join(services["sim"]["entrypoint"])
    scenario = re.search(r"/opt/fleetmend/scenarios/(\S+\.yaml)", script)
    assert scenario and (ROOT / "sim" / "scenarios" / scenario.group(1)).is_file()
    assert "COPY sim/scenarios /opt/fleetmend/scenarios" in (ROOT / "Dockerfile").read_text()


def test_alertmanager_gets_the_webhook_token_where_its_config_reads_it(
    services: dict[str, dict[str, Any]],
) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    config = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    token_files = {
        webhook["http_config"]["authorization"]["credentials_file"]
        for receiver in config["receivers"]
        for webhook in receiver.get("webhook_configs", [])
    }
    mounted = {secret["target"]: secret["source"] for secret in services["alertmanager"]["secrets"]}
    assert token_files and token_files <= set(mounted)
    for target in token_files:  # the same token the webhook service checks
        assert compose["secrets"][mounted[target]]["environment"] == "FLEETMEND_WEBHOOK_TOKEN"
    assert "FLEETMEND_WEBHOOK_TOKEN" in environment(services["webhook"])


def test_prometheus_targets_are_compose_services(services: dict[str, dict[str, Any]]) -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = [
        target
        for section in [*config["scrape_configs"], *config["alerting"]["alertmanagers"]]
        for static in section.get("static_configs", [])
        for target in static["targets"]
    ]
    assert targets
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, target
        published = {str(p).split(":")[-1] for p in services[host].get("ports", [])}
        assert port in published, target  # the container port the service listens on


def test_images_are_current_pinned_and_not_the_deprecated_auto_setup(
    services: dict[str, dict[str, Any]],
) -> None:
    images = {
        name: str(svc["image"]) for name, svc in services.items() if "image" in svc and "build" not in svc
    }
    assert images
    for name, image in images.items():
        repository, _, tag = image.rpartition(":")
        assert repository and tag and tag != "latest", (name, image)  # pinned
        assert "auto-setup" not in repository, (name, image)  # deprecated by Temporal
    server, tools = images["temporal"], images["temporal-schema"]
    assert server.startswith("temporalio/server:") and tools.startswith("temporalio/admin-tools:")
    assert server.split(":")[1] == tools.split(":")[1]  # the schema job ships the server's own schema
    assert (
        services["temporal"]["depends_on"]["temporal-schema"]["condition"] == "service_completed_successfully"
    )
    assert services["temporal-setup"]["depends_on"]["temporal"]["condition"] == "service_healthy"
    assert (ROOT / "deploy/temporal/setup-postgres-schema.sh").is_file()


def test_compose_and_the_kubernetes_manifests_agree_on_shared_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    from tests.deploy.manifests import OVERLAYS, find, render

    k8s = find(render(OVERLAYS[0]), "ConfigMap", "fleetmend-config")["data"]
    compose = {**environment(services["worker"]), **environment(services["webhook"])}
    # Where the world is differs by design: the compose stack's serving layer is the sim.
    world = {"FLEETMEND_SIM_URL", "FLEETMEND_KUBECONFIG", "FLEETMEND_GATEWAY"}
    shared = sorted((set(k8s) & set(compose)) - world)
    assert {"FLEETMEND_TASK_QUEUE", "FLEETMEND_WORKER_METRICS_PORT", "FLEETMEND_WORKER_HEALTH_PORT"} <= set(
        shared
    )
    assert {key: compose[key] for key in shared} == {key: k8s[key] for key in shared}
    # Both run the same probes: the worker's and the webhook's readiness endpoints.
    assert "8081/readyz" in " ".join(services["worker"]["healthcheck"]["test"])
    assert "8088/readyz" in " ".join(services["webhook"]["healthcheck"]["test"])


def test_users_requests_go_through_envoy_configured_by_the_control_plane(
    services: dict[str, dict[str, Any]],
) -> None:
    """Envoy sits in the sim's network namespace (the engines listen on loopback pod IPs there),
    takes its config from the `gateway` service, and the workers act on it, not on the sim's router."""
    envoy, gateway, sim = services["envoy"], services["gateway"], services["sim"]
    assert envoy["network_mode"] == "service:sim"
    script = " ".join(envoy["entrypoint"])
    assert "gateway bootstrap" in script and "--xds-host gateway" in script and "find_envoy" in script
    assert gateway["command"] == ["gateway", "serve"]
    assert environment(gateway)["FLEETMEND_XDS_PORT"] == "18000"
    assert {8080, 9901} <= {host_port(p) for p in sim["ports"]}  # Envoy's ports, published by its netns
    assert "/sim/v1/gateway" in " ".join(sim["entrypoint"]) and "127.0.0.1:8080" in " ".join(
        sim["entrypoint"]
    )
    for name in ("worker", "webhook"):
        env = environment(services[name])
        assert env["FLEETMEND_GATEWAY"] == "envoy", name
        assert json.loads(env["FLEETMEND_GATEWAY_ADMIN_URLS"]) == ["http://sim:9901"], name
