"""``fleetmend ledger``: audit, reconcile and prune the effect ledger.

The database is ``FLEETMEND_DATABASE_URL``, else the embedded Postgres of ``fleetmend dev``
under ``FLEETMEND_STATE_DIR/pg`` (started for the command and stopped again when it was
not already running). ``reconcile`` compares the ledger with the world's records: the
Kubernetes API server's audit log (``FLEETMEND_AUDIT_LOG`` or ``--audit-log``: ``audit.k8s.io/v1``
Event JSON lines, as ``--audit-log-path`` writes) and a target's action log
(``FLEETMEND_ACTION_LOG_URL`` unless ``--actions-url`` / ``--actions-file`` name another).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine, create_engine

from ledger.audit import EffectFilter, InvalidQuery, list_effects, show_effect
from ledger.migrate import is_at_head
from ledger.models import EffectState
from ledger.outcome import EffectOutcome
from ledger.reconcile import (
    Duplicate,
    InvalidAuditEvent,
    ReconcileReport,
    WorldAction,
    reconcile,
    world_actions_from_sim,
)
from ledger.retention import prune as prune_rows
from worker.config import Settings, load_settings

app = typer.Typer(no_args_is_help=True, help="Audit, reconcile and prune the effect ledger.")
console = Console()
err_console = Console(stderr=True)

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
SIM_ACTION_LOG_PATH = "/sim/v1/actions"
# Every fleetmend process names itself so in its user agent (fleetmend-worker/..., fleetmend-effects-api/...).
FLEETMEND_CLIENT_MARK = "fleetmend"
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


@contextmanager
def ledger_engine(settings: Settings | None = None) -> Iterator[Engine]:
    """An engine on the ledger database, checked to be at the schema this code expects."""
    settings = settings or load_settings()
    url = settings.database_url_value()
    embedded = None
    started_here = False
    if url is None:
        pgdata = settings.state_dir / "pg"
        if not (pgdata / "PG_VERSION").exists():
            fail(
                f"no ledger database: FLEETMEND_DATABASE_URL is not set and there is no embedded Postgres under "
                f"{pgdata}; set the URL, or run `fleetmend dev` once"
            )
        from ledger.embedded_pg import EmbeddedPostgres

        started_here = not (pgdata / "postmaster.pid").exists()
        embedded = EmbeddedPostgres(pgdata)
        url = embedded.start()
    engine = create_engine(url, pool_size=2)
    try:
        try:
            at_head = is_at_head(engine)
        except Exception as exc:
            fail(f"cannot reach the ledger database ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        if not at_head:
            fail(
                "the ledger schema is not at the latest migration: run `fleetmend dev` (it migrates) and retry"
            )
        yield engine
    finally:
        engine.dispose()
        if embedded is not None and started_here:
            embedded.stop()


def parse_time(value: str | None, option: str) -> datetime | None:
    """ISO 8601 with a zone (2026-11-29T10:00:00Z), or a relative age such as 30m, 2h, 7d (that long ago)."""
    if value is None:
        return None
    match = _RELATIVE.match(value.strip())
    if match:
        return datetime.now(UTC) - timedelta(**{_UNITS[match.group(2)]: float(match.group(1))})
    try:
        parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        fail(
            f"{option} {value!r} is not a time: use ISO 8601 (2026-11-29T10:00:00Z) or an age like 30m, 2h, 7d",
            2,
        )
        raise  # unreachable; keeps type checkers sure ``parsed`` is set
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else ""


def _effects_table(items: list[EffectOutcome], title: str) -> Table:
    table = Table(title=title)
    for column in (
        "created (UTC)",
        "op id",
        "kind",
        "target",
        "state",
        "delivery",
        "workflow / step",
        "tries",
    ):
        table.add_column(column, overflow="fold")
    for o in items:
        state = o.state + (f" (+{o.divergences} divergent)" if o.divergences else "")
        who = "/".join(x for x in (o.workflow_id, o.step) if x) or (o.request_id or "")
        table.add_row(_when(o.created_at), o.op_id, o.kind, o.target, state, o.delivery, who, str(o.attempts))
    return table


@app.command("list")
def list_command(
    workflow: str | None = typer.Option(None, "--workflow", help="Workflow id that asked."),
    target: str | None = typer.Option(None, "--target", help="Target (node, pod, pool, channel...)."),
    kind: str | None = typer.Option(None, "--kind", help="Effect kind, e.g. ticket.create."),
    state: EffectState | None = typer.Option(
        None, "--state", help="Row state; 'divergent' = re-requested differently."
    ),
    since: str | None = typer.Option(
        None, "--since", help="Created at/after: ISO time or an age (30m, 2h, 7d)."
    ),
    until: str | None = typer.Option(None, "--until", help="Created before: ISO time or an age."),
    limit: int = typer.Option(50, "--limit", min=1, max=500, help="Rows per page."),
    cursor: str | None = typer.Option(None, "--cursor", help="next_cursor of the previous page."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (items and next_cursor)."),
) -> None:
    """List effects, newest first, filtered by workflow, target, kind, state and time range."""
    try:
        filters = EffectFilter(
            workflow_id=workflow,
            target=target,
            kind=kind,
            state=state,
            since=parse_time(since, "--since"),
            until=parse_time(until, "--until"),
        )
    except ValidationError as exc:
        fail(str(exc), 2)
    with ledger_engine() as engine:
        try:
            page = list_effects(engine, filters, limit=limit, cursor=cursor)
        except InvalidQuery as exc:
            fail(str(exc), 2)
    if as_json:
        typer.echo(page.model_dump_json(indent=2))
        return
    console.print(_effects_table(page.items, f"ledger effects ({len(page.items)})"))
    if page.next_cursor:
        console.print(f"more: --cursor {page.next_cursor}")


@app.command("show")
def show_command(
    op_id: str = typer.Argument(..., help="Operation id."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Everything the ledger knows about one operation: who asked, params, outcome, lease, divergences."""
    with ledger_engine() as engine:
        detail = show_effect(engine, op_id)
    if detail is None:
        fail(
            f"no operation {op_id!r} in the ledger (pruned, or never requested); try `fleetmend ledger list`"
        )
        return
    if as_json:
        typer.echo(detail.model_dump_json(indent=2))
        return
    o = detail.effect
    table = Table(title=f"operation {o.op_id}", show_header=False)
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for name, value in o.model_dump(mode="json", exclude={"replayed"}).items():
        if value in (None, [], {}):
            continue
        table.add_row(name, value if isinstance(value, str) else json.dumps(value))
    console.print(table)
    if detail.divergences:
        div = Table(title="divergent requests (never performed)")
        for column in ("last seen (UTC)", "times", "target", "params", "workflow / request"):
            div.add_column(column, overflow="fold")
        for d in detail.divergences:
            div.add_row(
                _when(d.last_seen_at),
                str(d.times_seen),
                d.target,
                json.dumps(d.params),
                d.workflow_id or d.request_id or "",
            )
        console.print(div)


def action_log_url(url: str) -> str:
    """The action log's URL: as given when it names a path, else the simulator's log under that base."""
    parts = urlsplit(url.strip())
    return url.strip() if parts.path.strip("/") else url.strip().rstrip("/") + SIM_ACTION_LOG_PATH


def _load_world_actions(
    actions_url: str | None,
    actions_file: Path | None,
    world: str | None,
    client: str,
    *,
    setting_url: str | None,
) -> tuple[str | None, list[WorldAction] | None]:
    if actions_url and actions_file:
        fail("give either --actions-url or --actions-file, not both", 2)
    if not actions_url and not actions_file:
        actions_url = setting_url  # FLEETMEND_ACTION_LOG_URL
    if not actions_url and not actions_file:
        return None, None
    raw: Any
    if actions_url:
        log_url = action_log_url(actions_url)
        try:
            response = httpx.get(log_url, params={"since_seq": 0}, timeout=30)
            response.raise_for_status()
            raw = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            fail(f"could not read the action log at {log_url}: {exc}")
        world = world or urlsplit(log_url).netloc
    else:
        assert actions_file is not None
        if not world:
            fail("--actions-file needs --world (the origin the logged API serves, e.g. 127.0.0.1:8480)", 2)
        try:
            raw = json.loads(actions_file.read_text())
        except (OSError, ValueError) as exc:
            fail(f"could not read {actions_file}: {exc}", 2)
    if not isinstance(raw, list):
        fail(
            "the action log must be a JSON list of entries (seq, time, verb, path, body_digest, client, status)",
            2,
        )
    assert world is not None
    try:
        actions = world_actions_from_sim(world, raw)
    except ValidationError as exc:
        fail(f"the action log has an entry that is not an action: {exc}", 2)
    if client:
        actions = [a for a in actions if client in (a.client or "")]
    return world, actions


def _load_audit_log(
    audit_log: Path, audit_world: str | None, settings: Settings, client: str
) -> tuple[str, list[WorldAction]]:
    """The Kubernetes mutations an API server's audit log records (fleetmend's only, unless ``client``='')."""
    from activities.audit import read_audit_log
    from kube.client import kube_apis

    world = audit_world or settings.audit_log_world
    if not world:
        try:
            world = urlsplit(kube_apis(settings).core.api_client.configuration.host).netloc
        except Exception as exc:
            fail(
                f"cannot tell which API server {audit_log} records: no kubeconfig to read its address from "
                f"({type(exc).__name__}); pass --audit-world HOST:PORT",
                2,
            )
    assert world is not None
    try:
        actions = read_audit_log(audit_log, world)
    except OSError as exc:
        fail(f"could not read the audit log {audit_log}: {exc.strerror or exc}", 2)
    except (ValueError, InvalidAuditEvent, ValidationError) as exc:
        fail(f"{audit_log} is not a Kubernetes audit log: {exc}", 2)
    if client:
        actions = [a for a in actions if client in (a.client or "")]
    return world, actions


def _print_report(report: ReconcileReport) -> None:
    def section(title: str, items: list[EffectOutcome]) -> None:
        if items:
            console.print(_effects_table(items, title))

    section(f"unresolved for more than {report.unresolved_after_s:.0f} s", report.unresolved)
    section("waiting for an operator", report.needs_operator)
    section("re-requested with different params", report.divergent)
    section("applied but missing from the world's log", report.missing)
    if report.orphans:
        table = Table(title=f"orphans: actions in {report.world} with no ledger row")
        for column in ("seq", "verb", "path", "body digest", "client", "status"):
            table.add_column(column, overflow="fold")
        for a in report.orphans:
            table.add_row(str(a.seq), a.verb, a.path, a.body_digest[:16], a.client or "", str(a.status))
        console.print(table)
    if report.duplicates:
        _print_repeats(f"duplicates: ledger operations whose action {report.world} logged more than once",
                       "expected", report.duplicates)  # fmt: skip
    if report.repeated:
        _print_repeats(
            "repeated (declared at-least-once, not a finding): posted again after an unknown outcome",
            "rows",
            report.repeated,
        )
    compared = (
        f"; {report.world_actions_compared} actions of {report.world} compared"
        if report.world
        else (
            "; no record of the world given (FLEETMEND_AUDIT_LOG / --audit-log, FLEETMEND_ACTION_LOG_URL, "
            "--actions-url or --actions-file), so orphans and duplicates were not checked"
        )
    )
    if report.clean:
        console.print(f"[green]ledger reconciled: no findings[/green]{compared}")
    else:
        console.print(f"[red]{report.findings} finding(s)[/red]{compared}")


@app.command("reconcile")
def reconcile_command(
    actions_url: str | None = typer.Option(
        None,
        "--actions-url",
        help="The target's action log: its URL, or the sim's base URL (default FLEETMEND_ACTION_LOG_URL).",
    ),
    actions_file: Path | None = typer.Option(None, "--actions-file", help="JSON list of action log entries."),
    world: str | None = typer.Option(
        None, "--world", help="Name of the logged API (default: the URL's host:port)."
    ),
    audit_log: Path | None = typer.Option(
        None,
        "--audit-log",
        help="The Kubernetes API server's audit log (audit.k8s.io/v1 JSON lines; default FLEETMEND_AUDIT_LOG).",
    ),
    audit_world: str | None = typer.Option(
        None,
        "--audit-world",
        help="host:port of the API server the audit log records (default: the kubeconfig's server).",
    ),
    client: str = typer.Option(
        FLEETMEND_CLIENT_MARK,
        "--client",
        help="Compare only log entries whose client identity contains this (default: fleetmend's own "
        "requests; '' compares every entry).",
    ),
    unresolved_after: float = typer.Option(
        300.0, "--unresolved-after-s", min=0, help="Bound for unresolved intents."
    ),
    window_hours: float = typer.Option(
        24.0, "--window-hours", min=0, help="Divergences/missing checked this far back."
    ),
    check_missing: bool = typer.Option(
        False, "--check-missing", help="Also report applied rows the log lacks."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Report unresolved intents, divergences, orphans and duplicates. Exit status 1 when anything is found."""
    settings = load_settings()
    worlds: list[str] = []
    recorded: list[WorldAction] = []
    audit_path = audit_log or settings.audit_log
    api_world = None
    if audit_path is not None:
        api_world, from_audit = _load_audit_log(audit_path, audit_world, settings, client)
        worlds.append(api_world)
        recorded += from_audit
    world_name, actions = _load_world_actions(
        actions_url, actions_file, world, client, setting_url=settings.action_log_url
    )
    if world_name is not None and actions is not None:
        if api_world is not None and api_world != world_name:
            # The audit log is the Kubernetes API's record; the action log is the other targets'.
            actions = [a for a in actions if not a.path.startswith(("/api/", "/apis/"))]
        if world_name not in worlds:
            worlds.append(world_name)
        recorded += actions
    with ledger_engine(settings) as engine:
        report = reconcile(
            engine,
            world=worlds or None,
            actions=recorded if worlds else None,
            unresolved_after=timedelta(seconds=unresolved_after),
            window=timedelta(hours=window_hours),
            check_missing=check_missing,
        )
    if as_json:
        typer.echo(json.dumps({**report.model_dump(mode="json"), "findings": report.findings}, indent=2))
    else:
        _print_report(report)
    if not report.clean:
        raise typer.Exit(1)


@app.command("prune")
def prune_command(
    older_than_days: float | None = typer.Option(
        None, "--older-than-days", min=0, help="Retention window (default FLEETMEND_LEDGER_RETENTION_DAYS)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be deleted; delete nothing."),
) -> None:
    """Delete resolved rows older than the retention window. Unresolved rows are never pruned."""
    settings = load_settings()
    days = settings.ledger_retention_days if older_than_days is None else older_than_days
    with ledger_engine(settings) as engine:
        count = prune_rows(engine, older_than=timedelta(days=days), dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    console.print(f"{verb} {count} resolved effect(s) older than {days:g} days; unresolved rows are kept")


def _print_repeats(title: str, rows_heading: str, found: list[Duplicate]) -> None:
    """One table of world actions seen more often than their rows: duplicates, or declared repeats."""
    table = Table(title=title)
    for column in ("op ids", "verb", "path", rows_heading, "observed"):
        table.add_column(column, overflow="fold")
    for d in found:
        table.add_row(
            ", ".join(d.op_ids),
            d.signature.get("verb", ""),
            d.signature.get("path", ""),
            str(d.expected),
            str(d.observed),
        )
    console.print(table)
