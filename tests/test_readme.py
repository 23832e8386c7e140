"""The README states the quick start and a configuration table that matches ``Settings``."""

from __future__ import annotations

from pathlib import Path

from worker.config import Settings
from worker.config_docs import render_into

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_configuration_table_is_current() -> None:
    text = README.read_text()
    assert render_into(text) == text, "regenerate it: python -m worker.config_docs --write README.md"
    for name in Settings.model_fields:
        assert f"`FLEETMEND_{name.upper()}`" in text


def test_quick_start_is_the_two_make_commands() -> None:
    text = README.read_text()
    quick_start = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert "```sh\nmake demo\nmake test\n```" in quick_start
