"""The real alert path on one machine: Prometheus and Alertmanager (Debian packages) with the repo's configs.

``fleetmend demo`` runs them so a fault in the simulated fleet reaches
fleetmend the way it does in production: Prometheus scrapes the sim's
kube-state-metrics-style series, evaluates ``deploy/prometheus/rules.yml``,
Alertmanager routes the alert to fleetmend's webhook with its bearer token.
The shipped configs are used as they are, templated only for loopback
addresses and short ``for:`` / group timings so a demo takes seconds, not
minutes (``shipped_timings=True`` keeps every interval, ``for:`` and group timing as shipped:
``bench.alert_path`` measures the path that way). When the binaries are missing the caller posts an
Alertmanager-format payload itself and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from worker.processes import free_port

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROMETHEUS_BIN = "/usr/bin/prometheus"
ALERTMANAGER_BIN = "/usr/bin/prometheus-alertmanager"


def pipeline_binaries() -> tuple[str, str] | None:
    """Paths of prometheus and alertmanager, or None when either is not installed."""
    prom = shutil.which("prometheus") or (PROMETHEUS_BIN if Path(PROMETHEUS_BIN).exists() else None)
    am = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if am is None and Path(ALERTMANAGER_BIN).exists():
        am = ALERTMANAGER_BIN
    return (prom, am) if prom and am else None


def fast_rules(target: Path, *, pending_s: int = 2) -> Path:
    """deploy/prometheus/rules.yml with every non-zero ``for:`` cut to a few seconds."""
    rules = yaml.safe_load((DEPLOY / "prometheus/rules.yml").read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if rule.get("for") not in (None, "0m", "0s"):
                rule["for"] = f"{pending_s}s"
    target.write_text(yaml.safe_dump(rules, sort_keys=False))
    return target


def shipped_rules(target: Path) -> Path:
    """deploy/prometheus/rules.yml as shipped (every ``for:`` and group interval kept)."""
    target.write_text((DEPLOY / "prometheus/rules.yml").read_text())
    return target


def loopback_prometheus(
    target: Path,
    *,
    rules: Path,
    sim: str,
    alertmanager: str,
    webhook: str,
    worker: str | None,
    every_second: bool = True,
) -> Path:
    """deploy/prometheus/prometheus.yml pointed at loopback addresses, scraping and evaluating every
    second (``every_second=False``: at the shipped intervals)."""
    text = (DEPLOY / "prometheus/prometheus.yml").read_text()
    text = (
        text.replace("sim:8480", sim)
        .replace("alertmanager:9093", alertmanager)
        .replace("webhook:8088", webhook)
    )
    config = yaml.safe_load(text)
    if every_second:
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(rules)]
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            if every_second:
                sd["refresh_interval"] = "2s"
        for static in job.get("static_configs", []):
            targets = [t for t in static["targets"] if not t.startswith("worker:")]
            if worker is not None and any(t.startswith("worker:") for t in static["targets"]):
                targets.append(worker)
            static["targets"] = targets
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


def loopback_alertmanager(
    target: Path, *, webhook_url: str, token_file: Path, short_groups: bool = True
) -> Path:
    """deploy/alertmanager/alertmanager.yml posting to ``webhook_url`` with 1-2 s group timings
    (``short_groups=False``: the shipped route's)."""
    config = yaml.safe_load((DEPLOY / "alertmanager/alertmanager.yml").read_text())
    [route] = [r for r in config["route"]["routes"] if r["receiver"] == "fleetmend"]
    if short_groups:
        route.update(group_wait="1s", group_interval="2s", repeat_interval="1m")
    [hook] = next(r for r in config["receivers"] if r["name"] == "fleetmend")["webhook_configs"]
    hook["url"] = webhook_url
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    return target


@dataclass(frozen=True)
class RunningPipeline:
    prometheus_url: str
    alertmanager_url: str
    logs: tuple[Path, ...]


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


async def _wait_ready(http: httpx.AsyncClient, url: str, what: str, log: Path, timeout_s: float = 30) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if (await http.get(url)).status_code == 200:
                return
        await asyncio.sleep(0.3)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s; log {log}:\n{tail}")


@contextlib.asynccontextmanager
async def alert_pipeline(
    workdir: Path,
    *,
    binaries: tuple[str, str],
    sim_address: str,
    webhook_address: str,
    webhook_token: str,
    worker_metrics_address: str | None = None,
    shipped_timings: bool = False,
) -> AsyncIterator[RunningPipeline]:
    """Run Prometheus and Alertmanager on free loopback ports until the block exits; with
    ``shipped_timings`` at the shipped scrape and evaluation intervals, ``for:`` and group timings."""
    prometheus, alertmanager = binaries
    # Absolute: both tools resolve relative paths in a config against the config file's directory.
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    am_port, prom_port = free_port(), free_port()
    token_file = workdir / "fleetmend-token"
    token_file.write_text(webhook_token)
    token_file.chmod(0o600)
    am_config = loopback_alertmanager(
        workdir / "alertmanager.yml",
        webhook_url=f"http://{webhook_address}/alerts/alertmanager",
        token_file=token_file,
        short_groups=not shipped_timings,
    )
    rules = workdir / "rules.yml"
    prom_config = loopback_prometheus(
        workdir / "prometheus.yml",
        rules=shipped_rules(rules) if shipped_timings else fast_rules(rules),
        every_second=not shipped_timings,
        sim=sim_address,
        alertmanager=f"127.0.0.1:{am_port}",
        webhook=webhook_address,
        worker=worker_metrics_address,
    )
    am_log, prom_log = workdir / "alertmanager.log", workdir / "prometheus.log"
    am_argv = [
        alertmanager,
        f"--config.file={am_config}",
        f"--storage.path={workdir / 'am-data'}",
        f"--web.listen-address=127.0.0.1:{am_port}",
        "--cluster.listen-address=",  # no HA gossip port: other runs may share this machine
    ]
    prom_argv = [
        prometheus,
        f"--config.file={prom_config}",
        f"--storage.tsdb.path={workdir / 'prom-data'}",
        f"--web.listen-address=127.0.0.1:{prom_port}",
    ]
    with _process(am_argv, am_log), _process(prom_argv, prom_log):
        am_url, prom_url = f"http://127.0.0.1:{am_port}", f"http://127.0.0.1:{prom_port}"
        async with httpx.AsyncClient(timeout=5) as http:
            await _wait_ready(http, am_url + "/-/ready", "Alertmanager", am_log)
            await _wait_ready(http, prom_url + "/-/ready", "Prometheus", prom_log)
        yield RunningPipeline(prom_url, am_url, (prom_log, am_log))
