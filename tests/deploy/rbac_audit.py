"""The suite's RBAC report: every grant of the shipped Roles with the calls that used it, derived from
the simulated API server's audit logs of every test-rig run (``tests.conftest`` loads this plugin).

The sim enforces RBAC, so a call outside the shipped Roles already fails the test that made it (a
403 naming the verb, resource, group and namespace). Here, at the end of the run, the audit events of
fleetmend's ServiceAccounts (copied by ``worker.devstack.rig.keep_audit_events`` into
``$FLEETMEND_RBAC_AUDIT_DIR``) are attributed to the grants they used (``tests.deploy.rbac_report``):
the report is written to ``rbac-report.txt`` in that directory and summarised; a denied call fails
the run; when the whole suite ran (``make test``: no path, ``-k`` or ``-m`` selection) and passed, a
grant no call used fails it too, naming the grant.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.rbac_report import RbacReport, build_report
from worker.devstack.rbac_wiring import AUDIT_DIR_ENV, COMPONENTS, shipped_rbac_objects


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # xdist workers report to the controller


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config) and not os.environ.get(AUDIT_DIR_ENV):
        # Set before xdist starts its workers, which inherit it.
        os.environ[AUDIT_DIR_ENV] = tempfile.mkdtemp(prefix="fleetmend-rbac-audit-")


def _events(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):
        events.extend(
            json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
        )
    return events


def whole_suite(config: pytest.Config) -> bool:
    args = [Path(a).resolve() for a in config.args]
    tests = (Path(str(config.rootpath)) / "tests").resolve()
    return args in ([], [tests]) and not config.option.keyword and not config.option.markexpr


def suite_report() -> RbacReport | None:
    directory = os.environ.get(AUDIT_DIR_ENV)
    if not directory or not any(Path(directory).glob("*.jsonl")):
        return None
    return build_report(shipped_rbac_objects(), COMPONENTS, _events(Path(directory)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _is_controller(session.config):
        return
    report = suite_report()
    if report is None:
        return
    directory = Path(os.environ[AUDIT_DIR_ENV])
    (directory / "rbac-report.txt").write_text("\n".join(report.lines()) + "\n", encoding="utf-8")
    failing = list(report.denied)
    if whole_suite(session.config) and exitstatus == 0:
        failing += [
            f"UNUSED: {grant.describe()} (no call of the whole suite used it)" for grant in report.unused
        ]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        used = len(report.grants) - len(report.unused)
        reporter.write_sep(
            "=",
            f"fleetmend RBAC: {used}/{len(report.grants)} grants used by {report.calls} calls "
            f"(report: {directory / 'rbac-report.txt'})",
        )
        for line in failing:
            reporter.write_line(f"  {line}", red=True)
    if failing and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
