"""``kubectl auth can-i`` against the simulator loaded with deploy/k8s's RBAC: the admin asks as each
fleetmend ServiceAccount (``--as``), and each component's own kubeconfig asks for itself; the answers
are those of the shipped Roles, and a call outside them is the API server's 403."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kubectl.support import NS, Cluster, table
from worker.devstack.rbac_wiring import COMPONENTS, grant_components

WORKER = "--as=system:serviceaccount:fleetmend:fleetmend-worker"
WEBHOOK = "--as=system:serviceaccount:fleetmend:fleetmend-webhook"
GATEWAY = "--as=system:serviceaccount:fleetmend:fleetmend-gateway"


@pytest.fixture
def kubeconfigs(cluster: Cluster) -> dict[str, Path]:
    return grant_components(Path(cluster.sim.kubeconfig))


def _rules(output: str) -> dict[str, list[str]]:
    """``kubectl auth can-i --list``: resource -> verbs (non-resource URL rows left out)."""
    rows = table(output)
    assert rows[0] == ["Resources", "Non-Resource URLs", "Resource Names", "Verbs"], rows[0]
    return {row[0]: row[-1].strip("[]").split() for row in rows[1:] if not row[0].startswith("[")}


def test_can_i_list_as_the_worker_shows_its_roles_in_the_pool_namespace(
    cluster: Cluster, kubeconfigs: dict[str, Path]
) -> None:
    listed = _rules(cluster.kubectl("auth", "can-i", "--list", WORKER, "-n", NS).stdout)
    assert listed["pods"] == [
        "list",
        "watch",
        "get",
        "patch",
        "delete",
    ]  # cluster Role first, then the pool's
    assert listed["nodes"] == ["get", "list", "watch", "patch"]
    assert listed["pods/status"] == ["patch"]
    assert listed["deployments.apps/scale"] == ["patch"]
    assert listed["selfsubjectaccessreviews.authorization.k8s.io"] == ["create"]
    assert "secrets" not in listed and "jobs.batch" not in listed  # Jobs only in fleetmend's namespace
    in_fleetmend = _rules(cluster.kubectl("auth", "can-i", "--list", WORKER, "-n", "fleetmend").stdout)
    assert in_fleetmend["jobs.batch"] == ["create", "get", "list", "delete"]
    assert in_fleetmend["leases.coordination.k8s.io"] == ["get", "create", "update"]


def test_the_runbooks_can_i_list_for_the_worker_verbatim(
    cluster: Cluster, kubeconfigs: dict[str, Path]
) -> None:
    """``kubectl auth can-i --list --as=system:serviceaccount:fleetmend:fleetmend-worker``: the
    kubeconfig's namespace (the pool's) with the worker's cluster-wide and per-pool rules."""
    done = cluster.kubectl("auth", "can-i", "--list", "--as=system:serviceaccount:fleetmend:fleetmend-worker")
    rows = {row[0]: row for row in table(done.stdout)[1:]}
    assert rows["pods"] == ["pods", "[]", "[]", "[list watch get patch delete]"]
    assert rows["leaderworkersets.leaderworkerset.x-k8s.io/scale"] == [
        "leaderworkersets.leaderworkerset.x-k8s.io/scale",
        "[]",
        "[]",
        "[patch]",
    ]
    assert ["[/api/*]", "[]", "[get]"] in table(done.stdout)  # discovery, as every account has
    assert "leases.coordination.k8s.io" not in rows  # the Lease is in fleetmend's namespace only


@pytest.mark.parametrize(
    ("who", "question", "answer"),
    [
        (WORKER, ("patch", "nodes"), "yes"),
        (WORKER, ("patch", "pods", "-n", NS), "yes"),
        (WORKER, ("patch", "pods", "-n", "default"), "no"),  # no pool RoleBinding there
        (WORKER, ("create", "jobs.batch", "-n", "fleetmend"), "yes"),
        (WORKER, ("get", "secrets", "-n", NS), "no"),
        (WEBHOOK, ("get", "pods", "-A"), "yes"),
        (WEBHOOK, ("patch", "pods", "-n", NS), "no"),
        (WEBHOOK, ("list", "nodes"), "no"),
        (GATEWAY, ("watch", "endpointslices.discovery.k8s.io", "-A"), "yes"),
        (GATEWAY, ("get", "pods", "-n", NS), "no"),
    ],
)
def test_can_i_answers_for_each_components_account(
    cluster: Cluster, kubeconfigs: dict[str, Path], who: str, question: tuple[str, ...], answer: str
) -> None:
    done = cluster.kubectl("auth", "can-i", *question, who, check=False)
    assert done.stdout.strip() == answer, done.stderr
    assert done.returncode == (0 if answer == "yes" else 1)


def test_each_components_own_kubeconfig_asks_for_itself_and_is_refused_outside_its_role(
    cluster: Cluster, kubeconfigs: dict[str, Path]
) -> None:
    assert set(kubeconfigs) == set(COMPONENTS)
    webhook = str(kubeconfigs["webhook"])
    done = cluster.kubectl("--kubeconfig", webhook, "auth", "can-i", "list", "pods", "-A")
    assert done.stdout.strip() == "yes"
    refused = cluster.kubectl("--kubeconfig", webhook, "get", "nodes", check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        'Error from server (Forbidden): nodes is forbidden: User "system:serviceaccount:fleetmend:fleetmend-webhook" '
        'cannot list resource "nodes" in API group "" at the cluster scope'
    )
    # Only the admin may impersonate.
    impersonating = cluster.kubectl(
        "--kubeconfig", webhook, "auth", "can-i", "get", "pods", WORKER, check=False
    )
    assert "cannot impersonate resource" in impersonating.stderr
    worker = str(kubeconfigs["worker"])
    pods = cluster.kubectl("--kubeconfig", worker, "get", "pods", "-n", NS, "-o", "name").stdout.split()
    assert pods and all(p.startswith("pod/") for p in pods)
