"""The fast path's detection policy: evidence -> loss / not-a-loss / wait, with hysteresis."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.detection import (
    Detection,
    DetectionPolicy,
    EntityState,
    Evidence,
    EvidenceKind,
    Verdict,
    observe,
)

POD = "pod:inference/llama-0"


def _run(kinds: list[EvidenceKind], latency: float | None = 0.01) -> list[Verdict]:
    """Verdicts for ``kinds`` on a replica that answered once before (that first OK is not returned)."""
    state, _ = observe(None, Evidence(entity=POD, kind=EvidenceKind.HEALTH_OK, at=-1.0, latency_s=0.01))
    verdicts = []
    for i, kind in enumerate(kinds):
        ok = kind in (EvidenceKind.HEALTH_OK, EvidenceKind.NODE_READY)
        state, d = observe(
            state, Evidence(entity=POD, kind=kind, at=float(i), latency_s=latency if ok else None)
        )
        verdicts.append(d.verdict)
    return verdicts


FAIL, OK = EvidenceKind.HEALTH_FAILED, EvidenceKind.HEALTH_OK


def test_two_consecutive_failed_health_checks_are_a_loss_with_the_evidence() -> None:
    s, _ = observe(None, Evidence(entity=POD, kind=OK, at=0.5, latency_s=0.01))
    s, first = observe(s, Evidence(entity=POD, kind=FAIL, at=1.0, detail="connection refused"))
    assert first.verdict is Verdict.WAIT and "1 of 2" in first.reason
    s, second = observe(s, Evidence(entity=POD, kind=FAIL, at=1.5, detail="HTTP 503"))
    assert second.loss and s.reported
    assert "2 consecutive failed checks" in second.reason and "HTTP 503" in second.reason
    assert [e.at for e in second.evidence] == [0.5, 1.0, 1.5]


def test_a_replica_that_never_answered_is_starting_not_lost() -> None:
    s: EntityState | None = None
    for i in range(5):
        s, d = observe(s, Evidence(entity=POD, kind=FAIL, at=float(i), detail="HTTP 503"))
        assert d.verdict is Verdict.WAIT and "has not answered a health check yet" in d.reason
    s, _ = observe(s, Evidence(entity=POD, kind=OK, at=5.0, latency_s=0.01))
    s, _ = observe(s, Evidence(entity=POD, kind=FAIL, at=6.0))
    _, d = observe(s, Evidence(entity=POD, kind=FAIL, at=7.0))
    assert d.loss


def test_node_not_ready_and_a_routed_pod_gone_are_losses_at_once() -> None:
    _, d = observe(
        None, Evidence(entity="node:gpu-node-0", kind=EvidenceKind.NODE_NOT_READY, at=1, detail="Unknown")
    )
    assert d.loss and "node Ready is not True" in d.reason
    _, d = observe(None, Evidence(entity=POD, kind=EvidenceKind.POD_GONE, at=1))
    assert d.loss and "pod gone while routed" in d.reason


def test_a_gpu_fault_on_a_serving_node_is_a_loss_at_once_reported_once_until_the_node_is_clean() -> None:
    node = "node:gpu-node-1"
    fault = Evidence(
        entity=node, kind=EvidenceKind.NODE_GPU_FAULT, at=1, detail="GpuXid=True: XidError Xid 79"
    )
    s, d = observe(None, fault)
    assert d.loss and "GPU fault on a serving node" in d.reason and "Xid 79" in d.reason
    s, again = observe(s, fault.model_copy(update={"at": 2}))  # the next node update: absorbed
    assert again.verdict is Verdict.WAIT and "already reported" in again.reason
    for at in (3, 4, 5):  # the condition cleared: three clean updates re-arm the node
        s, _ = observe(s, Evidence(entity=node, kind=EvidenceKind.NODE_READY, at=at))
    _, next_fault = observe(s, fault.model_copy(update={"at": 6}))
    assert next_fault.loss


def test_a_failed_rank_is_a_loss_of_its_leader_at_once_even_before_the_group_is_re_created() -> None:
    leader = "pod:inference/llama-405b-0"
    s, _ = observe(None, Evidence(entity=leader, kind=OK, at=0.5, latency_s=0.01))
    rank = Evidence(
        entity=leader, kind=EvidenceKind.RANK_FAILED, at=1, detail="rank llama-405b-0-1 restarted"
    )
    s, d = observe(s, rank)
    assert d.loss and "a rank of its multi-node group failed" in d.reason and "llama-405b-0-1" in d.reason
    # The LeaderWorkerSet then terminates the leader gracefully to re-create the group: absorbed.
    _, after = observe(s, Evidence(entity=leader, kind=EvidenceKind.POD_TERMINATED, at=2))
    assert not after.loss


def test_a_graceful_termination_is_planned_when_healthy_and_a_loss_when_it_was_failing() -> None:
    """A rollout deletes a healthy pod: not a loss. A LeaderWorkerSet re-creates a group whose rank
    died: its leader had failed a check before it was terminated: a loss."""
    TERMINATED = EvidenceKind.POD_TERMINATED
    assert _run([OK, TERMINATED, TERMINATED]) == [Verdict.WAIT, Verdict.WAIT, Verdict.WAIT]
    s, _ = observe(None, Evidence(entity=POD, kind=OK, at=0.0, latency_s=0.01))
    s, healthy = observe(s, Evidence(entity=POD, kind=TERMINATED, at=1.0, detail="endpoint terminating"))
    assert healthy.verdict is Verdict.WAIT and "planned, not a loss" in healthy.reason
    s, _ = observe(None, Evidence(entity=POD, kind=OK, at=0.0, latency_s=0.01))
    s, _ = observe(s, Evidence(entity=POD, kind=FAIL, at=1.0, detail="/health HTTP 500"))
    s, broken = observe(s, Evidence(entity=POD, kind=TERMINATED, at=1.2, detail="endpoint terminating"))
    assert broken.loss and "replacing a broken replica" in broken.reason
    _, again = observe(s, Evidence(entity=POD, kind=TERMINATED, at=1.4))
    assert not again.loss  # reported once


def test_a_slow_but_present_replica_is_not_a_loss_recorded_once_per_slow_spell() -> None:
    assert _run([OK, OK, OK], latency=1.2) == [Verdict.NOT_A_LOSS, Verdict.WAIT, Verdict.WAIT]
    s, d = observe(None, Evidence(entity=POD, kind=OK, at=0, latency_s=1.2))
    assert "slow but present" in d.reason and "not a loss" in d.reason
    s, _ = observe(s, Evidence(entity=POD, kind=OK, at=1, latency_s=0.01))  # fast again: the spell ends
    _, again = observe(s, Evidence(entity=POD, kind=OK, at=2, latency_s=1.2))
    assert again.verdict is Verdict.NOT_A_LOSS


def test_a_flapping_health_check_opens_nothing() -> None:
    assert Verdict.LOSS not in _run([FAIL, OK] * 20)


def test_a_loss_is_reported_once_while_its_check_flaps_and_again_only_after_it_was_healthy() -> None:
    verdicts = _run([FAIL, FAIL, OK, FAIL, FAIL, OK, OK, FAIL, FAIL, OK, OK, OK, FAIL, FAIL])
    assert verdicts.count(Verdict.LOSS) == 2
    assert verdicts[1] is Verdict.LOSS and verdicts[-1] is Verdict.LOSS  # re-armed by 3 good checks


def test_evidence_for_another_entity_is_refused() -> None:
    s, _ = observe(None, Evidence(entity=POD, kind=FAIL, at=0))
    with pytest.raises(ValueError, match="given to the state of"):
        observe(s, Evidence(entity="pod:inference/other", kind=FAIL, at=1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.booleans(), max_size=60))
def test_losses_need_consecutive_failures_and_a_clear_spell_between_them(oks: list[bool]) -> None:
    policy = DetectionPolicy()
    verdicts = _run([OK if ok else FAIL for ok in oks])
    losses = [i for i, v in enumerate(verdicts) if v is Verdict.LOSS]
    for i in losses:
        assert i >= 1 and not oks[i] and not oks[i - 1]  # two consecutive failures end in a loss
    for a, b in itertools.pairwise(losses):
        run = best = 0
        for ok in oks[a:b]:
            run = run + 1 if ok else 0
            best = max(best, run)
        assert best >= policy.successes_to_clear  # re-armed only by enough good checks in between


SUSPECT, PRESENT = EvidenceKind.GATEWAY_UNHEALTHY, EvidenceKind.GATEWAY_HEALTHY


def test_the_gateway_failing_an_engine_makes_a_suspect_its_own_checks_confirm() -> None:
    """Envoy's word alone counts no failure; it asks for the engine's own /health checks
    (``confirming``), and ``failures_to_confirm`` of them failing is the loss."""
    s, _ = observe(None, Evidence(entity=POD, kind=PRESENT, at=0.0, detail="health check passes"))
    assert s.answered and not s.confirming  # the gateway's passing check: it has answered
    s, d = observe(s, Evidence(entity=POD, kind=SUSPECT, at=1.0, detail="failed_active_health_check"))
    assert d.verdict is Verdict.WAIT and "suspect" in d.reason and "failed_active_health_check" in d.reason
    assert s.confirming and s.failures == 0
    s, d = observe(s, Evidence(entity=POD, kind=FAIL, at=1.1, detail="ConnectError"))
    assert d.verdict is Verdict.WAIT and s.confirming and s.failures == 1
    s, d = observe(s, Evidence(entity=POD, kind=FAIL, at=1.6, detail="ConnectError"))
    assert d.loss and s.reported and not s.confirming
    assert (
        "2 consecutive failed checks (health-failed (ConnectError), health-failed (ConnectError))" in d.reason
    )
    assert [e.kind for e in d.evidence] == [PRESENT, SUSPECT, FAIL, FAIL]
    # Envoy keeps failing it: absorbed by the open incident, nothing more to check.
    s, again = observe(s, Evidence(entity=POD, kind=SUSPECT, at=5.0))
    assert again.verdict is Verdict.WAIT and "already reported" in again.reason and not s.confirming


def test_a_suspect_that_answers_is_cleared_and_a_slow_answer_is_recorded_not_a_loss() -> None:
    s, _ = observe(None, Evidence(entity=POD, kind=PRESENT, at=0.0))
    s, _ = observe(s, Evidence(entity=POD, kind=SUSPECT, at=1.0, detail="failed_outlier_check"))
    cleared, d = observe(s, Evidence(entity=POD, kind=OK, at=1.1, latency_s=0.01))
    assert d.verdict is Verdict.WAIT and not cleared.confirming and cleared.failures == 0
    slow, d = observe(s, Evidence(entity=POD, kind=OK, at=1.1, latency_s=2.0))
    assert d.verdict is Verdict.NOT_A_LOSS and "slow but present" in d.reason and not slow.confirming


def test_an_engine_the_gateway_never_saw_answer_is_starting_whatever_its_checks_say() -> None:
    s, _ = observe(None, Evidence(entity=POD, kind=SUSPECT, at=0.0, detail="failed_active_health_check"))
    assert s.confirming and not s.answered
    for at in (0.1, 0.6, 1.1):
        s, d = observe(s, Evidence(entity=POD, kind=FAIL, at=at))
        assert d.verdict is Verdict.WAIT and "has not answered" in d.reason
    assert not s.confirming  # nothing more to check: its controller owns a start-up that fails


def test_a_reported_engine_the_gateway_passes_again_is_re_armed_by_its_own_checks() -> None:
    """The gateway's passing check counts as one good check and asks for more; the engine is
    re-armed after ``successes_to_clear`` in all, and a later failure is a new loss."""
    s, _ = observe(None, Evidence(entity=POD, kind=PRESENT, at=0.0))
    s, _ = observe(s, Evidence(entity=POD, kind=SUSPECT, at=1.0))
    s, _ = observe(s, Evidence(entity=POD, kind=FAIL, at=1.1))
    s, lost = observe(s, Evidence(entity=POD, kind=FAIL, at=1.6))
    assert lost.loss
    s, _ = observe(s, Evidence(entity=POD, kind=PRESENT, at=9.0))
    assert s.reported and s.confirming
    s, _ = observe(s, Evidence(entity=POD, kind=OK, at=9.1, latency_s=0.01))
    assert s.reported and s.confirming
    s, d = observe(s, Evidence(entity=POD, kind=OK, at=9.6, latency_s=0.01))
    assert "re-armed" in d.reason and not s.reported and not s.confirming
    s, _ = observe(s, Evidence(entity=POD, kind=SUSPECT, at=20.0))
    s, _ = observe(s, Evidence(entity=POD, kind=FAIL, at=20.1))
    _, again = observe(s, Evidence(entity=POD, kind=FAIL, at=20.6))
    assert again.loss


def test_an_endpoint_turning_not_ready_counts_one_failure_and_asks_for_checks() -> None:
    s, _ = observe(None, Evidence(entity=POD, kind=PRESENT, at=0.0))
    s, d = observe(s, Evidence(entity=POD, kind=EvidenceKind.ENDPOINT_NOT_READY, at=1.0))
    assert d.verdict is Verdict.WAIT and s.failures == 1 and s.confirming
    _, d = observe(s, Evidence(entity=POD, kind=FAIL, at=1.1))
    assert d.loss


def test_a_spell_starts_at_its_first_failing_evidence_after_the_entity_last_answered() -> None:
    def ev(kind: EvidenceKind, at: float) -> Evidence:
        return Evidence(entity="pod:inference/a", kind=kind, at=at)

    kept = (
        ev(EvidenceKind.GATEWAY_HEALTHY, 10.0),  # minutes before the loss
        ev(EvidenceKind.HEALTH_FAILED, 300.0),
        ev(EvidenceKind.HEALTH_OK, 301.0),
        ev(EvidenceKind.GATEWAY_UNHEALTHY, 400.0),
        ev(EvidenceKind.HEALTH_FAILED, 400.5),
    )
    assert (
        Detection(entity="pod:inference/a", verdict=Verdict.LOSS, reason="", evidence=kept).spell_started_at
        == 400.0
    )
    healthy = Detection(entity="pod:inference/a", verdict=Verdict.WAIT, reason="", evidence=kept[:1])
    assert healthy.spell_started_at is None
