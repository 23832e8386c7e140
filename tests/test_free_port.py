"""``free_port``: the ports the rigs and ``fleetmend dev`` hand to the processes they start."""

from __future__ import annotations

import socket

from worker.processes import EPHEMERAL_RANGE, LISTEN_PORTS_FROM, free_port


def test_picks_below_the_ephemeral_range_differ_and_skip_a_taken_port() -> None:
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    first = free_port()
    # Taken by someone else before our next pick: the walk must step over it. The first port after
    # ``first`` this test can bind (a process beside it may hold the very next one: CI's run of
    # 2026-12-07 failed binding first + 1).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        for candidate in range(first + 1, first + 200):
            port = candidate if candidate < ephemeral_low else LISTEN_PORTS_FROM + candidate - ephemeral_low
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        else:
            raise AssertionError(f"no port free in the 200 after {first}")
        taken.listen()
        picks = [free_port() for _ in range(20)]
        assert taken.getsockname()[1] not in picks
    assert first not in picks and len(set(picks)) == len(picks), picks  # none unbound yet, none twice
    assert all(LISTEN_PORTS_FROM <= p < ephemeral_low for p in [first, *picks]), picks
