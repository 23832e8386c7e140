"""`fleetmend webhook` and `fleetmend alert` as an operator uses them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from worker.cli.app import app
from worker.intake.alertmanager import AlertmanagerPayload
from worker.webhook.examples import EXAMPLES, alertmanager_fingerprint

runner = CliRunner()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_is_a_valid_v4_payload_for_a_routed_alert(name: str) -> None:
    from worker.intake.rules import load_alert_rules

    result = runner.invoke(app, ["alert", "--example", name])

    assert result.exit_code == 0, result.output
    payload = AlertmanagerPayload.model_validate_json(result.stdout)
    [alert] = payload.alerts
    assert load_alert_rules().rule_for(alert.labels) is not None
    assert alert.fingerprint == alertmanager_fingerprint(alert.labels)


def test_example_labels_can_be_overridden_and_resolved() -> None:
    result = runner.invoke(
        app, ["alert", "--example", "node-not-ready", "--label", "node=gpu-node-7", "--resolved"]
    )

    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    alert = payload["alerts"][0]
    assert alert["labels"]["node"] == "gpu-node-7"
    assert alert["status"] == payload["status"] == "resolved"
    assert "gpu-node-7 has been unready" in alert["annotations"]["description"]
    assert alert["endsAt"] != "0001-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["alert"], "exactly one of --file"),
        (["alert", "--example", "nope"], "choose one of: node-not-ready"),
        (["alert", "--example", "gpu-xid", "--label", "noequals"], "NAME=VALUE"),
        (["alert", "--file", "/nonexistent/alert.json"], "cannot read /nonexistent/alert.json"),
    ],
)
def test_alert_command_mistakes_get_a_clear_error(
    args: list[str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", "t")
    result = runner.invoke(app, args)

    assert result.exit_code == 2
    assert says in result.output


def test_webhook_check_validates_token_and_rules(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLEETMEND_WEBHOOK_TOKEN", raising=False)
    no_token = runner.invoke(app, ["webhook", "--check"])
    assert no_token.exit_code == 2
    assert "FLEETMEND_WEBHOOK_TOKEN is not set" in no_token.output

    monkeypatch.setenv("FLEETMEND_WEBHOOK_TOKEN", "s3cret-token-value")
    broken = tmp_path / "rules.yaml"
    broken.write_text("version: 1\nrules:\n  - alert: X\n    entity: {pod: pod}\n")
    bad_rules = runner.invoke(app, ["webhook", "--check", "--rules", str(broken)])
    assert bad_rules.exit_code == 2
    assert "rules.0.entity (rule for X)" in bad_rules.output

    monkeypatch.delenv("FLEETMEND_EFFECTS_TOKEN", raising=False)
    monkeypatch.setenv("FLEETMEND_LEDGER_TOKEN", "ledger-token-value")
    ok = runner.invoke(app, ["webhook", "--check"])
    assert ok.exit_code == 0, ok.output
    assert "8 routing rules" in ok.output
    assert "effect API (POST /v1/effects): off: FLEETMEND_EFFECTS_TOKEN is not set" in ok.output
    assert "ledger audit API (GET /ledger/effects): on" in ok.output

    monkeypatch.setenv("FLEETMEND_EFFECTS_TOKEN", "s3cret-token-value")  # Alertmanager's token again
    reused = runner.invoke(app, ["webhook", "--check"])
    assert reused.exit_code == 2
    assert "FLEETMEND_WEBHOOK_TOKEN and FLEETMEND_EFFECTS_TOKEN have the same value" in reused.output
    assert "s3cret-token-value" not in reused.output
    assert "s3cret-token-value" not in ok.output + no_token.output + bad_rules.output
