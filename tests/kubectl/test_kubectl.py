"""The runbook's everyday kubectl commands against the simulator, each checked against what a real
cluster shows (server-side printing, discovery, evictions and PDBs, dry runs, watches, OpenAPI)."""

from __future__ import annotations

import json
import queue
import threading
import time
from pathlib import Path

import yaml

from tests.kubectl.support import NS, Cluster, table

POD_COLUMNS = ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
POD_WIDE = [*POD_COLUMNS, "IP", "NODE", "NOMINATED NODE", "READINESS GATES"]
NODE_WIDE = [
    "NAME",
    "STATUS",
    "ROLES",
    "AGE",
    "VERSION",
    "INTERNAL-IP",
    "EXTERNAL-IP",
    "OS-IMAGE",
    "KERNEL-VERSION",
    "CONTAINER-RUNTIME",
]
SPARE = "fleetmend.io/role=spare"


def _pods(cluster: Cluster, selector: str = "") -> list:
    return cluster.core.list_namespaced_pod(NS, label_selector=selector).items


def test_get_and_get_wide_print_the_columns_a_real_server_prints(cluster: Cluster) -> None:
    rows = table(cluster.kubectl("get", "pods", "-n", NS).stdout)
    assert rows[0] == POD_COLUMNS
    wide = table(cluster.kubectl("get", "po", "-n", NS, "-o", "wide").stdout)
    assert wide[0] == POD_WIDE
    by_name = {p.metadata.name: p for p in _pods(cluster)}
    assert sorted(r[0] for r in wide[1:]) == sorted(by_name)
    for name, ready, status, restarts, _age, ip, node, nominated, gates in wide[1:]:
        pod = by_name[name]
        assert (ready, status, restarts) == ("1/1", "Running", "0")
        assert (ip, node, nominated) == (pod.status.pod_ip, pod.spec.node_name, "<none>")
        assert gates == "1/1"  # the serving-ready readiness gate is true on every serving pod
    nodes = table(cluster.kubectl("get", "no", "-o", "wide").stdout)
    assert nodes[0] == NODE_WIDE
    node = cluster.core.read_node("gpu-node-0")
    internal = next(a.address for a in node.status.addresses if a.type == "InternalIP")
    row = next(r for r in nodes[1:] if r[0] == "gpu-node-0")
    assert row[1:3] == ["Ready", "<none>"]
    assert row[4:7] == [node.status.node_info.kubelet_version, internal, "<none>"]
    deploy = table(cluster.kubectl("get", "deploy", "llama", "-n", NS, "-o", "wide").stdout)
    assert deploy[0] == [
        "NAME",
        "READY",
        "UP-TO-DATE",
        "AVAILABLE",
        "AGE",
        "CONTAINERS",
        "IMAGES",
        "SELECTOR",
    ]
    assert deploy[1][:4] == ["llama", "5/5", "5", "5"]
    names = cluster.kubectl("get", "all", "-n", NS, "-o", "name").stdout.split()
    kinds = {n.split("/", 1)[0] for n in names}
    assert kinds == {"pod", "service", "deployment.apps", "replicaset.apps"}  # the "all" category
    pdb = table(cluster.kubectl("get", "pdb", "-n", NS).stdout)
    assert pdb[0] == ["NAME", "MIN AVAILABLE", "MAX UNAVAILABLE", "ALLOWED DISRUPTIONS", "AGE"]
    assert pdb[1][:4] == ["llama", "N/A", "1", "1"]


def test_label_annotate_and_the_three_patch_types(cluster: Cluster) -> None:
    spare = _pods(cluster, SPARE)[0].metadata.name
    assert (
        cluster.kubectl("label", "pod", spare, "-n", NS, "tier=gold").stdout.strip() == f"pod/{spare} labeled"
    )
    cluster.kubectl("annotate", "deploy", "llama", "-n", NS, "runbook=gpu-node-loss")
    cluster.kubectl("label", "pod", spare, "-n", NS, "tier-")  # removal
    assert "tier" not in cluster.core.read_namespaced_pod(spare, NS).metadata.labels
    assert (
        cluster.apps.read_namespaced_deployment("llama", NS).metadata.annotations["runbook"]
        == "gpu-node-loss"
    )
    # merge patch replaces lists; strategic merge merges containers by name; JSON patch is ops.
    image = "vllm/vllm-openai:v0.11.0"
    strategic = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": image}]}}}}
    cluster.kubectl("patch", "deploy", "llama", "-n", NS, "-p", json.dumps(strategic))
    (container,) = cluster.apps.read_namespaced_deployment("llama", NS).spec.template.spec.containers
    assert container.image == image and container.args  # merged by name: the args are still there
    cluster.kubectl(
        "patch", "deploy", "llama", "-n", NS, "--type=merge", "-p", '{"metadata":{"labels":{"m":"1"}}}'
    )
    ops = [
        {
            "op": "replace",
            "path": "/spec/template/spec/containers/0/image",
            "value": "vllm/vllm-openai:v0.10.2",
        }
    ]
    cluster.kubectl("patch", "deploy", "llama", "-n", NS, "--type=json", "-p", json.dumps(ops))
    deployment = cluster.apps.read_namespaced_deployment("llama", NS)
    assert deployment.metadata.labels["m"] == "1"
    assert deployment.spec.template.spec.containers[0].image == "vllm/vllm-openai:v0.10.2"
    failed = cluster.kubectl(
        "patch",
        "deploy",
        "llama",
        "-n",
        NS,
        "--type=json",
        "-p",
        '[{"op":"test","path":"/spec/replicas","value":9}]',
        check=False,
    )
    assert failed.returncode == 1
    assert "The request is invalid: the server rejected our request" in failed.stderr


def test_scale_and_rollout_status_follow_the_deployment(cluster: Cluster) -> None:
    out = cluster.kubectl("scale", "deploy/llama", "-n", NS, "--replicas=3").stdout
    assert out.strip() == "deployment.apps/llama scaled"
    assert cluster.apps.read_namespaced_deployment_scale("llama", NS).spec.replicas == 3
    status = cluster.kubectl("rollout", "status", "deploy/llama", "-n", NS, "--timeout=60s").stdout
    assert 'deployment "llama" successfully rolled out' in status
    rows = table(cluster.kubectl("get", "pods", "-n", NS, "-l", "fleetmend.io/role=serving").stdout)[1:]
    assert len([r for r in rows if r[2] == "Running"]) == 3  # scaled-down pods may still be Terminating
    assert all(r[2] in ("Running", "Terminating") for r in rows)


def test_cordon_and_uncordon(cluster: Cluster) -> None:
    assert cluster.kubectl("cordon", "gpu-node-1").stdout.strip() == "node/gpu-node-1 cordoned"
    node = cluster.core.read_node("gpu-node-1")
    assert node.spec.unschedulable is True
    row = next(r for r in table(cluster.kubectl("get", "nodes").stdout) if r[0] == "gpu-node-1")
    assert row[1] == "Ready,SchedulingDisabled"
    taints = cluster.kubectl("get", "node", "gpu-node-1", "-o", "jsonpath={.spec.taints[*].key}").stdout
    assert "node.kubernetes.io/unschedulable" in taints
    listed = cluster.kubectl(
        "get", "nodes", "--field-selector", "spec.unschedulable=true", "-o", "name"
    ).stdout
    assert listed.split() == ["node/gpu-node-1"]
    assert cluster.kubectl("uncordon", "gpu-node-1").stdout.strip() == "node/gpu-node-1 uncordoned"
    assert not cluster.core.read_node("gpu-node-1").spec.unschedulable


def test_drain_evicts_through_the_eviction_api_and_a_pdb_blocks_it(cluster: Cluster) -> None:
    on_two = [p.metadata.name for p in _pods(cluster) if p.spec.node_name == "gpu-node-2"]
    assert len(on_two) == 1
    drained = cluster.kubectl("drain", "gpu-node-2", "--ignore-daemonsets", "--timeout=60s")
    assert f"evicting pod {NS}/{on_two[0]}" in drained.stdout + drained.stderr
    assert "node/gpu-node-2 drained" in drained.stdout
    pod = cluster.core.list_namespaced_pod(NS, field_selector=f"metadata.name={on_two[0]}").items
    assert not pod  # evicted and gone (the drain waited for it)
    # A budget with no room: the eviction answers 429 and drain retries until its timeout.
    cluster.kubectl("patch", "pdb", "llama", "-n", NS, "--type=merge", "-p", '{"spec":{"maxUnavailable":0}}')
    on_zero = sorted(
        p.metadata.name
        for p in _pods(cluster, "fleetmend.io/role=serving")
        if p.spec.node_name == "gpu-node-0"
    )
    blocked = cluster.kubectl("drain", "gpu-node-0", "--ignore-daemonsets", "--timeout=2s", check=False)
    assert blocked.returncode == 1
    assert "Cannot evict pod as it would violate the pod's disruption budget." in blocked.stderr
    still = sorted(
        p.metadata.name
        for p in _pods(cluster, "fleetmend.io/role=serving")
        if p.spec.node_name == "gpu-node-0"
    )
    assert still == on_zero and all(
        p.metadata.deletion_timestamp is None for p in _pods(cluster) if p.metadata.name in on_zero
    )
    assert cluster.core.read_node("gpu-node-0").spec.unschedulable is True  # cordoned first, as drain does


def test_delete_with_and_without_a_grace_period(cluster: Cluster) -> None:
    first, second = [p.metadata.name for p in _pods(cluster, "fleetmend.io/role=serving")][:2]
    forced = cluster.kubectl("delete", "pod", first, "-n", NS, "--grace-period=0", "--force")
    assert "Immediate deletion does not wait for confirmation" in forced.stderr
    assert f'pod "{first}" force deleted' in forced.stdout
    assert not cluster.core.list_namespaced_pod(NS, field_selector=f"metadata.name={first}").items
    graceful = cluster.kubectl("delete", "pod", second, "-n", NS, "--grace-period=300", "--wait=false")
    assert f'pod "{second}" deleted' in graceful.stdout
    terminating = cluster.core.read_namespaced_pod(second, NS)
    assert terminating.metadata.deletion_grace_period_seconds == 300
    row = next(r for r in table(cluster.kubectl("get", "pods", "-n", NS).stdout) if r[0] == second)
    assert row[2] == "Terminating"
    cluster.kubectl("wait", "--for=delete", f"pod/{second}", "-n", NS, "--timeout=60s")
    assert not cluster.core.list_namespaced_pod(NS, field_selector=f"metadata.name={second}").items


def test_dry_run_server_answers_like_a_write_and_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    spare = _pods(cluster, SPARE)[0].metadata.name
    before_pods = sorted(p.metadata.name for p in _pods(cluster))
    manifest = tmp_path / "cm.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "dry", "namespace": NS},
                "data": {"a": "1"},
            }
        )
    )
    outputs = [
        cluster.kubectl("label", "pod", spare, "-n", NS, "tier=gold", "--dry-run=server").stdout,
        cluster.kubectl("annotate", "node", "gpu-node-3", "x=y", "--dry-run=server").stdout,
        cluster.kubectl("scale", "deploy", "llama", "-n", NS, "--replicas=2", "--dry-run=server").stdout,
        cluster.kubectl("apply", "-f", str(manifest), "--dry-run=server").stdout,
        cluster.kubectl("delete", "pod", spare, "-n", NS, "--dry-run=server").stdout,
        cluster.kubectl("drain", "gpu-node-3", "--ignore-daemonsets", "--dry-run=server").stdout,
    ]
    assert [out for out in outputs if "(server dry run)" not in out] == []
    # kubectl patch prints no suffix, but sends dryRun=All all the same (the replicas stay 5 below).
    cluster.kubectl(
        "patch",
        "deploy",
        "llama",
        "-n",
        NS,
        "--type=merge",
        "-p",
        '{"spec":{"replicas":1}}',
        "--dry-run=server",
    )
    assert "evicting pod" in outputs[-1]
    pod = cluster.core.read_namespaced_pod(spare, NS)
    assert "tier" not in pod.metadata.labels and pod.metadata.deletion_timestamp is None
    assert "x" not in (cluster.core.read_node("gpu-node-3").metadata.annotations or {})
    assert not cluster.core.read_node("gpu-node-3").spec.unschedulable
    assert cluster.apps.read_namespaced_deployment("llama", NS).spec.replicas == 5
    assert not cluster.core.list_namespaced_config_map(NS).items
    assert sorted(p.metadata.name for p in _pods(cluster)) == before_pods


def test_apply_diff_and_strict_field_validation(cluster: Cluster, tmp_path: Path) -> None:
    def manifest(step: str, **extra: object) -> str:
        path = tmp_path / f"runbook-{step}.yaml"
        doc = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "runbook", "namespace": NS},
            "data": {"step": step},
        }
        path.write_text(yaml.safe_dump({**doc, **extra}))
        return str(path)

    assert cluster.kubectl("apply", "-f", manifest("1")).stdout.strip() == "configmap/runbook created"
    assert cluster.kubectl("apply", "-f", manifest("1")).stdout.strip() == "configmap/runbook unchanged"
    diff = cluster.kubectl("diff", "-f", manifest("2"), check=False)
    assert diff.returncode == 1, diff.stderr  # 1 = differences found
    assert '-  step: "1"' in diff.stdout and '+  step: "2"' in diff.stdout
    assert cluster.core.read_namespaced_config_map("runbook", NS).data == {"step": "1"}  # diff wrote nothing
    assert cluster.kubectl("apply", "-f", manifest("2")).stdout.strip() == "configmap/runbook configured"
    assert cluster.core.read_namespaced_config_map("runbook", NS).data == {"step": "2"}
    assert cluster.kubectl("diff", "-f", manifest("2"), check=False).returncode == 0
    typo = cluster.kubectl("apply", "-f", manifest("3", dta={"x": "y"}), check=False)
    assert typo.returncode == 1 and 'strict decoding error: unknown field "dta"' in typo.stderr
    ssa = cluster.kubectl("apply", "--server-side", "-f", manifest("4"), check=False)
    assert ssa.returncode == 1 and "server-side apply is not supported" in ssa.stderr


def test_get_watch_prints_every_change(cluster: Cluster) -> None:
    spare = _pods(cluster, SPARE)[0].metadata.name
    watch = cluster.popen("get", "pods", "-n", NS, "-l", SPARE, "-w", "--output-watch-events")
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in watch.stdout or []], daemon=True).start()
    seen: list[list[str]] = []

    def until(event: str, name: str) -> list[str]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                row = table(lines.get(timeout=1))[0]
            except queue.Empty:
                continue
            seen.append(row)
            if row[:2] == [event, name]:
                return row
        raise AssertionError(f"no {event} {name} in {seen}")

    try:
        assert until("ADDED", spare)[2:5] == ["1/1", "Running", "0"]
        assert seen[0] == ["EVENT", "NAME", "READY", "STATUS", "RESTARTS", "AGE"]  # the header, once
        cluster.kubectl("label", "pod", spare, "-n", NS, "watched=yes")
        until("MODIFIED", spare)
        cluster.kubectl("delete", "pod", spare, "-n", NS, "--grace-period=1", "--wait=false")
        assert until("MODIFIED", spare)[3] == "Terminating"
        until("DELETED", spare)
        # The Deployment's replacement appeared in the same stream, and the header was printed once.
        assert any(r[0] == "ADDED" and r[1] != spare for r in seen), seen
        assert sum(1 for r in seen if r[0] == "EVENT") == 1
    finally:
        watch.terminate()
        watch.wait(10)


def test_describe_node_shows_its_lease_pods_and_conditions(cluster: Cluster) -> None:
    text = cluster.kubectl("describe", "node", "gpu-node-0").stdout
    assert "Lease:\n  HolderIdentity:  gpu-node-0" in text
    assert "RenewTime:" in text and "RenewTime:       <unset>" not in text
    on_node = [  # every namespace's: the node's DaemonSet pods count too
        p.metadata.name
        for p in cluster.core.list_pod_for_all_namespaces(field_selector="spec.nodeName=gpu-node-0").items
    ]
    assert f"Non-terminated Pods:          ({len(on_node)} in total)" in text
    assert all(name in text for name in on_node)
    assert "Ready            True" in text and "nvidia.com/gpu" in text
    pod = _pods(cluster, SPARE)[0]
    described = cluster.kubectl("describe", "pod", pod.metadata.name, "-n", NS).stdout
    assert f"Node:             {pod.spec.node_name}/" in described
    assert "Readiness Gates:" in described and "fleetmend.io/serving-ready   True" in described


def test_explain_reads_the_openapi_v3_schemas(cluster: Cluster) -> None:
    field = cluster.kubectl("explain", "pod.spec.nodeName").stdout
    assert "KIND:       Pod" in field and "FIELD: nodeName <string>" in field
    assert "NodeName indicates in which node this pod is scheduled." in field
    replicas = cluster.kubectl("explain", "deploy.spec.replicas").stdout
    assert "GROUP:      apps" in replicas and "FIELD: replicas <integer>" in replicas
    lws = cluster.kubectl("explain", "lws.spec").stdout
    assert "GROUP:      leaderworkerset.x-k8s.io" in lws and "leaderWorkerTemplate\t<Object>" in lws
    missing = cluster.kubectl("explain", "pod.spec.nope", check=False)
    assert missing.returncode == 1 and 'field "nope" does not exist' in missing.stderr


def test_api_resources_lists_names_short_names_groups_and_kinds(cluster: Cluster) -> None:
    rows = {r[0]: r for r in table(cluster.kubectl("api-resources").stdout)[1:]}
    expected = {
        "pods": ["pods", "po", "v1", "true", "Pod"],
        "nodes": ["nodes", "no", "v1", "false", "Node"],
        "services": ["services", "svc", "v1", "true", "Service"],
        "events": ["events", "ev", "v1", "true", "Event"],
        "namespaces": ["namespaces", "ns", "v1", "false", "Namespace"],
        "configmaps": ["configmaps", "cm", "v1", "true", "ConfigMap"],
        "deployments": ["deployments", "deploy", "apps/v1", "true", "Deployment"],
        "replicasets": ["replicasets", "rs", "apps/v1", "true", "ReplicaSet"],
        "statefulsets": ["statefulsets", "sts", "apps/v1", "true", "StatefulSet"],
        "daemonsets": ["daemonsets", "ds", "apps/v1", "true", "DaemonSet"],
        "poddisruptionbudgets": ["poddisruptionbudgets", "pdb", "policy/v1", "true", "PodDisruptionBudget"],
        "jobs": ["jobs", "batch/v1", "true", "Job"],
        "leases": ["leases", "coordination.k8s.io/v1", "true", "Lease"],
        "endpointslices": ["endpointslices", "discovery.k8s.io/v1", "true", "EndpointSlice"],
        "serviceaccounts": ["serviceaccounts", "sa", "v1", "true", "ServiceAccount"],
        "networkpolicies": ["networkpolicies", "netpol", "networking.k8s.io/v1", "true", "NetworkPolicy"],
        "roles": ["roles", "rbac.authorization.k8s.io/v1", "true", "Role"],
        "rolebindings": ["rolebindings", "rbac.authorization.k8s.io/v1", "true", "RoleBinding"],
        "clusterroles": ["clusterroles", "rbac.authorization.k8s.io/v1", "false", "ClusterRole"],
        "clusterrolebindings": [
            "clusterrolebindings",
            "rbac.authorization.k8s.io/v1",
            "false",
            "ClusterRoleBinding",
        ],
        "deviceclasses": ["deviceclasses", "resource.k8s.io/v1", "false", "DeviceClass"],
        "resourceslices": ["resourceslices", "resource.k8s.io/v1", "false", "ResourceSlice"],
        "resourceclaims": ["resourceclaims", "resource.k8s.io/v1", "true", "ResourceClaim"],
        "resourceclaimtemplates": [
            "resourceclaimtemplates",
            "resource.k8s.io/v1",
            "true",
            "ResourceClaimTemplate",
        ],
        "devicetaintrules": ["devicetaintrules", "resource.k8s.io/v1", "false", "DeviceTaintRule"],
        "leaderworkersets": [
            "leaderworkersets",
            "lws",
            "leaderworkerset.x-k8s.io/v1",
            "true",
            "LeaderWorkerSet",
        ],
    }
    assert rows == expected
    wide = table(cluster.kubectl("api-resources", "-o", "wide", "--api-group=policy").stdout)
    assert wide[0][-2:] == ["VERBS", "CATEGORIES"]
    assert "create,delete,deletecollection,get,list,patch,update,watch" in wide[1]
    evict = json.loads(cluster.kubectl("get", "--raw", "/api/v1").stdout)
    (entry,) = [r for r in evict["resources"] if r["name"] == "pods/eviction"]
    assert (entry["group"], entry["version"], entry["kind"], entry["verbs"]) == (
        "policy",
        "v1",
        "Eviction",
        ["create"],
    )


def test_credentials_are_checked_and_refusals_read_as_rbac_ones(cluster: Cluster, tmp_path: Path) -> None:
    assert cluster.kubectl("get", "--raw", "/readyz").stdout == "ok"
    doc = yaml.safe_load(cluster.sim.kubeconfig.read_text())
    doc["users"][0]["user"]["token"] = "not-the-token"
    wrong = tmp_path / "wrong-kubeconfig"
    wrong.write_text(yaml.safe_dump(doc))
    refused = cluster.kubectl("--kubeconfig", str(wrong), "get", "pods", "-n", NS, check=False)
    assert refused.returncode == 1 and "error: You must be logged in to the server" in refused.stderr
    from sim.k8s.faults import ApiFaultRule

    cluster.sim.world.api_faults.set_rules(
        [ApiFaultRule(verbs=["PATCH"], path_contains="/nodes/", error="403")]
    )
    forbidden = cluster.kubectl("label", "node", "gpu-node-1", "quarantine=xid", check=False)
    assert forbidden.returncode == 1
    assert (
        'Error from server (Forbidden): nodes "gpu-node-1" is forbidden: User '
        '"system:serviceaccount:fleetmend:fleetmend" cannot patch resource "nodes" in API group "" at the cluster scope'
    ) in forbidden.stderr
