"""``fleetmend webhook`` (serve the alert receiver) and ``fleetmend alert`` (post a payload by hand)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import typer
from rich.console import Console

from worker import jsonlog
from worker.cli.common import connects_itself
from worker.config import Settings, load_settings
from worker.webhook.examples import EXAMPLES, example_payload

console = Console()
err_console = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}", soft_wrap=True, highlight=False)
    return typer.Exit(code)


def webhook(
    host: str | None = typer.Option(None, help="Bind address (default FLEETMEND_WEBHOOK_HOST)."),
    port: int | None = typer.Option(None, help="Port (default FLEETMEND_WEBHOOK_PORT)."),
    rules: Path | None = typer.Option(
        None, help="Alert routing rules YAML (default FLEETMEND_ALERT_RULES_FILE)."
    ),
    check: bool = typer.Option(False, "--check", help="Validate token and routing rules, then exit."),
    log_level: str = typer.Option("INFO", "--log-level", help="Python log level of the JSON logs on stderr."),
) -> None:
    """Serve the Alertmanager webhook receiver (POST /alerts/alertmanager, /healthz, /readyz, /metrics)
    and the ledger's HTTP APIs (POST /v1/effects, GET /ledger/effects).

    Needs FLEETMEND_WEBHOOK_TOKEN (Alertmanager sends it as a bearer token); the effect and audit
    APIs answer only with FLEETMEND_EFFECTS_TOKEN / FLEETMEND_LEDGER_TOKEN set (each a token of its own)."""
    overrides: dict[str, object] = {}
    if host is not None:
        overrides["webhook_host"] = host
    if port is not None:
        overrides["webhook_port"] = port
    if rules is not None:
        overrides["alert_rules_file"] = rules
    settings = load_settings(**overrides)
    # The receiver's modules (FastAPI, the intake) load only for this command: every other command of
    # the CLI starts in a second less without them.
    from worker.intake.rules import AlertRulesError, load_alert_rules
    from worker.webhook.app import WebhookConfigError, create_app, serve

    try:
        create_app(settings)
    except (WebhookConfigError, AlertRulesError) as err:
        raise _fail(str(err)) from None
    if check:
        loaded = load_alert_rules(settings.alert_rules_file)
        console.print(
            f"ok: token set, {len(loaded.rules)} routing rules ({', '.join(sorted(loaded.alert_names))})"
        )
        for setting, value, api in (
            ("FLEETMEND_EFFECTS_TOKEN", settings.effects_token, "effect API (POST /v1/effects)"),
            ("FLEETMEND_LEDGER_TOKEN", settings.ledger_token, "ledger audit API (GET /ledger/effects)"),
        ):
            state = "on" if value and value.get_secret_value() else f"off: {setting} is not set (answers 503)"
            console.print(f"{api}: {state}")
        return
    jsonlog.configure(log_level)
    connects_itself()  # its Temporal client: leave once uvicorn has shut down (worker.cli.common.leave)
    serve(settings)


def alert(
    file: Path | None = typer.Option(
        None, "--file", "-f", help="Post this Alertmanager payload (JSON; '-' reads stdin) to the webhook."
    ),
    example: str | None = typer.Option(
        None, "--example", "-e", help=f"Print a realistic example payload: {', '.join(EXAMPLES)}."
    ),
    label: list[str] = typer.Option(
        [], "--label", "-l", help="Override an example label: NAME=VALUE (repeat)."
    ),
    resolved: bool = typer.Option(False, "--resolved", help="Make the example a resolved notification."),
    url: str | None = typer.Option(None, help="Webhook URL (default from FLEETMEND_WEBHOOK_HOST/PORT)."),
) -> None:
    """Post an alert payload to the fleetmend webhook, or print an example one.

    fleetmend alert --example node-not-ready --label node=gpu-node-2 > alert.json
    fleetmend alert --file alert.json"""
    if (file is None) == (example is None):
        raise _fail("give exactly one of --file (post a payload) or --example NAME (print one)")
    if example is not None:
        overrides: dict[str, str] = {}
        for item in label:
            name, sep, value = item.partition("=")
            if not sep or not name:
                raise _fail(f"--label {item!r} must look like NAME=VALUE")
            overrides[name] = value
        try:
            payload = example_payload(example, overrides=overrides, resolved=resolved)
        except KeyError as err:
            raise _fail(str(err.args[0])) from None
        typer.echo(json.dumps(payload, indent=2))
        return
    assert file is not None
    _post(file, url)


def _post(file: Path, url: str | None) -> None:
    settings = load_settings()
    try:
        body = sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes()
    except OSError as err:
        raise _fail(f"cannot read {file}: {err.strerror or err}") from None
    token = _token(settings)
    if not token:
        raise _fail(
            "FLEETMEND_WEBHOOK_TOKEN is not set (and no `fleetmend dev` token file in "
            f"{settings.state_dir}): the webhook accepts only requests with its bearer token"
        )
    from worker.webhook.app import ALERTMANAGER_PATH

    target = url or f"http://{settings.webhook_host}:{settings.webhook_port}{ALERTMANAGER_PATH}"
    try:
        response = httpx.post(
            target,
            content=body,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "User-Agent": "fleetmend-alert",
            },
            timeout=30.0,
        )
    except httpx.HTTPError as err:
        raise _fail(
            f"cannot reach the webhook at {target}: {err}. Is `fleetmend webhook` (or `fleetmend dev`) running?"
        ) from None
    try:
        shown = json.dumps(response.json(), indent=2)
    except ValueError:
        shown = response.text
    style = "green" if response.is_success else "red"
    console.print(f"[{style}]HTTP {response.status_code}[/]", highlight=False)
    console.print_json(shown) if shown.startswith(("{", "[")) else console.print(shown)
    if not response.is_success:
        raise typer.Exit(1)


def _token(settings: Settings) -> str:
    """The configured token, else the one `fleetmend dev` generated for its embedded webhook."""
    if settings.webhook_token and settings.webhook_token.get_secret_value():
        return settings.webhook_token.get_secret_value()
    dev_file = settings.state_dir / "webhook-token"  # worker.devstack.stack.dev_token_file
    try:
        return dev_file.read_text().strip()
    except OSError:
        return ""


def register(app: typer.Typer) -> None:
    """Attach this module's commands to the root app."""
    app.command("webhook")(webhook)
    app.command("alert")(alert)
