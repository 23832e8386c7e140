"""``deploy/k8s``: every overlay renders with the real kubectl, every object is valid against the
Kubernetes schemas, and the objects say what the README promises (non-root, probes, Secrets
referenced not inlined, versions in step, alert wiring equal to the shipped configs)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy.manifests import K8S, OVERLAYS, ROOT, find, kubectl, pod_specs, render, render_text
from tests.deploy.rbac_report import wildcard_rules
from worker.config import Settings
from worker.temporal_client import SETTING_NAMES
from worker.worker import package_version

K8S_VERSION = "1.33.0"  # the version the simulated API server reports; validation is against its schemas
SECRET_LIKE = re.compile(r"TOKEN|API_KEY|PASSWORD|DATABASE_URL|SECRET", re.IGNORECASE)


def test_there_is_an_overlay_for_in_cluster_temporal_and_for_temporal_cloud() -> None:
    assert {"in-cluster-temporal", "temporal-cloud"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(overlay: str) -> None:
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "RoleBinding", "ConfigMap",
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy", "Job",
    } <= kinds  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_unprivileged_with_requests_and_meaningful_probes(overlay: str) -> None:
    objects = render(overlay)
    for name, spec in pod_specs(objects).items():
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged"), name
            assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"], (
                name
            )
    config = find(objects, "ConfigMap", "fleetmend-config")["data"]
    worker = find(objects, "Deployment", "fleetmend-worker-")["spec"]["template"]["spec"]["containers"][0]
    health = {p["name"]: p["containerPort"] for p in worker["ports"]}["health"]
    assert (
        str(health) == config["FLEETMEND_WORKER_HEALTH_PORT"]
    )  # the probes reach the server the worker runs
    assert worker["readinessProbe"]["httpGet"]["path"] == "/readyz"  # polling + Temporal + ledger
    assert worker["livenessProbe"]["httpGet"]["path"] == "/healthz"  # the process answers, nothing more
    webhook = find(objects, "Deployment", "fleetmend-webhook")["spec"]["template"]["spec"]["containers"][0]
    assert webhook["readinessProbe"]["httpGet"]["path"] == "/readyz"  # Temporal and the ledger reachable
    assert str(webhook["ports"][0]["containerPort"]) == config["FLEETMEND_WEBHOOK_PORT"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined(overlay: str) -> None:
    objects = render(overlay)
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == []
    for o in objects:
        if o["kind"] == "ConfigMap" and not o["metadata"]["name"].startswith(
            ("fleetmend-prometheus-rules", "fleetmend-alertmanager-config")
        ):
            assert [k for k in o["data"] if SECRET_LIKE.search(k)] == [], o["metadata"]["name"]
    referenced = set()
    for name, spec in pod_specs(objects).items():
        for container in spec["containers"]:
            for env in container.get("env", []):
                if SECRET_LIKE.search(env["name"]):
                    assert "value" not in env, (name, env["name"])  # never a literal
                    referenced.add(env["valueFrom"]["secretKeyRef"]["name"])
        referenced |= {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
    expected = {"fleetmend-ledger", "fleetmend-webhook-tokens"}
    expected |= (
        {"fleetmend-temporal-tls"} if overlay == "in-cluster-temporal" else {"fleetmend-temporal-api-key"}
    )
    assert referenced == expected
    header = (K8S / "overlays" / overlay / "kustomization.yaml").read_text()
    for secret in expected:  # the overlay tells the operator which Secrets to create
        assert secret in header, secret


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_the_manifests_pass_exists(overlay: str) -> None:
    known = {f"FLEETMEND_{name.upper()}" for name in Settings.model_fields} | set(SETTING_NAMES.values())
    known |= {"WAIT_S"}  # register-search-attributes.sh's own
    known |= {"POD_NAME", "POD_IP"}  # the Envoy container's own (expanded in its args, not settings)
    objects = render(overlay)
    passed = set()
    for o in objects:
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(
            ("fleetmend-config", "fleetmend-temporal")
        ):
            passed |= set(o["data"])
    for spec in pod_specs(objects).values():
        for container in spec["containers"]:
            passed |= {e["name"] for e in container.get("env", [])}
    assert passed and sorted(passed - known) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_version_is_the_package_version_everywhere(overlay: str) -> None:
    version = package_version()
    slug = re.sub(r"[^a-z0-9]+", "-", version.lower()).strip("-")
    objects = render(overlay)
    worker = find(objects, "Deployment", "fleetmend-worker-")
    assert worker["metadata"]["name"] == f"fleetmend-worker-{slug}"
    assert worker["spec"]["template"]["metadata"]["labels"]["fleetmend.io/build-id"] == version
    container = worker["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLEETMEND_WORKER_BUILD_ID"] == version
    assert container["image"].endswith(f":{version}")
    jobs = sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Job")
    assert jobs == [f"fleetmend-ledger-migrate-{slug}", f"fleetmend-search-attributes-{slug}"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rbac_has_no_wildcards_no_secrets_and_no_writes_for_the_webhook(overlay: str) -> None:
    objects = render(overlay)
    assert wildcard_rules(objects) == []
    for o in objects:
        for rule in o.get("rules") or []:
            assert "secrets" not in rule.get("resources", []), o["metadata"]["name"]
    webhook = find(objects, "ClusterRole", "fleetmend-webhook")
    assert {v for r in webhook["rules"] for v in r["verbs"]} <= {"get", "list"}
    setup = find(objects, "ServiceAccount", "fleetmend-setup")
    assert setup["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_fleetmend_lives_in_its_namespace_and_the_pool_binding_in_the_serving_one(overlay: str) -> None:
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for o in render(overlay):
        if o["kind"] in cluster_scoped:
            assert "namespace" not in o["metadata"], o["metadata"]["name"]
        elif o["kind"] == "RoleBinding" and o["metadata"]["name"] == "fleetmend-worker-qualification":
            assert o["metadata"]["namespace"] == "fleetmend"  # qualification Jobs run in fleetmend's own
        elif o["kind"] == "RoleBinding" and o["metadata"]["name"] == "fleetmend-worker-fastpath-lease":
            assert o["metadata"]["namespace"] == "fleetmend"  # the fast path's Lease lives with fleetmend
        elif o["kind"] == "RoleBinding":
            assert o["metadata"]["namespace"] == "inference"  # where the pools are (the sim's namespace)
        else:
            assert o["metadata"]["namespace"] == "fleetmend", (o["kind"], o["metadata"]["name"])


def test_the_envoy_bootstrap_is_what_fleetmend_gateway_bootstrap_renders() -> None:
    shipped = json.loads((K8S / "base" / "gateway" / "envoy-bootstrap.json").read_text())
    rendered = subprocess.run(
        [str(Path(sys.executable).parent / "fleetmend"), "gateway", "bootstrap", "--node-id", "envoy",
         "--xds-host", "fleetmend-xds.fleetmend.svc", "--access-log", "/dev/stdout"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert shipped == json.loads(rendered), "regenerate deploy/k8s/base/gateway/envoy-bootstrap.json"
    objects = render("in-cluster-temporal")
    xds = find(objects, "Service", "fleetmend-xds")["spec"]["ports"][0]["port"]
    cluster = shipped["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert cluster["endpoint"]["address"]["socket_address"] == {
        "address": "fleetmend-xds.fleetmend.svc", "port_value": xds,
    }  # fmt: skip


def test_alert_wiring_is_the_shipped_prometheus_rules_and_alertmanager_route() -> None:
    objects = render(OVERLAYS[0])
    rules = find(objects, "ConfigMap", "fleetmend-prometheus-rules")["data"]["rules.yml"]
    assert rules == (ROOT / "deploy/prometheus/rules.yml").read_text()
    shipped = (ROOT / "deploy/alertmanager/alertmanager.yml").read_text()
    in_cluster = find(objects, "ConfigMap", "fleetmend-alertmanager-config")["data"]["alertmanager.yml"]
    service = find(objects, "Service", "fleetmend-webhook")
    url = f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{service['spec']['ports'][0]['port']}"
    assert in_cluster == shipped.replace("http://webhook:8088", url)
    assert url in in_cluster


def test_the_webhook_network_policy_admits_alertmanager_to_the_webhook_port() -> None:
    objects = render(OVERLAYS[0])
    policy = find(objects, "NetworkPolicy", "fleetmend-webhook")
    deployment = find(objects, "Deployment", "fleetmend-webhook")
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    sources = [
        peer.get("podSelector", {}).get("matchLabels", {})
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    ]
    assert {"app.kubernetes.io/name": "alertmanager"} in sources
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [8088]


def test_server_side_dry_run_against_the_simulated_api_server(tmp_path: Path) -> None:
    """``kubectl apply --dry-run=server`` of each overlay against the simulated API server: every
    kind the manifests use is served, the server validates each object, and nothing is created."""
    from sim.runner import start_sim
    from sim.scenario import shipped_scenarios

    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=1.0, serving=False)
    try:
        env = {"KUBECONFIG": str(running.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
        served = subprocess.run(
            [kubectl(), "api-resources", "-o", "name"], env=env, capture_output=True, text=True, timeout=60
        )
        assert served.returncode == 0, served.stderr
        names = set(served.stdout.split())
        missing = set()
        for overlay in OVERLAYS:
            for o in render(overlay):
                group = o["apiVersion"].split("/")[0] if "/" in o["apiVersion"] else ""
                plural = o["kind"].lower() + ("es" if o["kind"].endswith("s") else "s")
                plural = {
                    "networkpolicys": "networkpolicies",
                    "poddisruptionbudgets": "poddisruptionbudgets",
                }.get(plural, plural)
                if f"{plural}.{group}".rstrip(".") not in names and plural not in names:
                    missing.add(f"{o['kind']} ({o['apiVersion']})")
        assert not missing, f"the simulated API server does not serve {sorted(missing)}"
        for overlay in OVERLAYS:
            manifest = tmp_path / f"{overlay}.yaml"
            manifest.write_text(render_text(overlay))
            done = subprocess.run(
                [kubectl(), "apply", "--dry-run=server", "-f", str(manifest), "-o", "json"],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            applied = json.loads(done.stdout)["items"]
            assert sorted((o["kind"], o["metadata"]["name"]) for o in applied) == sorted(
                (o["kind"], o["metadata"]["name"]) for o in render(overlay)
            )
        for kind in ("deployments", "clusterroles", "serviceaccounts", "networkpolicies"):
            listed = json.loads(
                subprocess.run(
                    [kubectl(), "get", kind, "-A", "-o", "json"], env=env, capture_output=True, text=True
                ).stdout
            )
            assert not [o for o in listed["items"] if o["metadata"]["name"].startswith("fleetmend")], kind
        # A typo in a manifest is refused by the server's strict field validation, naming the field.
        broken = render_text(OVERLAYS[0]).replace("  replicas:", "  replicaz:", 1)
        assert broken != render_text(OVERLAYS[0])
        (tmp_path / "broken.yaml").write_text(broken)
        refused = subprocess.run(
            [kubectl(), "apply", "--dry-run=server", "-f", str(tmp_path / "broken.yaml")],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode != 0 and "replicaz" in refused.stderr, refused.stderr
    finally:
        running.stop()
