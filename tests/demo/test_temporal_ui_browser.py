"""The operator's view in a real browser: headless Chromium (Debian package) on a demo's Temporal Web UI.

The ``fragmented`` demo leaves its recovery open, awaiting an operator, so the
UI has a live workflow to show (current details are served by a query, which
needs the worker). Chromium is driven over the DevTools protocol (tests/demo/cdp.py):
the test waits, in real time, for the text a user would read. Screenshots go
to the test output directory; with ``FLEETMEND_REFRESH_DOCS=1`` the workflow page is also copied
to docs/temporal-ui.png for the README (a plain test run leaves the checkout as it found it).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

from tests.demo.cdp import CHROMIUM, browser
from tests.demo.support import REPO, DemoProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.e2e,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="SKIPPED LOUDLY: the browser test needs Debian's chromium (/usr/bin/chromium); "
        "`make system-deps` installs it",
    ),
]


def _api(demo: DemoProcess, path: str) -> dict[str, object]:
    r = httpx.get(f"{demo.ui_url}/api/v1/namespaces/default/{path}", timeout=10)
    r.raise_for_status()
    return dict(r.json())


def activity_summaries(demo: DemoProcess, workflow_id: str, run_id: str) -> list[str]:
    """The summaries the procedure put on its activities, as stored in the history (the UI's own API)."""
    wf = quote(workflow_id, safe="")
    history = _api(demo, f"workflows/{wf}/history?execution.runId={run_id}")
    out = []
    for event in history["history"]["events"]:  # type: ignore[index]
        summary = (event.get("userMetadata") or {}).get("summary")
        if event.get("eventType") == "EVENT_TYPE_ACTIVITY_TASK_SCHEDULED" and summary:
            out.append(json.loads(base64.b64decode(summary["data"])))
    return out


def test_list_filters_by_phase_and_the_workflow_page_shows_details_and_summaries(
    kept_fragmented: DemoProcess, output_dir: Path
) -> None:
    demo = kept_fragmented
    assert demo.report["final_phase"] == "awaiting-operator", demo.output()[-3000:]
    workflow_id = demo.report["workflow_id"]
    wf = quote(workflow_id, safe="")
    run_id = _api(demo, f"workflows/{wf}")["workflowExecutionInfo"]["execution"]["runId"]  # type: ignore[index]
    summaries = activity_summaries(demo, workflow_id, str(run_id))
    assert summaries, "the recovery's activities carry no summary"

    with browser() as page:
        # The workflow list, filtered by fleetmend's phase search attribute.
        query = quote('FleetmendPhase="awaiting-operator"', safe="")
        page.goto(f"{demo.ui_url}/namespaces/default/workflows?query={query}")
        listed = page.wait_for_text(workflow_id, "ReplicaLossRecovery")
        assert not re.search(r"incident/inference/llama(?!/)", listed)  # the incident itself is not awaiting
        page.screenshot(output_dir / "temporal-ui-list-by-phase.png")
        # A phase nothing is in: our workflow is filtered out.
        nothing = quote('FleetmendPhase="draining"', safe="")
        page.goto(f"{demo.ui_url}/namespaces/default/workflows?query={nothing}")
        page.wait_for_text("No Workflows")
        assert workflow_id not in page.text()

        # The workflow page: current details (the procedure's Markdown status line) ...
        base = f"{demo.ui_url}/namespaces/default/workflows/{wf}/{run_id}"
        page.goto(f"{base}/user-metadata")
        details = page.wait_for_text(
            "Current Details", "[user-metadata-current-details] Phase: awaiting-operator", "Awaiting operator"
        )
        assert "approve" in details
        shot = page.screenshot(output_dir / "temporal-ui-current-details.png")
        # ... and the activity summaries in the event history.
        page.goto(f"{base}/history")
        history = page.wait_for_text("Activity Task Scheduled", "Summary")
        # The newest events come first (one page of 100): most of the step summaries are on it.
        shown = [s for s in summaries if " ".join(s.split())[:60] in history]
        assert len(shown) >= min(3, len(summaries)), (summaries, history[-2000:])
        page.screenshot(output_dir / "temporal-ui-history.png")

    if os.environ.get("FLEETMEND_REFRESH_DOCS") == "1":
        shutil.copyfile(shot, REPO / "docs" / "temporal-ui.png")
