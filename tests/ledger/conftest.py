"""Ledger test fixtures: a migrated database of the test's own, a counting world table, ledgers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from ledger import EffectLedger
from tests.ledger.world import World


@pytest.fixture
def world(ledger_url: str) -> Iterator[World]:
    w = World(ledger_url)
    yield w
    w.close()


@pytest.fixture
def make_ledger(ledger_url: str) -> Iterator[Callable[..., EffectLedger]]:
    """Build ledgers on this test's database (each one is a separate worker with its own pool)."""
    made: list[EffectLedger] = []

    def factory(**kwargs: object) -> EffectLedger:
        ledger = EffectLedger(ledger_url, **kwargs)  # type: ignore[arg-type]
        made.append(ledger)
        return ledger

    yield factory
    for ledger in made:
        ledger.close()


@pytest.fixture
def ledger(make_ledger: Callable[..., EffectLedger]) -> EffectLedger:
    return make_ledger(owner="worker-a")
