"""The simulated cluster's clock: real time multiplied by a speed factor.

Every duration in the simulator (node-monitor grace period, toleration
seconds, image pull, weight load, termination grace) is expressed in *sim
seconds*. At ``speed=100`` a 300 s toleration passes in 3 s of wall time, so
tests and demos watch minutes-long Kubernetes behaviour in seconds.

Sim time is an epoch timestamp (it starts at the wall-clock time the world was
created), so RFC 3339 timestamps in API objects look like a real cluster's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime


class SimClock:
    """Wall time scaled by ``speed``; ``advance()`` jumps ahead without waiting."""

    def __init__(self, speed: float = 1.0, start: float | None = None) -> None:
        if speed <= 0:
            raise ValueError(
                f"clock speed must be > 0 (got {speed}); use e.g. 1 for real time, 100 for tests"
            )
        self._lock = threading.Lock()
        self._speed = speed
        self._base_sim = time.time() if start is None else start
        self._base_mono = time.monotonic()

    @property
    def speed(self) -> float:
        return self._speed

    def now(self) -> float:
        """Current sim time in seconds since the Unix epoch."""
        with self._lock:
            return self._base_sim + (time.monotonic() - self._base_mono) * self._speed

    def set_speed(self, speed: float) -> None:
        """Change the speed factor from now on (sim time stays continuous)."""
        if speed <= 0:
            raise ValueError(f"clock speed must be > 0 (got {speed})")
        with self._lock:
            mono = time.monotonic()
            self._base_sim += (mono - self._base_mono) * self._speed
            self._base_mono = mono
            self._speed = speed

    def advance(self, sim_seconds: float) -> None:
        """Jump sim time forward (e.g. to skip a toleration period in a demo)."""
        if sim_seconds < 0:
            raise ValueError("the sim clock cannot go backwards")
        with self._lock:
            self._base_sim += sim_seconds

    def real_seconds(self, sim_seconds: float) -> float:
        """How long ``sim_seconds`` take in wall time at the current speed."""
        return max(0.0, sim_seconds) / self._speed

    async def sleep(self, sim_seconds: float) -> None:
        """Sleep for ``sim_seconds`` of sim time."""
        await asyncio.sleep(self.real_seconds(sim_seconds))

    def timestamp(self, at: float | None = None) -> str:
        """RFC 3339 (second precision, UTC) as Kubernetes writes it."""
        moment = self.now() if at is None else at
        return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_timestamp(at: float) -> str:
    """RFC 3339 with microseconds: the ``MicroTime`` of Lease renewTime and Event eventTime."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(value: str) -> float:
    """Inverse of ``SimClock.timestamp``: an RFC 3339 string to epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def set_from_any_thread(loop: asyncio.AbstractEventLoop | None, event: asyncio.Event | None) -> None:
    """Set ``event``, which belongs to ``loop``, from that loop or from any other thread (a no-op once the
    loop is gone): how the simulator's loops are woken by changes made elsewhere."""
    if loop is None or event is None or loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        event.set()
    else:
        loop.call_soon_threadsafe(event.set)
