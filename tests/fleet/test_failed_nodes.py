"""Which nodes a loss failed: a crashed pod on a Ready node fails no node (no cordon, no triage, its
spares stay promotable); a node that is gone, not Ready, named by a report or by a hardware hint, or
that went silent with its pods still reading Running and ready, does."""

from __future__ import annotations

from fleet.incident import LossReport
from fleet.loss import failed_nodes, match_reports, silent_nodes
from fleet.observation import EngineHealth, PodObservation
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


def _pod(pod: str, health: EngineHealth, **kw: object) -> PodObservation:
    return PodObservation(pod=pod, node="n1", engine_health=health, **kw)  # type: ignore[arg-type]


def test_a_machine_that_went_silent_fails_its_node_a_container_the_kubelet_saw_die_does_not() -> None:
    lost_pod, spare_pod = LOST.pods[0], SPARE.pods[0]
    pod_report = [_report(pod=lost_pod)]
    # The machine died: its kubelet with it, so its pods still read Running and ready, unanswering.
    dead = {
        lost_pod: _pod(lost_pod, EngineHealth.UNREACHABLE),
        spare_pod: _pod(spare_pod, EngineHealth.UNREACHABLE),
    }
    silent = silent_nodes([LOST], dead)
    assert set(silent) == {"n1"} and "went silent" in silent["n1"], silent
    assert failed_nodes([LOST], WORLD, pod_report, silent) == silent
    # An OOM-killed engine: the kubelet reported it (terminated, not ready, restarted).
    oom = {
        lost_pod: _pod(
            lost_pod,
            EngineHealth.UNREACHABLE,
            containers_ready=False,
            terminated_reason="OOMKilled",
            restart_count=1,
        ),
        spare_pod: _pod(spare_pod, EngineHealth.UNREACHABLE),
    }
    assert silent_nodes([LOST], oom) == {}
    # Another engine on the node answers: the machine is alive, whatever killed this one.
    beside = {lost_pod: _pod(lost_pod, EngineHealth.UNREACHABLE), spare_pod: _pod(spare_pod, EngineHealth.OK)}
    assert silent_nodes([LOST], beside) == {}
    assert failed_nodes([LOST], WORLD, pod_report, silent_nodes([LOST], beside)) == {}
    # A pod its controller is deleting, or one whose engine answers 503, is no silent machine either.
    assert silent_nodes([LOST], {lost_pod: _pod(lost_pod, EngineHealth.UNREACHABLE, deleting=True)}) == {}
    assert silent_nodes([LOST], {lost_pod: _pod(lost_pod, EngineHealth.FAILING)}) == {}
