"""How long the embedded stack takes to come up and go down, cold (fresh state) and warm (restart).

Prints seconds for: the Temporal dev server alone, the whole ``fleetmend dev``
stack (in-process ``DevStack``) on a fresh state dir — including Postgres initdb
and migrations — then a restart on the same state, and each stop.

    .venv/bin/python -m bench.devstack_startup [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from worker.config import Settings, load_settings
from worker.devstack.stack import DevStack
from worker.devstack.temporal_dev import TemporalDevServer, find_temporal_cli
from worker.processes import free_port


def _settings(state_dir: Path) -> Settings:
    return load_settings(
        temporal_address=f"127.0.0.1:{free_port()}",
        temporal_ui_port=free_port(),
        webhook_port=free_port(),
        sim_port=free_port(),
        worker_metrics_port=0,
        state_dir=state_dir,
    )


async def _timed_stack(settings: Settings) -> tuple[float, float]:
    started = time.perf_counter()
    stack = DevStack(settings)
    await stack.start()
    up = time.perf_counter() - started
    started = time.perf_counter()
    await stack.stop()
    return up, time.perf_counter() - started


async def _timed_temporal(state_dir: Path) -> tuple[float, float]:
    server = TemporalDevServer(
        cli=find_temporal_cli(),
        db_file=state_dir / "temporal-only.db",
        log_file=state_dir / "temporal-only.log",
        port=free_port(),
        ui_port=free_port(),
    )
    started = time.perf_counter()
    await server.start()
    up = time.perf_counter() - started
    started = time.perf_counter()
    server.stop()
    return up, time.perf_counter() - started


async def main(rounds: int) -> None:
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    rows: dict[str, list[float]] = {}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="fm-bench-") as tmp:
            state = Path(tmp) / "state"
            for label, result in (
                ("temporal dev server", await _timed_temporal(Path(tmp))),
                ("stack, cold (fresh state)", await _timed_stack(_settings(state))),
                ("stack, warm (restart)", await _timed_stack(_settings(state))),
            ):
                rows.setdefault(f"{label}: up", []).append(result[0])
                rows.setdefault(f"{label}: stop", []).append(result[1])
    print(f"{'what':<36} {'median s':>9} {'min s':>7} {'max s':>7}   ({rounds} rounds)")
    for label, values in rows.items():
        print(f"{label:<36} {statistics.median(values):>9.2f} {min(values):>7.2f} {max(values):>7.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args().rounds))
