"""`fleetmend model ramp` as a user runs it: JSON figures, the comparison table, sweeps, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.ramp import RampParams, RampPolicy, simulate_ramp
from worker.cli.model import app

runner = CliRunner()
FIGURES = {"served", "late", "goodput", "peak_wait_new", "final_depth_new"}


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["ramp", *args], env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.parametrize("policy", ["equal", "rate"])
def test_json_prints_exactly_the_five_unrounded_figures(policy: str) -> None:
    result = run("--policy", policy, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == FIGURES
    assert all(isinstance(v, float) for v in data.values())
    assert data == simulate_ramp(RampParams(), RampPolicy(policy)).model_dump()


def test_json_uses_every_option() -> None:
    result = run(
        "--policy", "equal", "--json", "--warm-rate", "10", "--cold-fraction", "0.1", "--warmup", "300",
        "--deadline", "20", "--warm-replicas", "5", "--seconds", "900", "--arrival", "45",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = RampParams(
        warm_rate=10, cold_fraction=0.1, warmup_s=300, deadline_s=20, warm_replicas=5, seconds=900, arrival=45
    )
    assert json.loads(result.stdout) == simulate_ramp(expected, RampPolicy.EQUAL).model_dump()
    assert json.loads(result.stdout)["late"] > 0


def test_default_runs_both_policies_side_by_side_with_the_ratio() -> None:
    result = run()
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "equal" in out and "rate" in out and "equal / rate" in out
    assert "313.25" in out  # the equal policy's late requests with the runbook's defaults
    assert "36,000.00" in out  # the rate policy serves everything
    assert "inf" in out  # 313.25 late vs 0 late


def test_sweep_prints_one_row_per_value() -> None:
    result = run("--sweep", "cold-fraction=1,0.75,0.5,0.25")
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["1", "0.75", "0.5", "0.25"]
    assert "313.25" in rows[3]


def test_sweep_json_and_warmup() -> None:
    result = run("--sweep", "warmup=30,600", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [row["warmup_s"] for row in data] == [30.0, 600.0]
    assert data[1]["equal"]["late"] > data[0]["equal"]["late"]
    assert data[1]["rate"]["late"] == 0.0


def test_plot_writes_a_png(tmp_path: Path) -> None:
    target = tmp_path / "ramp.png"
    result = run("--plot", str(target))
    assert result.exit_code == 0, result.output
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 10_000


@pytest.mark.parametrize(
    "args,mentions",
    [
        (["--cold-fraction", "0"], "--cold-fraction"),
        (["--cold-fraction", "1.2"], "--cold-fraction"),
        (["--warm-rate", "-3"], "--warm-rate"),
        (["--seconds", "0"], "--seconds"),
        (["--deadline", "0"], "--deadline"),
        (["--warm-replicas", "0"], "--warm-replicas"),
        (["--arrival", "-1"], "--arrival"),
        (["--warmup", "-10"], "--warmup"),
        (["--sweep", "cold-fraction=1,0,0.5"], "--cold-fraction"),
        (["--sweep", "colour=1"], "--sweep"),
        (["--sweep", "warmup=abc"], "--sweep"),
        (["--sweep", "warm-replicas=2.5"], "--sweep"),
        (["--plot", "out.jpg"], "--plot"),
        (["--plot", "/no/such/dir/out.png"], "--plot"),
    ],
)
def test_bad_input_is_one_clear_error_with_exit_2(args: list[str], mentions: str, tmp_path: Path) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert result.stderr.count("error:") == 1
    assert mentions in result.stderr
    assert result.stdout == ""


def test_a_non_number_is_refused_by_the_parser() -> None:
    result = run("--warm-rate", "fast")
    assert result.exit_code == 2


def test_the_docs_show_the_table_exactly_as_the_command_prints_it() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "ramp-back.md").read_text()
    printed = runner.invoke(app, ["ramp"], env={"NO_COLOR": "1"}).stdout.rstrip("\n")
    assert printed in docs
    assert "![" in docs and "ramp-back.png" in docs
    assert (Path(__file__).resolve().parents[1] / "docs" / "ramp-back.png").stat().st_size > 10_000


def test_one_policy_with_a_sweep() -> None:
    result = run("--policy", "rate", "--sweep", "warmup=60,600", "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [set(r) for r in rows] == [{"warmup_s", "rate"}] * 2
    assert all(r["rate"]["late"] == 0.0 for r in rows)
