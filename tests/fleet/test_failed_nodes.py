"""Which nodes a loss failed: a crashed pod on a Ready node fails no node (no cordon, no triage, its
spares stay promotable); a node that is gone, not Ready, named by a report or by a hardware hint does."""

from __future__ import annotations

from fleet.incident import LossReport
from fleet.loss import failed_nodes, match_reports
from fleet.pool import GroupRole
from fleet.spares import pick_spares

from .fleets import POOL, group, node, snapshot


def _report(**kw: object) -> LossReport:
    return LossReport(pool=POOL, fingerprint="fp", alert_name="a", **kw)  # type: ignore[arg-type]


LOST = group("g0", nodes=("n1",))
SPARE = group("s0", nodes=("n1",), role=GroupRole.SPARE)
WORLD = snapshot([LOST, group("g1", nodes=("n2",)), SPARE])


def test_a_pod_level_report_that_names_its_node_fails_no_node_and_the_spare_beside_it_is_promoted() -> None:
    # The fast path names a crashed pod's node too; the report is about the pod.
    report = _report(pod=LOST.pods[0], node="n1", replica_group="g0", about="pod")
    assert failed_nodes([LOST], WORLD, [report]) == {}
    # The spare beside it is a candidate (confirmed on its own evidence), and stays promotable.
    assert set(match_reports(WORLD, [report])) == {"g0", "s0"}
    pick = pick_spares(WORLD, ["g0"], sorted(failed_nodes([LOST], WORLD, [report])))
    assert pick.promotions == {"g0": "s0"}


def test_a_report_about_the_node_a_node_not_ready_and_a_hardware_hint_each_fail_it() -> None:
    about_node = _report(node="n1")  # an alert with only a node: about the node
    assert failed_nodes([LOST], WORLD, [about_node]) == {"n1": "a report is about the node itself"}
    assert set(match_reports(WORLD, [about_node])) == {"g0", "s0"}
    fast_path_node = _report(node="n1", pod=LOST.pods[0], replica_group="g0", about="node")
    assert "n1" in failed_nodes([LOST], WORLD, [fast_path_node])
    xid = _report(pod=LOST.pods[0], fault_hint="gpu-xid:79")
    assert failed_nodes([LOST], WORLD, [xid]) == {"n1": "the fault hint names the hardware (gpu-xid:79)"}
    silent = snapshot([LOST, SPARE], nodes=[node("n1", ready=None)])
    assert failed_nodes([LOST], silent, [_report(pod=LOST.pods[0])]) == {"n1": "Ready=None"}
    gone = snapshot([LOST], nodes=[])
    assert failed_nodes([LOST], gone, [_report(pod=LOST.pods[0])]) == {"n1": "gone from the API"}
