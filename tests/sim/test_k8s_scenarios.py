"""Shipped scenarios, scenario validation errors, and the ``fleetmend sim`` command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config

from sim.scenario import ScenarioError, load_scenario, parse_scenario, shipped_scenarios
from sim.world import SimWorld

REPO = Path(__file__).resolve().parents[2]


def test_the_issue_s_scenarios_ship() -> None:
    assert {
        "gpu-node-loss",
        "rank-lost",
        "fragmented",
        "router-label-selected",
        "no-warm-spare",
        "bad-rollout",
        "scale-down",
    } <= set(shipped_scenarios())


@pytest.mark.parametrize("name", sorted(shipped_scenarios()))
def test_every_shipped_scenario_starts_in_steady_state(name: str) -> None:
    scenario = load_scenario(shipped_scenarios()[name])
    world = SimWorld(scenario, speed=1.0)
    for workload in scenario.workloads:
        namespace = scenario.workload_namespace(workload)
        if workload.kind == "Deployment":
            status = world.store.get("deployments", namespace, workload.name)["status"]
            assert status.get("readyReplicas") == workload.replicas, (name, workload.name, status)
        else:
            status = world.store.get("leaderworkersets", namespace, workload.name)["status"]
            assert status["readyReplicas"] == workload.replicas
    pods = world.pods()
    # Every pod IP is a distinct loopback address of the world's own block(s).
    ips = [p["status"]["podIP"] for p in pods]
    blocks = {b.rsplit(".", 1)[0] for b in world.control.pod_ips.blocks}
    assert pods and len(set(ips)) == len(ips)
    assert all(ip.startswith("127.") and ip.rsplit(".", 1)[0] in blocks for ip in ips)


def test_gpu_node_loss_layout_puts_two_serving_replicas_on_the_first_node() -> None:
    world = SimWorld(load_scenario(shipped_scenarios()["gpu-node-loss"]))
    by_node: dict[str, list[str]] = {}
    for pod in world.pods("inference"):  # (every GPU node also runs its DaemonSets' node agents)
        by_node.setdefault(pod["spec"]["nodeName"], []).append(pod["metadata"]["labels"]["fleetmend.io/role"])
    assert sorted(by_node["gpu-node-0"]) == ["serving", "serving"]
    assert sum(len(roles) for roles in by_node.values()) == 6 and len(by_node.get("gpu-node-3", [])) == 1


def _base() -> dict[str, object]:
    return yaml.safe_load(shipped_scenarios()["gpu-node-loss"].read_text())


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["workloads"][0].update(model="no-such-model"), "workloads.0.model"),
        (lambda d: d["nodes"][0].update(gpus=-1), "nodes.0.gpus"),
        (lambda d: d["models"][0].update(gpu_per_pod=4), "models.0.gpu_per_pod"),
        (lambda d: d["workloads"][0].update(kind="StatefulSet"), "workloads.0.kind"),
        (lambda d: d["workloads"][0].update(revision="r9"), "workloads.0.revision"),
        (lambda d: d.pop("nodes"), "nodes"),
    ],
)
def test_a_bad_scenario_names_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    data = _base()
    mutate(data)
    with pytest.raises(ScenarioError) as error:
        parse_scenario(data, "bad.yaml")
    assert f"{field}:" in str(error.value) and str(error.value).startswith("bad.yaml: invalid scenario")


def test_a_multi_node_model_needs_a_leaderworkerset() -> None:
    data = _base()
    data["models"][0]["pods_per_replica"] = 2  # type: ignore[index]
    with pytest.raises(
        ScenarioError, match=r"workloads\.0\.kind: model 'llama-70b' needs 2 pods per replica"
    ):
        parse_scenario(data)


def _run_cli(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "sim", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_fleetmend_sim_prints_the_kubeconfig_and_the_client_lists_the_cluster(tmp_path: Path) -> None:
    target = tmp_path / "kc"
    process = _run_cli(
        "--scenario",
        "sim/scenarios/gpu-node-loss.yaml",
        "--port",
        "0",
        "--speed",
        "50",
        "--kubeconfig",
        str(target),
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + 60
        printed = None
        while time.monotonic() < deadline and printed is None:
            line = process.stdout.readline()
            if not line:
                break
            if line.startswith("kubeconfig: "):
                printed = Path(line.removeprefix("kubeconfig: ").strip())
        assert printed == target.resolve(), (
            process.stderr.read() if process.poll() is not None and process.stderr else ""
        )
        assert oct(printed.stat().st_mode & 0o777) == "0o600"
        api_client = config.new_client_from_config(config_file=str(printed))
        core = client.CoreV1Api(api_client)
        assert [n.metadata.name for n in core.list_node().items] == [f"gpu-node-{i}" for i in range(4)]
        pods = core.list_namespaced_pod("inference").items
        assert len(pods) == 6 and all(p.status.phase == "Running" for p in pods)
        api_client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
    assert process.returncode == 0


def test_fleetmend_sim_rejects_a_bad_scenario_with_the_field_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    data = _base()
    data["nodes"][0]["gpus"] = "eight"  # type: ignore[index]
    bad.write_text(yaml.safe_dump(data))
    process = _run_cli("--scenario", str(bad), "--port", "0")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "nodes.0.gpus" in stderr and "invalid scenario" in stderr
