"""The suite's RBAC gate itself (``tests.deploy.rbac_audit``): a call the shipped Roles do not allow fails
the whole ``pytest`` run, naming the rule that is missing, even when every test passed.

``test_rbac.py`` shows a removed grant turning one call into the API server's 403. Here a run of one
passing test is handed that call's audit event (the form the simulated API server writes and
``worker.devstack.rig.keep_audit_events`` collects from every rig): the run exits 1 and prints it.
The same run with only allowed calls exits 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from worker.devstack.rbac_wiring import AUDIT_DIR_ENV

REPO = Path(__file__).resolve().parents[2]
WORKER = "system:serviceaccount:fleetmend:fleetmend-worker"
MISSING = f'User "{WORKER}" cannot get resource "services" in API group "" in the namespace "inference"'


def _event(code: int) -> dict[str, object]:
    """An audit Event of the worker's read of its pool's Service, answered ``code``."""
    event: dict[str, object] = {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "stage": "ResponseComplete",
        "verb": "get",
        "requestURI": "/api/v1/namespaces/inference/services/llama",
        "user": {"username": WORKER},
        "objectRef": {"resource": "services", "namespace": "inference", "name": "llama", "apiVersion": "v1"},
        "responseStatus": {"code": code},
        "annotations": {"authorization.k8s.io/decision": "allow" if code < 400 else "forbid"},
    }
    if code == 403:
        event["responseStatus"] = {"code": 403, "message": f'services "llama" is forbidden: {MISSING}'}
    return event


def _run_suite(tmp_path: Path, events: list[dict[str, object]]) -> subprocess.CompletedProcess[str]:
    audit = tmp_path / "audit"
    audit.mkdir()
    (audit / "rig-1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_passes.py").write_text("def test_passes() -> None:\n    assert True\n", encoding="utf-8")
    env = {**os.environ, AUDIT_DIR_ENV: str(audit), "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.deploy.rbac_audit",
            "-p",
            "no:cacheprovider",
            ".",
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_call_outside_the_shipped_roles_fails_a_run_whose_tests_all_passed(tmp_path: Path) -> None:
    done = _run_suite(tmp_path, [_event(200), _event(403)])
    out = done.stdout + done.stderr
    assert "1 passed" in out, out
    assert done.returncode == 1, out
    assert f'worker: services "llama" is forbidden: {MISSING}' in out, out


def test_the_same_run_with_only_allowed_calls_passes(tmp_path: Path) -> None:
    done = _run_suite(tmp_path, [_event(200)])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "fleetmend RBAC: " in out and "grants used by 1 calls" in out, out
