"""fleetmend's Temporal payloads across releases (``worker.payloads``): a field of a newer release is
dropped, anything else wrong is still refused, and the models themselves stay strict for user input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload

from fleet.incident import LossReport, PoolRef
from worker.payloads import data_converter

POOL = PoolRef(namespace="inference", service="llama")


def _payload(value: Any) -> Payload:
    return Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(value).encode())


def _report(**extra: Any) -> dict[str, Any]:
    body = LossReport(pool=POOL, pod="llama-0", fingerprint="fp", alert_name="ReplicaDown").model_dump(
        mode="json"
    )
    return body | extra


def _read(value: Any, hint: Any) -> Any:
    [read] = data_converter.payload_converter.from_payloads([_payload(value)], [hint])
    return read


def test_fields_of_a_newer_release_are_dropped_at_any_depth() -> None:
    newer = _report(confidence=0.97)
    newer["pool"]["cluster"] = "east-1"
    newer["arrivals_before"] = {
        "rps": 60.0,
        "seconds": 5.0,
        "ended_at": 1.0,
        "ended_before_s": 2.0,
        "tier": "x",
    }
    [read] = _read([newer], list[LossReport])
    assert read.pod == "llama-0" and read.pool == POOL
    assert read.arrivals_before is not None and read.arrivals_before.rps == 60.0


def test_a_wrong_value_is_still_refused_even_beside_an_unknown_field() -> None:
    with pytest.raises(ValidationError, match="fingerprint"):
        _read([_report(fingerprint="", confidence=0.97)], list[LossReport])


def test_the_models_stay_strict_for_what_users_send() -> None:
    with pytest.raises(ValidationError, match="confidence"):
        LossReport.model_validate(_report(confidence=0.97))


def test_a_report_of_this_release_round_trips() -> None:
    report = LossReport(pool=POOL, node="gpu-node-0", fingerprint="fp", alert_name="NodeNotReady")
    [payload] = data_converter.payload_converter.to_payloads([report])
    [read] = data_converter.payload_converter.from_payloads([payload], [LossReport])
    assert read == report
