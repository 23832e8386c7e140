"""The routing rules file: clear errors at start-up, and shipped defaults that match the shipped alerts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from worker.config import Settings
from worker.intake.rules import AlertRulesError, load_alert_rules, parse_alert_rules
from worker.webhook.examples import example_alert

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_RULES = REPO / "deploy" / "prometheus" / "rules.yml"
ALERTMANAGER_CONFIG = REPO / "deploy" / "alertmanager" / "alertmanager.yml"


def shipped_alert_names() -> set[str]:
    groups = yaml.safe_load(PROMETHEUS_RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


def test_every_shipped_prometheus_alert_has_a_routing_rule() -> None:
    assert shipped_alert_names() == set(load_alert_rules().alert_names)


def test_alertmanager_routes_exactly_the_routed_alerts_to_fleetmend() -> None:
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    [route] = [r for r in config["route"]["routes"] if r["receiver"] == "fleetmend"]
    [matcher] = route["matchers"]
    names = re.fullmatch(r'alertname=~"(.*)"', matcher)
    assert names is not None
    assert set(names.group(1).split("|")) == shipped_alert_names()
    [webhook] = next(r for r in config["receivers"] if r["name"] == "fleetmend")["webhook_configs"]
    assert webhook["url"].endswith("/alerts/alertmanager")
    assert webhook["http_config"]["authorization"]["type"] == "Bearer"
    assert "credentials" not in webhook["http_config"]["authorization"]  # the token lives in a file


def test_the_largest_group_alertmanager_sends_fits_the_webhooks_default_body_limit() -> None:
    """max_alerts bounds the notification; 0 (unbounded) would let a big group exceed any limit and
    be refused with a 413 that Alertmanager never retries."""
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    [webhook] = next(r for r in config["receivers"] if r["name"] == "fleetmend")["webhook_configs"]
    assert webhook["max_alerts"] >= 10_000  # a cluster-wide outage's group is sent whole
    largest_realistic_alert = 3 * 1024  # labels, annotations and generatorURL of a kube-state-metrics alert
    assert webhook["max_alerts"] * largest_realistic_alert <= Settings().webhook_max_body_bytes
    example = len(json.dumps(example_alert("node-not-ready")).encode())
    assert example < largest_realistic_alert


RULE = """
version: 1
rules:
  - alert: A
    entity: {node: node}
"""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("version: 1\nrules: [", "not valid YAML"),
        ("- just a list", "must be a mapping"),
        (RULE.replace("version: 1", "version: 2"), "version"),
        (RULE.replace("{node: node}", "{node: node, pod: pod}"), "rules.0.entity (rule for A)"),
        (RULE.replace("{node: node}", "{namespace: ns}"), "exactly one of 'pod' or 'service'"),
        (RULE.replace("{node: node}", "{}"), "name the entity"),
        (RULE + "    fault: cosmic-ray\n", "rules.0.fault (rule for A)"),
        (RULE + "    action: page-someone\n", "rules.0.action"),
        (RULE + "    fault_hint: 'xid:{err code}'\n", "plain label name"),
        (RULE + "    sevrity: critical\n", "rules.0.sevrity"),
        (RULE + "  - alert: A\n    entity: {node: Hostname}\n", "would never apply"),
        ("version: 1\nrules: []", "rules"),
    ],
)
def test_a_broken_rules_file_fails_with_a_message_naming_the_rule_and_the_fix(text: str, says: str) -> None:
    with pytest.raises(AlertRulesError) as err:
        parse_alert_rules(text, source="my-rules.yaml")
    message = str(err.value)
    assert "my-rules.yaml" in message
    assert says in message


def test_a_missing_rules_file_says_how_to_fall_back(tmp_path: Path) -> None:
    with pytest.raises(AlertRulesError, match="unset it to use the shipped rules"):
        load_alert_rules(tmp_path / "nope.yaml")


def test_match_labels_pick_between_rules_and_hints_fill_from_labels() -> None:
    rules = parse_alert_rules(
        """
version: 1
rules:
  - alert: GpuXid
    match_labels: {err_code: "13"}
    action: signal-open-incident
    entity: {node: Hostname}
  - alert: GpuXid
    fault: gpu-xid
    fault_hint: "gpu-xid:{err_code}"
    entity: {node: Hostname}
"""
    )
    app_error = rules.rule_for({"alertname": "GpuXid", "err_code": "13"})
    hardware = rules.rule_for({"alertname": "GpuXid", "err_code": "79"})
    assert app_error is not None and app_error.action == "signal-open-incident"
    assert hardware is not None and hardware.hint_for({"err_code": "79"}) == "gpu-xid:79"
    assert hardware.hint_for({}) == "gpu-xid"  # label missing: the fault kind alone
    assert rules.rule_for({"alertname": "Other"}) is None


@pytest.mark.skipif(
    shutil.which("amtool") is None,
    reason="SKIPPED LOUDLY: amtool (Debian package prometheus-alertmanager, `make system-deps`) is missing",
)
def test_shipped_alertmanager_config_passes_amtool_check() -> None:
    checked = subprocess.run(
        ["amtool", "check-config", str(ALERTMANAGER_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def _loopback_prometheus_config(tmp_path: Path, rules: Path, *, every_second: bool) -> str:
    """The Prometheus config the demo (``every_second``) or the alert-path bench writes, with the sim,
    Alertmanager and webhook on placeholder loopback addresses 127.0.0.1:2, :3 and :4."""
    from worker.webhook.pipeline import loopback_prometheus

    return loopback_prometheus(
        tmp_path / "prom.yml",
        rules=rules,
        sim="127.0.0.1:2",
        alertmanager="127.0.0.1:3",
        webhook="127.0.0.1:4",
        worker=None,
        every_second=every_second,
    ).read_text()


def test_the_demos_alert_pipeline_configs_are_the_shipped_ones_on_loopback(tmp_path: Path) -> None:
    """``fleetmend demo`` templates deploy/'s configs (worker/webhook/pipeline.py): same receiver
    limits and token file, loopback addresses, fast timings."""
    from worker.webhook.pipeline import fast_rules, loopback_alertmanager

    token_file = tmp_path / "token"
    am = yaml.safe_load(
        loopback_alertmanager(
            tmp_path / "am.yml", webhook_url="http://127.0.0.1:1/alerts/alertmanager", token_file=token_file
        ).read_text()
    )
    shipped = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    [hook] = next(r for r in am["receivers"] if r["name"] == "fleetmend")["webhook_configs"]
    [shipped_hook] = next(r for r in shipped["receivers"] if r["name"] == "fleetmend")["webhook_configs"]
    assert hook["max_alerts"] == shipped_hook["max_alerts"] and hook["send_resolved"] is True
    assert hook["url"] == "http://127.0.0.1:1/alerts/alertmanager"
    assert hook["http_config"]["authorization"]["credentials_file"] == str(token_file)
    rules = fast_rules(tmp_path / "rules.yml")
    prometheus = _loopback_prometheus_config(tmp_path, rules, every_second=True)
    assert "sim:8480" not in prometheus and "127.0.0.1:2" in prometheus
    assert shipped_alert_names() == {
        r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r
    }


def test_the_alert_path_bench_runs_the_shipped_timings_on_loopback(tmp_path: Path) -> None:
    """``bench.alert_path`` measures the path as shipped: only the addresses change, every scrape and
    evaluation interval, ``for:`` and the fleetmend route's group timings stay."""
    from worker.webhook.pipeline import loopback_alertmanager, shipped_rules

    am = yaml.safe_load(
        loopback_alertmanager(
            tmp_path / "am.yml",
            webhook_url="http://127.0.0.1:1/alerts/alertmanager",
            token_file=tmp_path / "token",
            short_groups=False,
        ).read_text()
    )
    shipped = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    [route] = [r for r in am["route"]["routes"] if r["receiver"] == "fleetmend"]
    [shipped_route] = [r for r in shipped["route"]["routes"] if r["receiver"] == "fleetmend"]
    for timing in ("group_wait", "group_interval", "repeat_interval"):
        assert route[timing] == shipped_route[timing]
    rules = shipped_rules(tmp_path / "rules.yml")
    assert yaml.safe_load(rules.read_text()) == yaml.safe_load(
        (REPO / "deploy/prometheus/rules.yml").read_text()
    )
    prometheus = yaml.safe_load(_loopback_prometheus_config(tmp_path, rules, every_second=False))
    shipped_prometheus = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    assert prometheus["global"]["scrape_interval"] == shipped_prometheus["global"]["scrape_interval"]
    assert prometheus["global"]["evaluation_interval"] == shipped_prometheus["global"]["evaluation_interval"]
    assert prometheus["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["127.0.0.1:3"]
