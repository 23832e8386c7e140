"""Child-process plumbing for the embedded stack: port checks, spawning, clean stops.

Every helper here serves one promise of ``fleetmend dev``: whatever it started
is gone when it stops, even when the supervisor itself is killed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class StackError(RuntimeError):
    """A part of the embedded stack could not start; the message names the fix."""


class PortInUseError(StackError):
    pass


def port_is_free(host: str, port: int) -> bool:
    """True when nothing listens on host:port (we can bind it ourselves right now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def require_free_port(host: str, port: int, *, what: str, setting: str) -> None:
    """Fail with the fix when a port the stack needs is taken or not local (before starting anything)."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"{what} port {host}:{port} is already in use: stop the process using it "
                    f"(`ss -ltnp | grep :{port}`) or choose another port with {setting}"
                ) from err
            raise StackError(
                f"cannot listen on {host}:{port} for the {what} ({err.strerror or err}): the embedded stack "
                f"runs it on this machine, so set {setting} to a local address such as 127.0.0.1"
            ) from err


# Where ``free_port`` looks first: below the kernel's ephemeral range, whose ports every outgoing
# connection on the machine takes (the default range is 32768-60999).
LISTEN_PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


class _PortWalk:
    """This process's walk through the listen range: from a random start, one port after the other, so
    two picks in a row differ even before the first is bound, and processes side by side seldom meet.
    A port comes round again only after the whole range (thousands of picks)."""

    def __init__(self) -> None:
        self._offset: int | None = None

    def pick(self, host: str, low: int, span: int) -> int | None:
        if self._offset is None:
            self._offset = random.randrange(span)
        for _ in range(min(span, 500)):
            port = low + self._offset
            self._offset = (self._offset + 1) % span
            if port_is_free(host, port):
                return port
        return None


_walk = _PortWalk()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, for a process started next to listen on (never hard-code one: tests run
    side by side).

    Picked below the kernel's ephemeral range. A port the kernel hands out for ``bind(0)`` comes from that
    range, and every outgoing connection on the machine (HTTP clients, Envoy's upstreams, database
    connections) takes one from it too, so a busy machine could reuse it before the process it was
    picked for binds it. Ports below the range are taken only by explicit binds. Picks walk the range
    (``_PortWalk``). Without room below the range, the kernel chooses.
    """
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    span = ephemeral_low - LISTEN_PORTS_FROM
    if span >= 1000:
        port = _walk.pick(host, LISTEN_PORTS_FROM, span)
        if port is not None:
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _dying_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run through util-linux ``setpriv --pdeathsig TERM``: if the supervisor dies (even by
    SIGKILL) the kernel sends the child SIGTERM, so no orphan keeps a port.

    Not a ``preexec_fn``: running Python between fork and exec in a process with other threads
    (gRPC's, the sim's, the activity pool's) can deadlock or crash the child, and a process that
    hosts the gateway control plane always has them. Without setpriv the child simply outlives a
    killed supervisor (``terminate`` still stops it on every orderly exit).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *argv] if setpriv else list(argv)


def spawn(
    argv: Sequence[str], *, log_file: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start a child in its own session (Ctrl-C reaches only the supervisor, which stops
    children in order) that also dies with the supervisor; output goes to ``log_file``."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        return subprocess.Popen(
            _dying_with_parent(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def terminate(proc: subprocess.Popen[bytes], *, timeout_s: float = 15.0) -> None:
    """SIGTERM the child's whole process group, then SIGKILL whatever is left after ``timeout_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


# How the line that says why a child gave up starts: a Go panic or error (Temporal's CLI), or our own CLIs.
_CAUSE_PREFIXES = ("panic:", "fatal error:", "Error:", "error:")


def log_tail(path: Path, lines: int = 5) -> str:
    """The last lines of a child's log, for an error message that shows why it died.

    A Go panic ends in a long stack trace whose last lines say nothing: the first ``panic:`` /
    ``Error:`` line of the log comes first when it is not among the last lines.
    """
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    every = text.strip().splitlines()
    tail = every[-lines:]
    cause = next((line for line in every if line.lstrip().startswith(_CAUSE_PREFIXES)), None)
    if cause is not None and cause not in tail:
        tail = [cause, "...", *tail]
    return "\n".join(tail)
