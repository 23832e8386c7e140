"""Misconfiguration gets one clear message and changes nothing."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from typer.testing import CliRunner

from ledger.embedded_pg import EmbeddedPostgres, EmbeddedPostgresError
from worker.cli.app import app
from worker.config import Settings
from worker.webhook.effects_api import create_router


def test_embedded_postgres_under_a_missing_directory_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedPostgresError, match="parent directory does not exist"):
        EmbeddedPostgres(tmp_path / "missing" / "pg").start()
    assert not (tmp_path / "missing").exists()


def test_cli_without_a_ledger_database_says_how_to_get_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FLEETMEND_DATABASE_URL", raising=False)
    monkeypatch.setenv("FLEETMEND_STATE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["ledger", "list"])
    assert result.exit_code == 1
    assert "FLEETMEND_DATABASE_URL is not set" in result.output and "fleetmend dev" in result.output


def test_cli_on_an_unmigrated_database_refuses(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETMEND_DATABASE_URL", pg_url)
    result = CliRunner().invoke(app, ["ledger", "reconcile"])
    assert result.exit_code == 1 and "not at the latest migration" in result.output


async def test_effect_api_without_a_database_answers_503_with_the_fix() -> None:
    api = FastAPI()
    settings = Settings(
        database_url=None,
        tickets_url="http://127.0.0.1:9",
        tickets_token=SecretStr("jira-token"),
        effects_token=SecretStr("effects-token"),
        ledger_token=SecretStr("ledger-token"),
    )
    api.include_router(create_router(settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://api") as client:
        answer = await client.post(
            "/v1/effects",
            json={"operation_id": "r/0", "kind": "ticket.create", "target": "t", "params": {"title": "x"}},
            headers={"Authorization": "Bearer effects-token"},
        )
        assert answer.status_code == 503 and "FLEETMEND_DATABASE_URL" in answer.text
        audit = await client.get("/ledger/effects", headers={"Authorization": "Bearer ledger-token"})
        assert audit.status_code == 503 and "FLEETMEND_DATABASE_URL" in audit.text
