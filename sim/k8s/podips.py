"""Pod IPs that are real, bindable loopback addresses, unique to one simulated world.

Every address in 127.0.0.0/8 binds on Linux without setup, so each simulated pod gets
its own address, as in a cluster, and its engine listens there (``sim.serving.pods``).
Two worlds running at once on one machine (parallel test sessions) must not hand out
the same address: each world draws its own random /24 block ``127.A.B.0/24`` at start
(from the OS's randomness, not the scenario seed, so two worlds of one scenario differ)
and a fresh random block when that one is used up. Before an address is handed out it
is checked by binding ``(address, port)``: an address some other process already
listens on is skipped.
"""

from __future__ import annotations

import errno
import random
import socket
import threading

HOSTS_PER_BLOCK = 254  # .1 .. .254
DEFAULT_ENGINE_PORT = 8000


def bindable(address: str, port: int) -> bool:
    """Can a server bind ``address:port`` now? (Port 0: the address alone.)"""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
    except OSError as exc:
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            return False
        raise
    finally:
        sock.close()
    return True


class PodIpAllocator:
    """Hands out ``127.A.B.x`` addresses from random per-world blocks; thread-safe."""

    def __init__(self, port: int = DEFAULT_ENGINE_PORT, rng: random.Random | None = None) -> None:
        self.port = port
        self._rng = rng or random.SystemRandom()
        self._lock = threading.Lock()
        self._blocks: list[tuple[int, int]] = []
        self._used_blocks: set[tuple[int, int]] = set()
        self._next_host = HOSTS_PER_BLOCK + 1  # forces a block on first use
        self._handed_out = 0

    @property
    def blocks(self) -> list[str]:
        """The /24 blocks this world has drawn, in order (e.g. ``["127.83.17.0/24"]``)."""
        return [f"127.{a}.{b}.0/24" for a, b in self._blocks]

    @property
    def handed_out(self) -> int:
        return self._handed_out

    def _new_block(self) -> None:
        for _ in range(1000):
            block = (self._rng.randint(1, 254), self._rng.randint(0, 255))
            if block in self._used_blocks:
                continue
            # A block whose first address is taken is probably another world's: draw again.
            if not bindable(f"127.{block[0]}.{block[1]}.1", self.port):
                self._used_blocks.add(block)
                continue
            self._used_blocks.add(block)
            self._blocks.append(block)
            self._next_host = 1
            return
        raise RuntimeError("no free 127.A.B.0/24 block for pod IPs after 1000 draws")

    def allocate(self) -> str:
        with self._lock:
            for _ in range(10 * HOSTS_PER_BLOCK):
                if self._next_host > HOSTS_PER_BLOCK:
                    self._new_block()
                a, b = self._blocks[-1]
                address = f"127.{a}.{b}.{self._next_host}"
                self._next_host += 1
                if bindable(address, self.port):
                    self._handed_out += 1
                    return address
            raise RuntimeError(f"no bindable loopback address for a pod on port {self.port}")
