"""kill -9 at every boundary of perform, and a Postgres crash mid-run: one application, nothing lost."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ledger import Attempt, EffectLedger, RetryableLedgerError
from ledger.migrate import upgrade_head
from tests.ledger.world import World, WorldEffect
from tests.pg import PgServer, start_embedded_server

ROOT = Path(__file__).resolve().parents[2]


def run_child_until_killed(url: str, op_id: str, point: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.ledger.crash_child", url, op_id, point],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"child did not die at {point}: rc={proc.returncode} {proc.stderr}"
    )


@pytest.mark.parametrize(
    ("point", "landed_before_rerun", "rerun_applies", "rerun_probes"),
    [
        ("after_claim", 0, 1, 1),  # claimed, never dispatched: the rerun probes, finds nothing, applies
        ("mid_apply", 0, 1, 1),  # the target's write died with the process: same
        ("after_apply", 1, 0, 1),  # landed but never recorded: resolved by the probe, never repeated
        ("after_record", 1, 0, 0),  # recorded: the rerun returns the stored result
    ],
)
def test_kill_9_at_each_point_then_rerun_applies_exactly_once(
    ledger_url: str,
    world: World,
    make_ledger: Callable[..., EffectLedger],
    point: str,
    landed_before_rerun: int,
    rerun_applies: int,
    rerun_probes: int,
) -> None:
    op_id = f"wf-1/ticket/{point}"
    run_child_until_killed(ledger_url, op_id, point)
    assert world.count(op_id) == landed_before_rerun

    rerun_effect = WorldEffect(world, by="rerun")
    outcome = make_ledger(owner="rerun", wait_seconds=10).perform(
        op_id, "ticket.create", "oncall", {"title": "node lost"}, rerun_effect
    )

    assert outcome.state == "applied"
    assert world.count(op_id) == 1
    assert (rerun_effect.applies, rerun_effect.probes) == (rerun_applies, rerun_probes)
    assert outcome.fence == (1 if point == "after_record" else 2)


@pytest.fixture
def restartable_pg() -> Iterator[PgServer]:
    """A Postgres of this test's own that it may crash and restart (the session server stays up)."""
    server = start_embedded_server()
    yield server
    server.stop()


def test_postgres_crash_mid_run_callers_retry_and_nothing_is_duplicated_or_lost(
    restartable_pg: PgServer,
) -> None:
    url = restartable_pg.create_database("restart")
    upgrade_head(url)
    world = World(url)
    ledger = EffectLedger(url, owner="worker", lease_seconds=1.0, wait_seconds=5.0)
    ops = [f"wf/step/{i}" for i in range(160)]
    done: list[str] = []
    retries: Counter[str] = Counter()
    lock = threading.Lock()

    def jitter(attempt: Attempt) -> None:
        time.sleep(random.uniform(0, 0.01))

    effect = WorldEffect(world, after_land=jitter)

    def caller(chunk: list[str]) -> None:
        for op in chunk:
            deadline = time.monotonic() + 60
            while True:
                try:
                    ledger.perform(op, "k8s.label", op, {"serving": "false"}, effect)
                    break
                except RetryableLedgerError as exc:
                    with lock:
                        retries[type(exc).__name__] += 1
                    assert time.monotonic() < deadline, f"{op} never resolved: {exc}"
                    time.sleep(0.1)
            with lock:
                done.append(op)

    threads = [threading.Thread(target=caller, args=(ops[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    while len(done) < 40:
        time.sleep(0.01)
    assert restartable_pg.restart is not None
    restartable_pg.restart()  # pg_ctl stop -m immediate, then start: a crash, not a clean shutdown
    for t in threads:
        t.join(120)

    assert sorted(done) == sorted(ops)
    print("retries by error type:", dict(retries))
    assert sum(retries.values()) > 0, "the crash should have been felt by in-flight callers"
    counts = world.counts()
    assert set(counts) == set(ops)
    assert max(counts.values()) == 1, f"duplicates: { {k: v for k, v in counts.items() if v > 1} }"
    for op in ops:
        row = ledger.get(op)
        assert row is not None and row.state == "applied"
    ledger.close()
    world.close()
