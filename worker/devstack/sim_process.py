"""The simulator in a child process of its own (``fleetmend sim``), for the dev stack, the demo and the rig.

Why a process and not a thread: the simulator carries every user request of the load (the
engines, their streams, the load generator) and the Kubernetes API. Under one GIL with the
worker, the webhook and the gateway's control plane, a loaded fleet starved them all on a
2-core machine; in its own process it has a core to itself. ``sim.runner.start_sim`` (a thread)
stays for the tests that reach into the simulated world's objects.

``SimProcess`` carries what clients need, with the same names as ``sim.runner.RunningSim``
(``base_url``, ``port``, ``kube_url``, ``kubeconfig``, ``audit_log``, ``engine_port``), so
``worker.devstack.sim_wiring.settings_for_running_sim`` takes either.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from worker.processes import StackError, free_port, log_tail, spawn, terminate


@dataclass
class SimProcess:
    """A ``fleetmend sim`` child: its addresses, and ``stop()``."""

    proc: subprocess.Popen[bytes]
    base_url: str
    port: int
    kube_url: str
    kube_port: int
    kubeconfig: Path
    audit_log: Path
    engine_port: int
    log_file: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        terminate(self.proc, timeout_s=timeout)


def scenario_file(scenario: Any, directory: Path) -> Path:
    """A path for ``scenario`` (a path, a shipped scenario's name, or a ``sim.scenario.Scenario``)."""
    from sim.scenario import SCENARIO_DIR, Scenario

    if isinstance(scenario, Scenario):
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{scenario.name}.yaml"
        path.write_text(yaml.safe_dump(scenario.model_dump(mode="json", exclude_none=True), sort_keys=False))
        return path
    path = Path(scenario)
    return path if path.suffix else SCENARIO_DIR / f"{scenario}.yaml"


async def start_sim_process(
    scenario: Path,
    home: Path,
    *,
    port: int = 0,
    kube_port: int = 0,
    speed: float = 1.0,
    timeout_s: float = 60.0,
) -> SimProcess:
    """Run ``fleetmend sim`` for ``scenario`` with its kubeconfig, audit log and log under ``home``;
    return once its HTTP side answers and its kubeconfig is written. ``port``/``kube_port`` 0: free ports."""
    from sim.scenario import ScenarioError, load_scenario
    from sim.serving.layer import settings_from_scenario

    if not scenario.is_file():
        raise StackError(
            f"sim scenario {scenario} does not exist: set FLEETMEND_SIM_SCENARIO to a scenario YAML"
        )
    try:
        engine_port = settings_from_scenario(load_scenario(scenario).load or {}).engine_port
    except ScenarioError as err:
        raise StackError(f"the sim did not start with {scenario}: {err}".splitlines()[0]) from err
    kubeconfig, audit_log, log_file = home / "kubeconfig", home / "audit.log", home / "sim.log"
    home.mkdir(parents=True, exist_ok=True)
    kubeconfig.unlink(missing_ok=True)  # written again once the child listens: that is the signal
    # Ports this function picks are free when picked, not when the child binds them: another process
    # on the machine may take one meanwhile. The child then exits saying it cannot listen, and is
    # started again on new ports (never when the caller named the ports).
    picked = not port and not kube_port
    for attempt in range(3 if picked else 1):
        try:
            return await _start_sim(
                scenario, home, port or free_port(), kube_port or free_port(), speed, timeout_s,
                engine_port, kubeconfig, audit_log, log_file,
            )  # fmt: skip
        except _CannotListen as err:
            if attempt == 2 or not picked:
                raise StackError(str(err)) from None
    raise AssertionError("unreachable")


class _CannotListen(StackError):
    """The sim exited because a port it was given was taken."""


async def _start_sim(
    scenario: Path,
    home: Path,
    port: int,
    kube_port: int,
    speed: float,
    timeout_s: float,
    engine_port: int,
    kubeconfig: Path,
    audit_log: Path,
    log_file: Path,
) -> SimProcess:
    argv = [
        sys.executable, "-m", "worker.cli.sim", "--scenario", str(scenario), "--port", str(port),
        "--kube-port", str(kube_port), "--kubeconfig", str(kubeconfig), "--audit-log", str(audit_log),
        "--speed", str(speed),
    ]  # fmt: skip
    proc = spawn(argv, log_file=log_file)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if proc.poll() is not None:
                    tail = log_tail(log_file)
                    error = StackError if "cannot listen on" not in tail else _CannotListen
                    raise error(
                        f"the sim did not start with {scenario} (exit status {proc.returncode}); see "
                        f"{log_file}:\n{tail}"
                    )
                if kubeconfig.exists():
                    with contextlib.suppress(httpx.HTTPError):
                        if (await http.get(f"{base_url}/sim/v1/clock")).status_code == 200:
                            break
                if time.monotonic() > deadline:
                    raise StackError(
                        f"the sim did not answer on {base_url} within {timeout_s:.0f} s; see {log_file}"
                    )
                await asyncio.sleep(0.1)
    except BaseException:
        terminate(proc)
        raise
    return SimProcess(
        proc=proc,
        base_url=base_url,
        port=port,
        kube_url=f"https://127.0.0.1:{kube_port}",
        kube_port=kube_port,
        kubeconfig=kubeconfig,
        audit_log=audit_log,
        engine_port=engine_port,
        log_file=log_file,
    )
