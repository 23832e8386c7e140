"""How fast is exactly-once? ``perform`` calls/s next to the bare protocol floor on the same Postgres.

    .venv/bin/python -m bench.ledger [--seconds 10] [--rounds 10] [--database-url URL] [--json]

Measured in one run, on one database, durable commits (synchronous_commit=on):

* ``perform``   — ``EffectLedger.perform`` with a no-op effect: claim (INSERT … ON CONFLICT DO NOTHING
  RETURNING, lease and fence set) and record (fenced UPDATE … RETURNING), outcome returned.
* ``floor``     — the same two single-statement durable transactions (insert the intent row, update it
  with the result) issued as raw SQL through psycopg: no ORM, no lease, no fencing, no outcome object.
* ``insert``    — one raw single-row INSERT transaction, for context (the cheapest durable write).

Each at 1 and 16 concurrent callers (threads of one process, as in a worker's activity thread pool), the
three workloads alternating in short slices so that other load on the machine hits them alike. Without
``--database-url`` an embedded Postgres is started in a temporary directory and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import create_engine, make_url, text

from ledger import Attempt, CallableEffect, EffectContext, EffectLedger
from ledger.canonical import fingerprint
from ledger.migrate import upgrade_head

CONCURRENCIES = (1, 16)
PARAMS = {"replicas": 3}
CONTEXT = EffectContext(workflow_id="bench-workflow", run_id="run", step="scale", requested_by="bench")

FLOOR_INSERT = """
INSERT INTO ledger_effects (op_id, kind, target, params, fingerprint, delivery, state, workflow_id, run_id, step,
    request_id, alert_fingerprints, requested_by)
VALUES (%s, %s, %s, %s, %s, %s, 'claimed', %s, %s, %s, %s, %s, %s)
ON CONFLICT (op_id) DO NOTHING RETURNING op_id
"""
FLOOR_UPDATE = "UPDATE ledger_effects SET state = 'applied', result = %s, updated_at = now() WHERE op_id = %s"
RAW_INSERT = "INSERT INTO bench_raw (id, payload) VALUES (%s, %s)"


def _noop(attempt: Attempt) -> dict[str, Any]:
    return {"ok": True}


def _psycopg_conninfo(url: str) -> str:
    u = make_url(url)
    parts = {"dbname": u.database, "user": u.username, "password": u.password, "host": u.host, "port": u.port}
    parts.update({k: v for k, v in u.query.items() if isinstance(v, str)})
    return " ".join(f"{k}='{v}'" for k, v in parts.items() if v not in (None, ""))


# ---------------------------------------------------------------- one caller's loop per workload


def _loop_perform(ledger: EffectLedger, seconds: float, prefix: str) -> int:
    effect = CallableEffect(_noop, _noop)
    done = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        ledger.perform(f"{prefix}/{done}", "bench.noop", "target", PARAMS, effect, context=CONTEXT)
        done += 1
    return done


def _run_floor(url: str, seconds: float, prefix: str) -> int:
    """The same row data and the same two durable statements, bound as plain parameters."""
    result = {"ok": True}
    done = 0
    with psycopg.connect(_psycopg_conninfo(url), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            op_id = f"{prefix}/{done}"
            intent = (
                op_id,
                "bench.noop",
                "target",
                Jsonb(PARAMS),
                fingerprint("bench.noop", "target", PARAMS),
                "exactly_once",
                CONTEXT.workflow_id,
                CONTEXT.run_id,
                CONTEXT.step,
                CONTEXT.request_id,
                Jsonb(CONTEXT.alert_fingerprints),
                CONTEXT.requested_by,
            )
            conn.execute(FLOOR_INSERT, intent).fetchone()
            conn.execute(FLOOR_UPDATE, (Jsonb(result), op_id))
            done += 1
    return done


def _run_insert(url: str, seconds: float, prefix: str) -> int:
    done = 0
    with psycopg.connect(_psycopg_conninfo(url), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            conn.execute(RAW_INSERT, (f"{prefix}/{done}", "x"))
            done += 1
    return done


# ---------------------------------------------------------------- concurrency drivers


def _in_threads(target: Callable[[str], int], callers: int) -> int:
    counts = [0] * callers
    run = uuid.uuid4().hex[:8]

    def body(i: int) -> None:
        counts[i] = target(f"{run}-{i}")

    threads = [threading.Thread(target=body, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def measure(url: str, seconds: float, rounds: int) -> list[dict[str, Any]]:
    """Rates per workload and concurrency. Workloads alternate in ``rounds`` short slices so that load from
    other processes on the machine hits perform and floor alike; each rate is total calls / total time."""
    rows: list[dict[str, Any]] = []
    shared = EffectLedger(url, owner="bench")  # one ledger per process, as a worker would have
    slice_s = seconds / rounds
    targets: dict[str, Callable[[str], int]] = {
        "perform": lambda prefix: _loop_perform(shared, slice_s, prefix),
        "floor": lambda prefix: _run_floor(url, slice_s, prefix),
        "insert": lambda prefix: _run_insert(url, slice_s, prefix),
    }
    for callers in CONCURRENCIES:
        calls = dict.fromkeys(targets, 0)
        spent = dict.fromkeys(targets, 0.0)
        for _ in range(rounds):
            for kind, target in targets.items():
                started = time.perf_counter()
                calls[kind] += _in_threads(target, callers)
                spent[kind] += time.perf_counter() - started
        rate = {kind: calls[kind] / spent[kind] for kind in targets}
        rows.append(
            {
                "callers": callers,
                "perform_per_s": round(rate["perform"]),
                "floor_per_s": round(rate["floor"]),
                "ratio": round(rate["perform"] / rate["floor"], 3),
                "raw_insert_tx_per_s": round(rate["insert"]),
            }
        )
    shared.close()
    return rows


def _prepare(url: str) -> None:
    upgrade_head(url)
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_raw (id text PRIMARY KEY, payload text)"))
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each measurement")
    parser.add_argument(
        "--database-url", help="an empty Postgres database (default: a throwaway embedded one)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="alternate the workloads in this many slices")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()

    workdir: Path | None = None
    embedded = None
    url = args.database_url
    if url is None:
        from ledger.embedded_pg import EmbeddedPostgres

        workdir = Path(tempfile.mkdtemp(prefix="fleetmend-bench-"))
        workdir.chmod(0o755)
        embedded = EmbeddedPostgres(workdir / "pg")
        admin = create_engine(embedded.start(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text("CREATE DATABASE bench"))
        admin.dispose()
        url = embedded.url("bench")
    try:
        _prepare(url)
        rows = measure(url, args.seconds, args.rounds)
    finally:
        if embedded is not None:
            embedded.stop()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    mode = "threads"
    if args.json:
        print(json.dumps({"callers_as": mode, "seconds": args.seconds, "cpus": os.cpu_count(), "rows": rows}))
        return
    print(
        f"effect ledger throughput ({mode}, {args.seconds:g} s each, {os.cpu_count()} CPUs, synchronous_commit=on)"
    )
    print(
        f"{'callers':>7}  {'perform/s':>10}  {'floor/s':>10}  {'perform/floor':>13}  {'raw INSERT tx/s':>15}"
    )
    for r in rows:
        print(
            f"{r['callers']:>7}  {r['perform_per_s']:>10}  {r['floor_per_s']:>10}  {r['ratio']:>13.0%}  "
            f"{r['raw_insert_tx_per_s']:>15}"
        )


if __name__ == "__main__":
    main()
