"""Kubernetes objects a scenario starts with: namespaces, GPU nodes, pools.

A pool (one ``WorkloadSpec``) becomes:

* a Service selecting ``app.kubernetes.io/name=<pool>`` (leaders only for an
  LWS), plus the router-only label when ``service.select_router_label``;
* the serving Deployment (or LeaderWorkerSet) ``<pool>``, role ``serving``,
  pods carrying the router-only label ``fleetmend.io/serving=true``; its
  selector is ``app.kubernetes.io/name`` + ``fleetmend.io/role`` (+ the router
  label only in the anti-pattern variant);
* a warm-spare Deployment/LWS ``<pool>-spare`` of the same model and revision
  with role ``spare`` and no router label: Ready, in the Service's endpoints,
  but not routed until someone adds the router label;
* a PodDisruptionBudget ``<pool>`` over the serving pods, when declared;

and, for every cluster with GPU nodes, the node agents' DaemonSets (``build_node_daemonsets``).

With ``gpu_api: dra`` nodes advertise no ``nvidia.com/gpu``; the NVIDIA DRA driver's DeviceClass
``gpu.nvidia.com`` and one ResourceSlice per GPU node are published (``sim.k8s.devices``), each pool
gets a ResourceClaimTemplate ``<pool>-gpus`` (request ``gpus``: ``gpus_per_pod`` devices of the class),
and its pod templates claim through it (``spec.resourceClaims`` ``gpus``, the container's
``resources.claims``) instead of requesting ``nvidia.com/gpu``; the device plugin DaemonSet is the
DRA driver's kubelet plugin instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.vocabulary import (
    GPU_RESOURCE,
    LWS_WORKER_INDEX_LABEL,
    MODEL_LABEL,
    NVLINK_DOMAIN_LABEL,
    REVISION_LABEL,
    ROLE_LABEL,
    ROLE_SERVING,
    ROLE_SPARE,
    ROUTER_LABEL,
    ROUTER_LABEL_VALUE,
    SERVING_READY_CONDITION,
)
from sim.k8s import devices as dv
from sim.k8s import objects as o
from sim.k8s.controllers.lws import EXCLUSIVE_TOPOLOGY_ANNOTATION
from sim.scenario import ModelSpec, NodeGroup, Scenario, WorkloadSpec

Obj = dict[str, Any]
APP_LABEL = "app.kubernetes.io/name"
KUBELET_VERSION = "v1.37.1"


def node_names(group: NodeGroup) -> list[str]:
    return [group.node_name(i) for i in range(group.count)]


def build_nodes(scenario: Scenario) -> list[Obj]:
    dra = scenario.gpu_api == "dra"
    nodes = []
    index = 0
    for group in scenario.nodes:
        for i, name in enumerate(node_names(group)):
            index += 1
            labels = {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.product": group.gpu_product,
                "nvidia.com/gpu.count": str(group.gpus),
                # What GPU feature discovery labels a GPU node with: the GPU DaemonSets' nodeSelector.
                **({GPU_PRESENT_LABEL: "true"} if group.gpus else {}),
                **group.labels_of(i),
            }
            resources = {
                "cpu": group.cpu,
                "memory": group.memory,
                "pods": "110",
                **({} if dra else {GPU_RESOURCE: str(group.gpus)}),
            }
            zone = labels.get("topology.kubernetes.io/zone", "zone-a")
            nodes.append(
                {
                    "metadata": {
                        "name": name,
                        "labels": labels,
                        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
                    },
                    # The cloud provider's id of the machine: a replaced machine gets a new one.
                    "spec": {
                        "providerID": f"aws:///{zone}/i-{o.stable_hash(name, 17)}",
                        **({"unschedulable": True} if group.unschedulable else {}),
                    },
                    "status": {
                        "capacity": dict(resources),
                        "allocatable": dict(resources),
                        "addresses": [
                            {"type": "InternalIP", "address": f"127.11.{index // 250}.{index % 250 + 1}"},
                            {"type": "Hostname", "address": name},
                        ],
                        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                        "nodeInfo": {
                            "architecture": "amd64",
                            "bootID": f"boot-{name}",
                            "containerRuntimeVersion": "containerd://1.7.27",
                            "kernelVersion": "6.8.0-60-generic",
                            "kubeProxyVersion": KUBELET_VERSION,
                            "kubeletVersion": KUBELET_VERSION,
                            "machineID": f"machine-{name}",
                            "operatingSystem": "linux",
                            "osImage": "Ubuntu 22.04.5 LTS",
                            "systemUUID": f"uuid-{name}",
                        },
                    },
                }
            )
    return nodes


def claim_template_name(workload: WorkloadSpec) -> str:
    return f"{workload.name}-gpus"


def _container(model: ModelSpec, revision: str, *, dra: bool = False) -> Obj:
    image = model.revision(revision).image
    args = [
        "--model",
        model.served_name,
        "--tensor-parallel-size",
        str(model.gpus_per_pod),
        "--port",
        str(model.container_port),
    ]
    if model.pods_per_replica > 1:
        args += ["--pipeline-parallel-size", str(model.pods_per_replica)]
    if model.shutdown_timeout_s:
        args += ["--shutdown-timeout", str(int(model.shutdown_timeout_s))]
    gpus = {GPU_RESOURCE: str(model.gpus_per_pod)} if model.gpus_per_pod and not dra else {}
    resources: Obj = {"requests": dict(gpus), "limits": dict(gpus)}
    if dra and model.gpus_per_pod:
        resources["claims"] = [{"name": "gpus"}]
    return {
        "name": "vllm",
        "image": image,
        "args": args,
        "ports": [{"name": "http", "containerPort": model.container_port, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": model.container_port, "scheme": "HTTP"},
            "periodSeconds": 5,
            "failureThreshold": 3,
            "successThreshold": 1,
            "timeoutSeconds": 1,
        },
    }


def _pod_template(
    workload: WorkloadSpec,
    model: ModelSpec,
    revision: str,
    role: str,
    *,
    router_label: bool,
    dra: bool = False,
) -> Obj:
    labels = {
        APP_LABEL: workload.name,
        ROLE_LABEL: role,
        MODEL_LABEL: model.name,
        REVISION_LABEL: revision,
        **workload.extra_labels,
    }
    if router_label:
        labels[ROUTER_LABEL] = ROUTER_LABEL_VALUE
    spec: Obj = {
        "containers": [_container(model, revision, dra=dra)],
        "terminationGracePeriodSeconds": model.termination_grace_s,
    }
    if dra and model.gpus_per_pod:
        spec["resourceClaims"] = [
            {"name": "gpus", "resourceClaimTemplateName": claim_template_name(workload)}
        ]
    if workload.readiness_gate:
        spec["readinessGates"] = [{"conditionType": SERVING_READY_CONDITION}]
    return {"metadata": {"labels": labels}, "spec": spec}


def _selector(workload: WorkloadSpec, role: str) -> Obj:
    match = {APP_LABEL: workload.name, ROLE_LABEL: role}
    if workload.selector_includes_router_label and role == ROLE_SERVING:
        match[ROUTER_LABEL] = ROUTER_LABEL_VALUE
    return {"matchLabels": match}


def _deployment(
    name: str,
    namespace: str,
    workload: WorkloadSpec,
    model: ModelSpec,
    revision: str,
    role: str,
    replicas: int,
    dra: bool = False,
) -> Obj:
    router = role == ROLE_SERVING and workload.router_label_on_pods
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {APP_LABEL: workload.name, MODEL_LABEL: model.name, ROLE_LABEL: role},
        },
        "spec": {
            "replicas": replicas,
            "selector": _selector(workload, role),
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": 600,
            "template": _pod_template(workload, model, revision, role, router_label=router, dra=dra),
        },
    }


def _lws(
    name: str,
    namespace: str,
    workload: WorkloadSpec,
    model: ModelSpec,
    revision: str,
    role: str,
    replicas: int,
    dra: bool = False,
) -> Obj:
    router = role == ROLE_SERVING and workload.router_label_on_pods
    leader = _pod_template(workload, model, revision, role, router_label=router, dra=dra)
    leader["metadata"]["labels"]["role"] = "leader"
    worker = _pod_template(workload, model, revision, role, router_label=False, dra=dra)
    worker["metadata"]["labels"]["role"] = "worker"
    topology = workload.topology_key or NVLINK_DOMAIN_LABEL
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {APP_LABEL: workload.name, MODEL_LABEL: model.name, ROLE_LABEL: role},
            "annotations": {EXCLUSIVE_TOPOLOGY_ANNOTATION: topology},
        },
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"partition": 0, "maxUnavailable": 1, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": model.pods_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_pool(scenario: Scenario, workload: WorkloadSpec) -> list[tuple[str, Obj]]:
    namespace = scenario.workload_namespace(workload)
    model = scenario.model(workload.model)
    revision = workload.revision or model.revisions[0].name
    objs: list[tuple[str, Obj]] = []
    selector = {APP_LABEL: workload.name}
    if workload.kind == "LeaderWorkerSet":
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    if workload.service.select_router_label:
        selector[ROUTER_LABEL] = ROUTER_LABEL_VALUE
    objs.append(
        (
            "services",
            {
                "metadata": {
                    "name": workload.service.name or workload.name,
                    "namespace": namespace,
                    "labels": {APP_LABEL: workload.name, MODEL_LABEL: model.name},
                },
                "spec": {
                    "type": "ClusterIP",
                    "selector": selector,
                    "ports": [
                        {
                            "name": "http",
                            "port": workload.service.port,
                            "targetPort": model.container_port,
                            "protocol": "TCP",
                        }
                    ],
                    "publishNotReadyAddresses": workload.service.publish_not_ready_addresses,
                    "sessionAffinity": "None",
                    "ipFamilies": ["IPv4"],
                    "ipFamilyPolicy": "SingleStack",
                    "internalTrafficPolicy": "Cluster",
                },
                "status": {"loadBalancer": {}},
            },
        )
    )
    make = _lws if workload.kind == "LeaderWorkerSet" else _deployment
    plural = "leaderworkersets" if workload.kind == "LeaderWorkerSet" else "deployments"
    dra = scenario.gpu_api == "dra"
    if dra and model.gpus_per_pod:
        labels = {APP_LABEL: workload.name, MODEL_LABEL: model.name}
        template = dv.gpu_claim_template(claim_template_name(workload), namespace, model.gpus_per_pod, labels)
        objs.append(("resourceclaimtemplates", template))
    objs.append(
        (
            plural,
            make(workload.name, namespace, workload, model, revision, ROLE_SERVING, workload.replicas, dra),
        )
    )
    if workload.warm_spares:
        objs.append(
            (
                plural,
                make(
                    f"{workload.name}-spare",
                    namespace,
                    workload,
                    model,
                    revision,
                    ROLE_SPARE,
                    workload.warm_spares,
                    dra,
                ),
            )
        )
    if workload.pdb is not None:
        pdb_spec: Obj = {"selector": _selector(workload, ROLE_SERVING)}
        if workload.pdb.min_available is not None:
            pdb_spec["minAvailable"] = workload.pdb.min_available
        else:
            pdb_spec["maxUnavailable"] = workload.pdb.max_unavailable
        objs.append(
            (
                "poddisruptionbudgets",
                {"metadata": {"name": workload.name, "namespace": namespace}, "spec": pdb_spec},
            )
        )
    return objs


NODE_LEASE_NAMESPACE = "kube-node-lease"
GPU_OPERATOR_NAMESPACE = "gpu-operator"
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"


def _daemonset(name: str, namespace: str, image: str, node_selector: Obj, tolerations: list[Obj]) -> Obj:
    labels = {"app": name}
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "updateStrategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
            },
            "revisionHistoryLimit": 10,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "nodeSelector": dict(node_selector),
                    "tolerations": tolerations,
                    "priorityClassName": "system-node-critical",
                    "containers": [{"name": name, "image": image, "resources": {}}],
                    # Scratch space, as the real ones mount: why drain needs --delete-emptydir-data.
                    "volumes": [{"name": "scratch", "emptyDir": {}}],
                },
            },
        },
    }


def build_node_daemonsets(scenario: Scenario) -> list[tuple[str, Obj]]:
    """The node agents every GPU cluster runs as DaemonSets, one pod per GPU node: the DCGM exporter
    and the device plugin (GPU operator), and node-problem-detector. Plain containers (no model
    label): no engine, no GPU request; they are what ``kubectl drain --ignore-daemonsets`` leaves."""
    if not any(group.gpus for group in scenario.nodes):
        return []
    gpu_nodes = {GPU_PRESENT_LABEL: "true"}
    gpu_taint = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    if scenario.gpu_api == "dra":
        gpu_agent = _daemonset(
            "nvidia-dra-driver-gpu-kubelet-plugin",
            GPU_OPERATOR_NAMESPACE,
            "nvcr.io/nvidia/k8s-dra-driver-gpu:v25.8.0",
            gpu_nodes,
            gpu_taint,
        )
    else:
        gpu_agent = _daemonset(
            "nvidia-device-plugin-daemonset",
            GPU_OPERATOR_NAMESPACE,
            "nvcr.io/nvidia/k8s-device-plugin:v0.17.2",
            gpu_nodes,
            gpu_taint,
        )
    return [
        (
            "daemonsets",
            _daemonset(
                "nvidia-dcgm-exporter",
                GPU_OPERATOR_NAMESPACE,
                "nvcr.io/nvidia/k8s/dcgm-exporter:4.2.3-4.1.3-ubuntu22.04",
                gpu_nodes,
                gpu_taint,
            ),
        ),
        ("daemonsets", gpu_agent),
        (
            "daemonsets",
            _daemonset(
                "node-problem-detector",
                "kube-system",
                "registry.k8s.io/node-problem-detector/node-problem-detector:v0.8.21",
                gpu_nodes,
                [{"operator": "Exists", "effect": "NoSchedule"}],
            ),
        ),
    ]


def build_objects(scenario: Scenario) -> list[tuple[str, Obj]]:
    """(plural, object) pairs in creation order."""
    # `fleetmend`: where fleetmend runs (deploy/k8s), and so where its qualification Jobs run.
    namespaces = {
        "default",
        "kube-system",
        "kube-public",
        NODE_LEASE_NAMESPACE,
        "fleetmend",
        GPU_OPERATOR_NAMESPACE,
        scenario.namespace,
    } | {scenario.workload_namespace(w) for w in scenario.workloads}
    objs: list[tuple[str, Obj]] = [
        (
            "namespaces",
            {
                "metadata": {"name": ns, "labels": {"kubernetes.io/metadata.name": ns}},
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            },
        )
        for ns in sorted(namespaces)
    ]
    objs += [("nodes", node) for node in build_nodes(scenario)]
    if scenario.gpu_api == "dra":
        objs.append(("deviceclasses", dv.device_class()))
        for group in scenario.nodes:
            if group.gpus:
                product = group.gpu_product.replace("-", " ")
                objs += [
                    ("resourceslices", dv.resource_slice(n, group.gpus, product)) for n in node_names(group)
                ]
    for workload in scenario.workloads:
        objs += build_pool(scenario, workload)
    objs += build_node_daemonsets(scenario)
    return objs


def rollout_patch(scenario: Scenario, workload: WorkloadSpec) -> tuple[str, str, str, Callable[[Obj], None]]:
    """The change a CI pipeline makes to roll ``workload`` to its ``rollout.to_revision``."""
    assert workload.rollout is not None
    model = scenario.model(workload.model)
    revision = workload.rollout.to_revision
    image = model.revision(revision).image
    namespace = scenario.workload_namespace(workload)

    def retemplate(template: Obj) -> None:
        template["metadata"]["labels"][REVISION_LABEL] = revision
        for container in template["spec"]["containers"]:
            container["image"] = image

    if workload.kind == "LeaderWorkerSet":

        def change_lws(obj: Obj) -> None:
            lwt = obj["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if lwt.get(key):
                    retemplate(lwt[key])

        return "leaderworkersets", namespace, workload.name, change_lws

    def change_deployment(obj: Obj) -> None:
        retemplate(obj["spec"]["template"])

    return "deployments", namespace, workload.name, change_deployment
