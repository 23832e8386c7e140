"""``kube.allocation`` and ``kube.cache``: what a look reads from one watch instead of listing, against
the simulated API server.

Each must agree with a list at all times it answers, follow a change, and stop answering (so a look
lists instead) once its watch is broken.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from kubernetes import client, config

from activities import kube_reads as kr
from kube.allocation import GpuAllocation, allocation_of
from kube.cache import WatchedObjects
from kube.client import KubeApis
from sim.runner import RunningSim, start_sim
from sim.scenario import shipped_scenarios
from tests.sim.support import TEST_SPEED, wait_for


@pytest.fixture
def world() -> Iterator[tuple[RunningSim, KubeApis]]:
    running = start_sim(shipped_scenarios()["gpu-node-loss"], speed=TEST_SPEED, serving=False)
    api = config.new_client_from_config(config_file=str(running.kubeconfig), context="sim")
    try:
        yield running, KubeApis(
            client.CoreV1Api(api), client.AppsV1Api(api), client.DiscoveryV1Api(api),
            client.CustomObjectsApi(api), client.PolicyV1Api(api), client.BatchV1Api(api),
            client.ResourceV1Api(api),
        )  # fmt: skip
    finally:
        api.close()
        running.stop()


def _pod(name: str, node: str, gpus: int) -> Any:  # a manifest (the client takes dicts too)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "c", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}
            ],
        },
    }


def test_the_watch_agrees_with_a_list_follows_binds_and_deletes_and_steps_aside_when_broken(
    world: tuple[RunningSim, KubeApis],
) -> None:
    running, k = world
    cache = GpuAllocation(k.core.list_pod_for_all_namespaces).start()
    try:
        listed = allocation_of(kr.list_all_pods(k))
        assert sum(listed.values()) > 0, "the scenario's engines hold GPUs"
        assert wait_for(cache.allocated, 10, "the first list") == listed

        node = next(n for n, used in sorted(listed.items()) if used)
        k.core.create_namespaced_pod("default", _pod("gpu-tenant", node, 2))
        wait_for(lambda: (cache.allocated() or {}).get(node) == listed[node] + 2, 10, "the bound pod counted")
        assert cache.allocated() == allocation_of(kr.list_all_pods(k))
        on_node = {p["metadata"]["name"] for p in kr.list_all_pods(k, node)}  # the field-selected list
        assert "gpu-tenant" in on_node and all(
            p["spec"]["nodeName"] == node for p in kr.list_all_pods(k, node)
        )

        k.core.delete_namespaced_pod("gpu-tenant", "default", grace_period_seconds=0)
        wait_for(lambda: (cache.allocated() or {}).get(node) == listed[node], 10, "the deleted pod uncounted")

        running.stop()  # the API server goes: the watch breaks, and the cache no longer answers
        wait_for(lambda: cache.allocated() is None, 30, "the broken watch to step aside")
    finally:
        cache.stop()


def test_watched_nodes_and_deployments_agree_with_lists_follow_a_cordon_and_step_aside_when_broken(
    world: tuple[RunningSim, KubeApis],
) -> None:
    """``kube.cache.WatchedObjects``: what a look reads instead of listing every Node and Deployment."""
    running, k = world
    nodes = WatchedObjects("nodes", k.core.list_node).start()
    ns = "inference"  # watched per namespace, as the worker's RBAC grants Deployments
    deployments = WatchedObjects("deployments", partial(k.apps.list_namespaced_deployment, ns)).start()
    try:

        def names(objs: list[dict[str, Any]] | None) -> set[str] | None:
            return None if objs is None else {o["metadata"]["name"] for o in objs}

        listed = {n["metadata"]["name"] for n in kr.list_nodes(k)}
        assert wait_for(lambda: names(nodes.items()), 10, "the first node list") == listed
        in_ns = {d["metadata"]["name"] for d in kr.list_deployments(k, ns)}
        assert in_ns and wait_for(lambda: names(deployments.items(ns)), 10, "the deployments") == in_ns
        assert deployments.items("no-such-namespace") == []

        node = sorted(listed)[0]
        k.core.patch_node(node, {"spec": {"unschedulable": True}})

        def cordoned() -> bool:
            return any(
                n["metadata"]["name"] == node and n["spec"].get("unschedulable") for n in nodes.items() or []
            )

        wait_for(cordoned, 10, "the cordon seen through the watch")
        name = sorted(in_ns)[0]
        k.apps.patch_namespaced_deployment(name, ns, {"metadata": {"labels": {"watched": "yes"}}})
        wait_for(
            lambda: any(
                d["metadata"]["name"] == name and d["metadata"]["labels"].get("watched") == "yes"
                for d in deployments.items(ns) or []
            ),
            10,
            "the namespaced Deployment watch follows a change",
        )

        running.stop()
        wait_for(lambda: nodes.items() is None, 30, "the broken node watch to step aside")
        assert not nodes.fresh()
    finally:
        nodes.stop()
        deployments.stop()
