"""``fleet.fence``: the fence at detection cordons a node only while it is lost and schedulable."""

from __future__ import annotations

import pytest

from fleet.fence import FenceVerdict, fence_decision, fence_workflow_id
from fleet.pool import NodeInfo


@pytest.mark.parametrize(
    ("info", "verdict", "says"),
    [
        (NodeInfo(name="n1", ready=None), FenceVerdict.CORDON, "Ready=Unknown"),
        (NodeInfo(name="n1", ready=False), FenceVerdict.CORDON, "Ready=False"),
        (NodeInfo(name="n1", ready=None, unschedulable=True), FenceVerdict.ALREADY_CORDONED, "already"),
        (NodeInfo(name="n1", ready=True), FenceVerdict.READY_AGAIN, "Ready again"),
        (NodeInfo(name="n1", ready=True, gpu_problems=("GpuXid",)), FenceVerdict.CORDON, "shows GpuXid"),
        (
            NodeInfo(name="n1", ready=True, gpu_problems=("GpuXid",), unschedulable=True),
            FenceVerdict.ALREADY_CORDONED,
            "already",
        ),
        (None, FenceVerdict.GONE, "no longer in the cluster"),
    ],
)
def test_the_fence_cordons_a_lost_schedulable_node_and_says_why_it_leaves_any_other(
    info: NodeInfo | None, verdict: FenceVerdict, says: str
) -> None:
    decision = fence_decision("n1", info)
    assert decision.verdict is verdict and says in decision.reason and "n1" in decision.reason


def test_one_fence_id_per_node() -> None:
    assert fence_workflow_id("gpu-node-7") == "fence/gpu-node-7" != fence_workflow_id("gpu-node-70")
