"""``DevStack`` as a library (what ``fleetmend demo`` and tests reuse): chosen parts, clean stop, bad input."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from worker.config import load_settings
from worker.devstack.stack import DevStack
from worker.processes import StackError, free_port, port_is_free
from workflows.smoke import FleetmendSmoke


async def test_a_stack_of_chosen_parts_runs_a_workflow_and_frees_its_ports(tmp_path: Path) -> None:
    grpc = free_port()
    settings = load_settings(
        temporal_address=f"127.0.0.1:{grpc}",
        task_queue=f"lib-{uuid.uuid4().hex[:8]}",
        worker_metrics_port=0,
        state_dir=tmp_path / "state",
    )
    async with DevStack(settings, parts=("temporal", "worker"), headless_ui=True) as stack:
        assert [row.what for row in stack.endpoints()][:2] == ["Temporal gRPC", "Worker (in this process)"]
        result = await stack.client.execute_workflow(
            FleetmendSmoke.run, "lib", id=f"lib-{uuid.uuid4().hex[:8]}", task_queue=settings.task_queue
        )
        assert result.reply.echo == "lib"
        assert not port_is_free("127.0.0.1", grpc)
    assert port_is_free("127.0.0.1", grpc)
    assert (tmp_path / "state" / "temporal.db").exists()  # state kept for the next start
    with pytest.raises(StackError, match="not started"):
        _ = stack.client


def test_unknown_parts_are_refused_with_the_valid_names(tmp_path: Path) -> None:
    with pytest.raises(StackError, match=r"unknown stack part\(s\) \['tempral'\]; choose from"):
        DevStack(load_settings(state_dir=tmp_path), parts=("tempral",))
