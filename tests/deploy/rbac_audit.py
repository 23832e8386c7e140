"""A pytest plugin: every Kubernetes call fleetmend makes during a test run must be allowed by the
shipped RBAC. Switch it on for any selection, e.g. the whole integration suite::

    .venv/bin/python -m pytest -p tests.deploy.rbac_audit tests/recovery tests/scale_down tests/webhook

It records the calls (``tests.deploy.kube_calls``), prints them with the grant that allows each,
and fails the run, naming the missing rule, when one is denied. ``FLEETMEND_RBAC_CALLS=path`` also
writes the distinct calls as JSON (to compare the RBAC against a wider run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.deploy.kube_calls import KubeCallRecorder, Rbac
from tests.deploy.manifests import OVERLAYS, SERVICE_ACCOUNTS, render

_recorder = KubeCallRecorder()


def pytest_configure(config: pytest.Config) -> None:
    _recorder.install()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _recorder.uninstall()
    calls = _recorder.distinct()
    target = os.environ.get("FLEETMEND_RBAC_CALLS")
    if target:
        Path(target).write_text(json.dumps([c.__dict__ for c in calls], indent=2))
    denied = sorted(
        {line for overlay in OVERLAYS for line in Rbac(render(overlay), SERVICE_ACCOUNTS).denied(calls)}
    )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"fleetmend RBAC audit: {len(calls)} distinct Kubernetes calls")
        for call in calls:
            reporter.write_line(f"  {call.component}: {call.describe()}")
        for line in denied:
            reporter.write_line(f"  DENIED: {line}", red=True)
    if denied and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
