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
_handed_out: set[int] = set()  # this process's picks: never handed out twice (the first may not be bound yet)
_cursor: list[int] = []  # where this process's walk through the range is (starts at random)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, for a process started next to listen on (never hard-code one: tests run
    side by side).

    Picked below the kernel's ephemeral range. A port the kernel hands out for ``bind(0)`` comes from that
    range, and every outgoing connection on the machine (HTTP clients, Envoy's upstreams, database
    connections) takes one from it too, so a busy machine could reuse it before the process it was
    picked for binds it. Ports below the range are taken only by explicit binds. Each process walks the
    range from a random start and never hands a port out twice, so two picks in a row (both unbound
    yet) differ and processes side by side seldom meet. Without room below the range, the kernel
    chooses.
    """
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    span = low - LISTEN_PORTS_FROM
    if span >= 1000:
        if not _cursor:
            _cursor.append(random.randrange(span))
        for _ in range(500):
            port = LISTEN_PORTS_FROM + _cursor[0]
            _cursor[0] = (_cursor[0] + 1) % span
            if port not in _handed_out and port_is_free(host, port):
                _handed_out.add(port)
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
