"""What a caller of ``perform`` sees: apply once, replay after, refuse divergent reuse, dry runs, failures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text

from ledger import (
    Attempt,
    CallableEffect,
    Delivery,
    DivergentOperation,
    EffectAttemptError,
    EffectContext,
    EffectFailed,
    EffectLedger,
    InvalidEffectRequest,
    NeedsOperator,
    OperationInProgress,
)
from tests.ledger.world import NoProbeWorldEffect, RefusingEffect, SimulatedCrash, World, WorldEffect

CTX = EffectContext(
    workflow_id="replica-loss/default/llama-70b",
    run_id="run-1",
    step="deroute",
    alert_fingerprints=["fp-1", "fp-2"],
    requested_by="worker-a",
)


def test_first_call_applies_and_every_repeat_returns_the_stored_result(
    ledger: EffectLedger, world: World
) -> None:
    effect = WorldEffect(world)
    first = ledger.perform(
        "wf/deroute/pod-1", "router.label.remove", "pod-1", {"label": "serving"}, effect, context=CTX
    )
    assert first.state == "applied" and not first.replayed
    assert first.result == {"seq": 1}
    assert (first.workflow_id, first.step, first.alert_fingerprints) == (
        CTX.workflow_id,
        "deroute",
        ["fp-1", "fp-2"],
    )

    for _ in range(3):
        again = ledger.perform(
            "wf/deroute/pod-1", "router.label.remove", "pod-1", {"label": "serving"}, effect
        )
        assert again.replayed and again.result == first.result
    assert effect.applies == 1 and effect.probes == 0
    assert world.count("wf/deroute/pod-1") == 1


def test_same_op_id_with_different_params_is_divergent_never_applied(
    ledger: EffectLedger, world: World
) -> None:
    effect = WorldEffect(world)
    original = ledger.perform("req-7/0", "ticket.create", "oncall", {"title": "GPU lost"}, effect)

    with pytest.raises(DivergentOperation) as caught:
        ledger.perform("req-7/0", "ticket.create", "oncall", {"title": "GPU lost twice"}, effect)
    assert caught.value.non_retryable
    assert caught.value.outcome.result == original.result  # the original outcome is reported back
    assert caught.value.outcome.params == {"title": "GPU lost"}
    with pytest.raises(DivergentOperation):
        ledger.perform("req-7/0", "ticket.create", "other-queue", {"title": "GPU lost"}, effect)

    assert effect.applies == 1 and world.count("req-7/0") == 1
    row = ledger.get("req-7/0")
    assert row is not None and row.state == "applied" and row.divergences == 2
    with ledger.engine.connect() as conn:
        seen = conn.execute(text("SELECT target, params FROM ledger_divergences ORDER BY id")).all()
    assert [(t, p) for t, p in seen] == [
        ("oncall", {"title": "GPU lost twice"}),
        ("other-queue", {"title": "GPU lost"}),
    ]


def test_params_are_compared_canonically(ledger: EffectLedger, world: World) -> None:
    effect = WorldEffect(world)
    ledger.perform("op-canon", "k", "t", {"a": 1, "b": {"y": 2, "x": 1}}, effect)
    again = ledger.perform("op-canon", "k", "t", {"b": {"x": 1, "y": 2}, "a": 1}, effect)
    assert again.replayed and effect.applies == 1


def test_dry_run_records_planned_and_never_touches_the_target(ledger: EffectLedger, world: World) -> None:
    effect = WorldEffect(world)
    planned = ledger.perform("dry/op", "k8s.cordon", "node-3", {}, effect, context=CTX, dry_run=True)
    assert planned.state == "planned"
    assert ledger.perform("dry/op", "k8s.cordon", "node-3", {}, effect, dry_run=True).state == "planned"
    assert effect.applies == 0 and effect.probes == 0 and world.count("dry/op") == 0

    # The same operation performed for real afterwards is applied once (a plan was never dispatched).
    real = ledger.perform("dry/op", "k8s.cordon", "node-3", {}, effect)
    assert real.state == "applied" and effect.applies == 1 and effect.probes == 0
    # A dry run of an applied op shows the applied outcome; it does not re-plan it.
    assert ledger.perform("dry/op", "k8s.cordon", "node-3", {}, effect, dry_run=True).state == "applied"


def test_permanent_refusal_is_recorded_failed_and_raised_non_retryable(ledger: EffectLedger) -> None:
    effect = RefusingEffect()
    with pytest.raises(EffectFailed) as caught:
        ledger.perform("wf/quarantine/gpu-9", "k8s.cordon", "gpu-9", {}, effect)
    assert caught.value.non_retryable
    assert "does not exist" in (caught.value.outcome.error or "")
    # The repeat gets the same answer without touching the target.
    with pytest.raises(EffectFailed):
        ledger.perform("wf/quarantine/gpu-9", "k8s.cordon", "gpu-9", {}, effect)
    assert effect.applies == 1
    row = ledger.get("wf/quarantine/gpu-9")
    assert row is not None and row.state == "failed"


def test_transient_error_surfaces_for_retry_and_the_retry_probes(ledger: EffectLedger, world: World) -> None:
    def flaky_after_landing(attempt: Attempt) -> None:
        raise TimeoutError("read timeout after the request was sent")

    effect = WorldEffect(world, after_land=flaky_after_landing)
    with pytest.raises(EffectAttemptError) as caught:
        ledger.perform("wf/weights/pool", "router.weights", "pool", {"w": 30}, effect)
    assert not getattr(caught.value, "non_retryable", False)
    row = ledger.get("wf/weights/pool")
    assert row is not None and row.state == "claimed" and "read timeout" in (row.error or "")

    # Temporal retries the activity: the retry looks at the target first, finds it landed, records it.
    retry = ledger.perform("wf/weights/pool", "router.weights", "pool", {"w": 30}, WorldEffect(world))
    assert retry.state == "applied" and retry.replayed and retry.fence == 2
    assert world.count("wf/weights/pool") == 1


def test_transient_error_before_landing_is_applied_by_the_retry(ledger: EffectLedger, world: World) -> None:
    def refuse_connection(attempt: Attempt) -> None:
        raise ConnectionRefusedError("router admin API down")

    with pytest.raises(EffectAttemptError):
        ledger.perform(
            "wf/admission/pool",
            "router.admission",
            "pool",
            {},
            WorldEffect(world, before_land=refuse_connection),
        )
    retry_effect = WorldEffect(world)
    outcome = ledger.perform("wf/admission/pool", "router.admission", "pool", {}, retry_effect)
    assert outcome.state == "applied" and not outcome.replayed
    assert retry_effect.probes == 1 and retry_effect.applies == 1 and world.count("wf/admission/pool") == 1


def test_live_lease_of_another_worker_is_waited_for_then_reported_in_progress(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    holder = make_ledger(owner="holder", lease_seconds=60)
    # A crashed holder: its claim is in the ledger, its lease still live.
    with pytest.raises(SimulatedCrash):
        holder.perform("op-held", "k", "t", {}, WorldEffect(world, before_land=_crash))
    impatient = make_ledger(owner="other", wait_seconds=0.2)
    with pytest.raises(OperationInProgress, match="holder"):
        impatient.perform("op-held", "k", "t", {}, WorldEffect(world))
    assert world.count("op-held") == 0


def test_at_most_once_kind_hands_an_unknown_outcome_to_an_operator(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    crashing = make_ledger(owner="w1", lease_seconds=0.2)
    with pytest.raises(SimulatedCrash):
        crashing.perform(
            "notify/1",
            "notify.post",
            "#incident",
            {"text": "hi"},
            NoProbeWorldEffect(world, Delivery.AT_MOST_ONCE, after_land=_crash),
        )
    retry = make_ledger(owner="w2")
    with pytest.raises(NeedsOperator) as caught:
        retry.perform(
            "notify/1",
            "notify.post",
            "#incident",
            {"text": "hi"},
            NoProbeWorldEffect(world, Delivery.AT_MOST_ONCE),
        )
    assert caught.value.outcome.state == "needs_operator" and caught.value.outcome.delivery == "at_most_once"
    assert world.count("notify/1") == 1  # never repeated


def test_at_least_once_kind_repeats_an_unknown_outcome_and_says_so(
    make_ledger: Callable[..., EffectLedger], world: World
) -> None:
    crashing = make_ledger(owner="w1", lease_seconds=0.2)
    with pytest.raises(SimulatedCrash):
        crashing.perform(
            "notify/2",
            "notify.post",
            "#incident",
            {"text": "hi"},
            NoProbeWorldEffect(world, Delivery.AT_LEAST_ONCE, after_land=_crash),
        )
    outcome = make_ledger(owner="w2").perform(
        "notify/2",
        "notify.post",
        "#incident",
        {"text": "hi"},
        NoProbeWorldEffect(world, Delivery.AT_LEAST_ONCE),
    )
    assert outcome.state == "applied" and outcome.delivery == "at_least_once" and outcome.attempts == 2
    assert world.count("notify/2") == 2  # the declared trade-off: a duplicate chat message, never a lost one


@pytest.mark.parametrize(
    ("op_id", "params", "effect", "message"),
    [
        ("", {}, None, "non-empty"),
        ("x" * 300, {}, None, "at most 255"),
        ("ok", {"when": object()}, None, "JSON-serialisable"),
        ("ok", ["not", "a", "dict"], None, "JSON object"),
        ("ok", {}, CallableEffect(lambda a: {}), "has no probe"),
    ],
)
def test_bad_requests_are_refused_with_a_clear_error_and_nothing_recorded(
    ledger: EffectLedger, world: World, op_id: str, params: Any, effect: Any, message: str
) -> None:
    with pytest.raises(InvalidEffectRequest, match=message):
        ledger.perform(op_id, "k", "t", params, effect or WorldEffect(world))
    with ledger.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM ledger_effects")).scalar_one() == 0


def _crash(attempt: Attempt) -> None:
    raise SimulatedCrash("worker died")
