"""Audit listing, reconciliation against the world's action log, retention, schema, and the CLI."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from fleet.actionlog import ActionLogEntry
from ledger import (
    ActionSignature,
    Attempt,
    CallableEffect,
    DivergentOperation,
    EffectContext,
    EffectLedger,
    body_digest,
)
from ledger.audit import EffectFilter, InvalidQuery, list_effects, show_effect
from ledger.migrate import current_revision, head_revision, is_at_head
from ledger.models import Delivery, EffectState
from ledger.reconcile import WorldAction, reconcile, world_actions_from_sim
from ledger.retention import prune
from tests.ledger.world import SimulatedCrash, World, WorldEffect
from worker.cli.app import app

SIM = "127.0.0.1:8480"


def sim_effect(verb: str, path: str, body: Mapping[str, object]) -> CallableEffect:
    """An effect whose request the sim would log as (verb, path, sha256(body))."""
    raw = json.dumps(body).encode()
    return CallableEffect(
        lambda a: {"status": 200},
        lambda a: None,
        signature=lambda a: ActionSignature(world=SIM, verb=verb, path=path, body_digest=body_digest(raw)),
    )


def logged(seq: int, verb: str, path: str, body: Mapping[str, object], status: int = 200) -> ActionLogEntry:
    return ActionLogEntry(
        seq=seq,
        time=float(seq),
        verb=verb,
        path=path,
        body_digest=body_digest(json.dumps(body).encode()),
        client="fleetmend",
        status=status,
    )


CORDON = {"spec": {"unschedulable": True}}
UNLABEL = {"metadata": {"labels": {"fleetmend.io/serving": None}}}


def plant_ledger(ledger: EffectLedger) -> None:
    ctx = EffectContext(workflow_id="replica-loss/ns/llama", step="quarantine", alert_fingerprints=["fp9"])
    ledger.perform(
        "wf/cordon/node-1",
        "k8s.cordon",
        "node-1",
        {},
        sim_effect("PATCH", "/api/v1/nodes/node-1", CORDON),
        context=ctx,
    )
    ledger.perform(
        "wf/cordon/node-2",
        "k8s.cordon",
        "node-2",
        {},
        sim_effect("PATCH", "/api/v1/nodes/node-2", CORDON),
        context=ctx,
    )
    ledger.perform(
        "wf/unlabel/pod-a",
        "k8s.label",
        "pod-a",
        {},
        sim_effect("PATCH", "/api/v1/namespaces/ns/pods/pod-a", UNLABEL),
    )
    # Two workflows, a week apart, cordoned node-3: the same request twice, both in the ledger.
    for wf in ("wf-old", "wf-new"):
        ledger.perform(
            f"{wf}/cordon/node-3",
            "k8s.cordon",
            "node-3",
            {},
            sim_effect("PATCH", "/api/v1/nodes/node-3", CORDON),
        )


def test_reconcile_finds_exactly_the_planted_orphans_and_duplicates(ledger: EffectLedger) -> None:
    plant_ledger(ledger)
    log = [
        logged(1, "PATCH", "/api/v1/nodes/node-1", CORDON),
        logged(2, "PATCH", "/api/v1/nodes/node-2", CORDON),
        logged(3, "PATCH", "/api/v1/nodes/node-2", CORDON),  # planted duplicate of wf/cordon/node-2
        logged(
            4, "PATCH", "/api/v1/namespaces/ns/pods/pod-a", UNLABEL, status=409
        ),  # refused: changed nothing
        logged(5, "PATCH", "/api/v1/namespaces/ns/pods/pod-a", UNLABEL),
        logged(6, "PATCH", "/api/v1/nodes/node-3", CORDON),
        logged(7, "PATCH", "/api/v1/nodes/node-3", CORDON),  # two rows, two actions: fine
        logged(
            8, "DELETE", "/api/v1/namespaces/ns/pods/pod-b", {}
        ),  # planted orphan: nobody asked the ledger
        logged(9, "POST", "/sim/v1/faults", {"kind": "node_lost"}, status=500),  # failed, ignored
    ]
    report = reconcile(ledger.engine, world=SIM, actions=world_actions_from_sim(SIM, log))

    assert [a.seq for a in report.orphans] == [8]
    assert [(d.op_ids, d.expected, d.observed) for d in report.duplicates] == [(["wf/cordon/node-2"], 1, 2)]
    assert [a.seq for a in report.duplicates[0].actions] == [2, 3]
    assert report.unresolved == [] and report.divergent == [] and report.missing == []
    assert report.findings == 2 and report.world_actions_compared == 7

    # Another world's log is never compared with these rows.
    assert reconcile(ledger.engine, world="10.0.0.1:443", actions=[]).clean


def test_a_declared_at_least_once_repeat_is_listed_not_a_duplicate_and_a_third_post_is_one(
    ledger: EffectLedger,
) -> None:
    """An incident-channel post whose first attempt's outcome was unknown (it had landed) is posted
    again, as its kind declares: reconcile lists that repeat and stays clean. More posts than the row's
    attempts are a duplicate all the same."""
    message = {"text": "[fleetmend] lead time 240 s"}
    raw = json.dumps(message).encode()
    calls = {"n": 0}

    def post(attempt: Attempt) -> dict[str, object]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TimeoutError("read timeout: the channel took the message but did not answer in time")
        return {"status": 200}

    def effect() -> CallableEffect:
        return CallableEffect(
            post,
            delivery=Delivery.AT_LEAST_ONCE,
            signature=lambda a: ActionSignature(
                world=SIM, verb="POST", path="/sim/v1/notify", body_digest=body_digest(raw)
            ),
        )

    with pytest.raises(Exception, match="outcome is unknown"):
        ledger.perform("wf/notify/lead-time", "notify.post", "channel/lead-time", message, effect())
    outcome = ledger.perform("wf/notify/lead-time", "notify.post", "channel/lead-time", message, effect())
    assert outcome.attempts == 2 and outcome.delivery == Delivery.AT_LEAST_ONCE.value
    posted = [logged(1, "POST", "/sim/v1/notify", message), logged(2, "POST", "/sim/v1/notify", message)]

    report = reconcile(ledger.engine, world=SIM, actions=world_actions_from_sim(SIM, posted))
    assert report.clean and report.duplicates == []
    assert [(d.op_ids, d.expected, d.observed) for d in report.repeated] == [(["wf/notify/lead-time"], 1, 2)]

    thrice = [*posted, logged(3, "POST", "/sim/v1/notify", message)]
    report = reconcile(ledger.engine, world=SIM, actions=world_actions_from_sim(SIM, thrice))
    assert [(d.op_ids, d.observed) for d in report.duplicates] == [(["wf/notify/lead-time"], 3)]
    assert report.repeated == [] and not report.clean


def test_reconcile_reports_unresolved_divergent_and_missing(ledger: EffectLedger, world: World) -> None:
    plant_ledger(ledger)
    with pytest.raises(SimulatedCrash):
        ledger.perform("wf/stuck", "k", "t", {}, WorldEffect(world, before_land=_crash))
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ledger_effects SET updated_at = now() - interval '10 minutes' WHERE op_id = 'wf/stuck'"
            )
        )
    with pytest.raises(DivergentOperation):
        ledger.perform(
            "wf/cordon/node-1", "k8s.cordon", "node-1", {"force": True}, sim_effect("PATCH", "/x", {})
        )

    log = [
        logged(1, "PATCH", "/api/v1/nodes/node-1", CORDON),
        logged(2, "PATCH", "/api/v1/nodes/node-2", CORDON),
    ]
    report = reconcile(
        ledger.engine,
        world=SIM,
        actions=world_actions_from_sim(SIM, log),
        check_missing=True,
        unresolved_after=timedelta(minutes=5),
    )
    assert [o.op_id for o in report.unresolved] == ["wf/stuck"]
    assert [o.op_id for o in report.divergent] == ["wf/cordon/node-1"]
    assert sorted(o.op_id for o in report.missing) == [
        "wf-new/cordon/node-3",
        "wf-old/cordon/node-3",
        "wf/unlabel/pod-a",
    ]
    assert report.orphans == [] and report.duplicates == []


def test_reconcile_matches_by_op_id_where_the_world_echoes_it(ledger: EffectLedger, world: World) -> None:
    effect = WorldEffect(world)
    for op in ("t/1", "t/2", "t/3"):
        ledger.perform(op, "ticket.create", "oncall", {"op": op}, effect)
    world.land("t/2", "someone retried by hand")  # a duplicate the ticket system recorded under the key
    world.land("t/9", "a script outside fleetmend")  # an orphan
    with world.engine.connect() as conn:
        rows = conn.execute(text("SELECT seq, op_id FROM world_actions ORDER BY seq")).all()
    actions = [
        WorldAction(
            world="test-world", verb="INSERT", path="world_actions", body_digest=op, op_id=op, seq=seq
        )
        for seq, op in rows
    ]
    report = reconcile(ledger.engine, world="test-world", actions=actions)
    assert [a.op_id for a in report.orphans] == ["t/9"]
    assert [(d.op_ids, d.observed) for d in report.duplicates] == [(["t/2"], 2)]


def test_audit_filters_and_pages(make_ledger: Callable[..., EffectLedger], world: World) -> None:
    ledger = make_ledger(owner="w")
    effect = WorldEffect(world)
    for i in range(7):
        ctx = EffectContext(workflow_id=f"wf-{i % 2}", step="deroute", request_id=None)
        ledger.perform(
            f"op-{i}",
            "router.label.remove" if i % 3 else "k8s.cordon",
            f"target-{i % 3}",
            {},
            effect,
            context=ctx,
        )
    ledger.perform("op-dry", "k8s.cordon", "node-9", {}, effect, dry_run=True)

    assert {o.op_id for o in list_effects(ledger.engine, EffectFilter(workflow_id="wf-1")).items} == {
        "op-1",
        "op-3",
        "op-5",
    }
    assert {
        o.op_id
        for o in list_effects(ledger.engine, EffectFilter(kind="k8s.cordon", state=EffectState.APPLIED)).items
    } == {"op-0", "op-3", "op-6"}
    assert [o.op_id for o in list_effects(ledger.engine, EffectFilter(state=EffectState.PLANNED)).items] == [
        "op-dry"
    ]
    assert {o.op_id for o in list_effects(ledger.engine, EffectFilter(target="target-2")).items} == {
        "op-2",
        "op-5",
    }
    future = datetime.now(UTC) + timedelta(hours=1)
    assert list_effects(ledger.engine, EffectFilter(since=future)).items == []

    seen: list[str] = []
    cursor = None
    while True:
        page = list_effects(ledger.engine, limit=3, cursor=cursor)
        seen += [o.op_id for o in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert len(seen) == 8 and len(set(seen)) == 8
    with pytest.raises(InvalidQuery, match="cursor"):
        list_effects(ledger.engine, cursor="not-a-cursor")


def test_prune_deletes_only_old_resolved_rows(ledger: EffectLedger, world: World) -> None:
    effect = WorldEffect(world)
    ledger.perform("old-applied", "k", "t", {}, effect)
    ledger.perform("new-applied", "k", "t", {}, effect)
    with pytest.raises(SimulatedCrash):
        ledger.perform("old-unresolved", "k", "t", {}, WorldEffect(world, before_land=_crash))
    with ledger.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ledger_effects SET resolved_at = now() - interval '40 days', updated_at = now() - interval '40 days' "
                "WHERE op_id IN ('old-applied', 'old-unresolved')"
            )
        )
    assert prune(ledger.engine, older_than=timedelta(days=30), dry_run=True) == 1
    assert prune(ledger.engine, older_than=timedelta(days=30)) == 1
    remaining = {o.op_id for o in list_effects(ledger.engine).items}
    assert remaining == {"new-applied", "old-unresolved"}


def test_migrations_reach_head_and_match_the_models(pg_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from ledger.migrate import upgrade_head
    from ledger.models import metadata

    assert current_revision(pg_url) is None and not is_at_head(pg_url)
    assert upgrade_head(pg_url) == head_revision()
    assert upgrade_head(pg_url) == head_revision()  # idempotent
    assert is_at_head(pg_url)
    engine = create_engine(pg_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": "ledger_alembic_version"})
        diff = [d for d in compare_metadata(ctx, metadata) if "ledger_alembic_version" not in str(d)]
    engine.dispose()
    assert diff == []


def test_cli_list_show_reconcile_prune(
    ledger: EffectLedger, ledger_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETMEND_DATABASE_URL", ledger_url)
    plant_ledger(ledger)
    runner = CliRunner()

    listed = runner.invoke(app, ["ledger", "list", "--workflow", "replica-loss/ns/llama", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {i["op_id"] for i in json.loads(listed.stdout)["items"]} == {
        "wf/cordon/node-1",
        "wf/cordon/node-2",
    }
    table = runner.invoke(app, ["ledger", "list", "--kind", "k8s.cordon", "--since", "1h"])
    assert table.exit_code == 0 and "ledger effects (4)" in table.output
    bad = runner.invoke(app, ["ledger", "list", "--since", "yesterday-ish"])
    assert bad.exit_code == 2 and "ISO 8601" in bad.output

    shown = runner.invoke(app, ["ledger", "show", "wf/cordon/node-1", "--json"])
    assert shown.exit_code == 0
    assert json.loads(shown.stdout)["effect"]["alert_fingerprints"] == ["fp9"]
    missing = runner.invoke(app, ["ledger", "show", "nope"])
    assert missing.exit_code == 1 and "no operation 'nope'" in missing.output

    log_file = tmp_path / "actions.json"
    log_file.write_text(
        json.dumps(
            [
                logged(1, "PATCH", "/api/v1/nodes/node-1", CORDON).model_dump(),
                logged(2, "DELETE", "/api/v1/namespaces/ns/pods/x", {}).model_dump(),
            ]
        )
    )
    found = runner.invoke(
        app, ["ledger", "reconcile", "--actions-file", str(log_file), "--world", SIM, "--json"]
    )
    assert found.exit_code == 1
    body = json.loads(found.stdout)
    assert body["findings"] == 1 and [o["seq"] for o in body["orphans"]] == [2]
    log_file.write_text(json.dumps([logged(1, "PATCH", "/api/v1/nodes/node-1", CORDON).model_dump()]))
    clean = runner.invoke(app, ["ledger", "reconcile", "--actions-file", str(log_file), "--world", SIM])
    assert clean.exit_code == 0 and "no findings" in clean.output
    no_world = runner.invoke(app, ["ledger", "reconcile", "--actions-file", str(log_file)])
    assert no_world.exit_code == 2 and "--world" in no_world.output

    pruned = runner.invoke(app, ["ledger", "prune", "--older-than-days", "0"])
    assert pruned.exit_code == 0 and "deleted 5" in pruned.output


def test_show_includes_divergent_requests(ledger: EffectLedger, world: World) -> None:
    ledger.perform("req-1/0", "ticket.create", "oncall", {"title": "a"}, WorldEffect(world))
    for _ in range(2):
        with pytest.raises(DivergentOperation):
            ledger.perform(
                "req-1/0",
                "ticket.create",
                "oncall",
                {"title": "b"},
                WorldEffect(world),
                context=EffectContext(request_id="req-1"),
            )
    detail = show_effect(ledger.engine, "req-1/0")
    assert detail is not None and detail.effect.divergences == 2
    assert [(d.params, d.times_seen, d.request_id) for d in detail.divergences] == [
        ({"title": "b"}, 2, "req-1")
    ]
    assert [
        o.op_id for o in list_effects(ledger.engine, EffectFilter(state=EffectState.DIVERGENT)).items
    ] == ["req-1/0"]


def _crash(attempt: Attempt) -> None:
    raise SimulatedCrash("worker died")


def test_cli_reconcile_reads_the_action_log_from_fleetmend_action_log_url(
    ledger: EffectLedger, ledger_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like every command, ``ledger reconcile`` takes its settings from the environment: with
    FLEETMEND_ACTION_LOG_URL set it checks orphans and duplicates against the real sim's log."""
    from activities.effects import TicketCreate, TicketParams
    from sim.runner import start_sim
    from sim.scenario import shipped_scenarios
    from tests.support import JIRA_ISSUE_PATH, open_issue_by_hand, sim_jira

    runner = CliRunner()
    monkeypatch.setenv("FLEETMEND_DATABASE_URL", ledger_url)
    monkeypatch.delenv("FLEETMEND_ACTION_LOG_URL", raising=False)
    with (
        start_sim(shipped_scenarios()["gpu-node-loss"], speed=10.0) as sim,
        httpx.Client(timeout=10, headers={"User-Agent": "fleetmend-effects-api/0.1"}) as fleetmend_http,
        httpx.Client(timeout=10) as someone_else,
    ):
        params = TicketParams(title="GPU node lost", body="gpu-node-2 NotReady")
        outcome = ledger.perform(
            "req-1/0",
            "ticket.create",
            "oncall",
            params,
            TicketCreate(fleetmend_http, sim_jira(sim.base_url), params),
        )
        assert outcome.state == "applied"
        # An operator's own request is the world's business, not a fleetmend orphan.
        assert open_issue_by_hand(someone_else, sim.base_url, "opened by an operator").status_code == 201
        world = sim.base_url.split("//", 1)[1]

        monkeypatch.setenv("FLEETMEND_ACTION_LOG_URL", f"{sim.base_url}/sim/v1/actions")
        clean = runner.invoke(app, ["ledger", "reconcile", "--json"])
        assert clean.exit_code == 0, clean.output
        report = json.loads(clean.stdout)
        assert report["world"] == world and report["world_actions_compared"] == 1

        # A ticket fleetmend opened behind the ledger's back: an orphan, found through the setting alone.
        assert open_issue_by_hand(fleetmend_http, sim.base_url, "no ledger row").status_code == 201
        found = runner.invoke(app, ["ledger", "reconcile", "--json"])
        assert found.exit_code == 1, found.output
        assert [(o["verb"], o["path"]) for o in json.loads(found.stdout)["orphans"]] == [
            ("POST", JIRA_ISSUE_PATH)
        ]
        everyone = runner.invoke(app, ["ledger", "reconcile", "--json", "--client", ""])
        assert len(json.loads(everyone.stdout)["orphans"]) == 2  # the operator's ticket too
        # --actions-url still overrides the setting, as the sim's base URL or the log's own URL.
        for url in (sim.base_url, f"{sim.base_url}/sim/v1/actions"):
            explicit = runner.invoke(app, ["ledger", "reconcile", "--json", "--actions-url", url])
            assert explicit.exit_code == 1 and len(json.loads(explicit.stdout)["orphans"]) == 1

        monkeypatch.delenv("FLEETMEND_ACTION_LOG_URL")
        unchecked = runner.invoke(app, ["ledger", "reconcile"])
        assert unchecked.exit_code == 0  # nothing to compare with: the orphan goes unseen, and it says so
        assert "FLEETMEND_ACTION_LOG_URL" in unchecked.output and "not checked" in unchecked.output


def test_cli_reconcile_reads_the_api_servers_audit_log(
    ledger: EffectLedger, ledger_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ledger reconcile`` against a Kubernetes audit log (the sim's, as ``--audit-log-path`` writes):
    clean after fleetmend's own cordon, then a planted orphan and a planted duplicate are found."""
    from activities.world_effects import NodePatch
    from kube.client import USER_AGENT, kube_apis
    from sim.runner import start_sim
    from sim.scenario import shipped_scenarios

    runner = CliRunner()
    monkeypatch.setenv("FLEETMEND_DATABASE_URL", ledger_url)
    monkeypatch.delenv("FLEETMEND_ACTION_LOG_URL", raising=False)
    with start_sim(
        shipped_scenarios()["gpu-node-loss"], speed=10.0, serving=False, kubeconfig=tmp_path / "kc"
    ) as sim:

        class Where:
            kubeconfig = sim.kubeconfig
            kube_context = None

        k = kube_apis(Where())
        cordon = NodePatch(k, "gpu-node-1", unschedulable=True, labels={"fleetmend.io/quarantine": "xid-79"})
        outcome = ledger.perform(
            "wf/quarantine/gpu-node-1", "k8s.node.patch", "gpu-node-1", {"node": "gpu-node-1"}, cordon
        )
        assert outcome.state == "applied"
        k.core.patch_node(
            "gpu-node-2", {"metadata": {"labels": {"x": "y"}}}, dry_run="All"
        )  # changed nothing
        monkeypatch.setenv("FLEETMEND_KUBECONFIG", str(sim.kubeconfig))
        monkeypatch.setenv("FLEETMEND_AUDIT_LOG", str(sim.audit_log))
        world = sim.kube_url.split("//", 1)[1]

        clean = runner.invoke(app, ["ledger", "reconcile", "--json"])
        assert clean.exit_code == 0, clean.output
        report = json.loads(clean.stdout)
        assert report["world"] == world and report["world_actions_compared"] == 1

        # Planted: the same cordon sent again behind the ledger's back (a duplicate of that op id),
        # and a patch of another node with no ledger row (an orphan), both by fleetmend's client.
        k.core.patch_node("gpu-node-1", cordon.body)
        k.core.patch_node("gpu-node-3", {"spec": {"unschedulable": True}})
        assert k.core.api_client.user_agent == USER_AGENT
        found = runner.invoke(app, ["ledger", "reconcile", "--json"])
        assert found.exit_code == 1, found.output
        report = json.loads(found.stdout)
        assert [(o["verb"], o["path"]) for o in report["orphans"]] == [("PATCH", "/api/v1/nodes/gpu-node-3")]
        assert [(d["op_ids"], d["expected"], d["observed"]) for d in report["duplicates"]] == [
            (["wf/quarantine/gpu-node-1"], 1, 2)
        ]
        text = runner.invoke(app, ["ledger", "reconcile", "--audit-log", str(sim.audit_log)])
        assert "orphans: actions in" in text.output and "duplicates:" in text.output

        not_audit = tmp_path / "not-audit.log"
        not_audit.write_text('{"kind": "Pod"}\n')
        refused = runner.invoke(app, ["ledger", "reconcile", "--audit-log", str(not_audit)])
        assert refused.exit_code == 2 and "is not a Kubernetes audit log" in " ".join(refused.output.split())
