"""`fleetmend model ramp`: plan a ramp-back with the runbook's equal-share vs rate-weighted model.

Plug in your own fleet's numbers (warm rate, how cold a replacement starts,
how long it takes to warm up, your deadline) and see how many requests an
equal-share router would make late compared with weighting by measured rate -
the policy fleetmend's live ramp-back uses (``fleet.ramp.rate_weights``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from fleet.ramp import RampParams, RampPolicy, RampResult, RampTrace, simulate_ramp_trace
from worker.cli.common import fail

app = typer.Typer(no_args_is_help=True)


@app.callback()
def model() -> None:
    """Capacity what-if models: plan a ramp-back with your own fleet's numbers."""


# Model field -> the option a user typed, so errors name what they can fix.
_OPTION_OF_FIELD = {
    "warm_rate": "--warm-rate",
    "cold_fraction": "--cold-fraction",
    "warmup_s": "--warmup",
    "deadline_s": "--deadline",
    "warm_replicas": "--warm-replicas",
    "seconds": "--seconds",
    "arrival": "--arrival",
}
# --sweep NAME=... -> model field.
_SWEEPABLE = {
    "cold-fraction": "cold_fraction",
    "warmup": "warmup_s",
    "warm-rate": "warm_rate",
    "deadline": "deadline_s",
    "warm-replicas": "warm_replicas",
    "arrival": "arrival",
    "seconds": "seconds",
}
_FIGURES = ("served", "late", "goodput", "peak_wait_new", "final_depth_new")
_FIGURE_LABELS = {
    "served": "served (requests)",
    "late": "late (requests)",
    "goodput": "goodput (requests)",
    "peak_wait_new": "peak wait on replacement (s)",
    "final_depth_new": "replacement queue at end (requests)",
}


class _BadInput(Exception):
    pass


def _params(values: dict[str, Any]) -> RampParams:
    try:
        return RampParams(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = str(err["loc"][0]) if err["loc"] else ""
            option = _OPTION_OF_FIELD.get(field, field)
            problems.append(f"{option} {err['input']!r}: {err['msg'].lower()}")
        raise _BadInput("; ".join(problems) + ". Fix the value and run again.") from None


def _parse_sweep(spec: str) -> tuple[str, list[str]]:
    name, sep, raw = spec.partition("=")
    name = name.strip()
    if not sep or name not in _SWEEPABLE:
        raise _BadInput(
            f"--sweep {spec!r}: expected NAME=V1,V2,... with NAME one of {', '.join(_SWEEPABLE)} "
            "(e.g. --sweep cold-fraction=1,0.75,0.5,0.25)."
        )
    values = [v.strip() for v in raw.split(",") if v.strip()]
    if not values:
        raise _BadInput(f"--sweep {spec!r}: give at least one value after '='.")
    return name, values


def _sweep_value(name: str, raw: str) -> float | int:
    try:
        value = float(raw)
    except ValueError:
        raise _BadInput(f"--sweep {name}: {raw!r} is not a number.") from None
    if _SWEEPABLE[name] in ("warm_replicas", "seconds"):
        if value != int(value):
            raise _BadInput(f"--sweep {name}: {raw!r} must be a whole number.")
        return int(value)
    return value


def _fmt(value: float) -> str:
    return f"{value:,.2f}"


def _ratio(a: float, b: float) -> str:
    if b == 0.0:
        return "-" if a == 0.0 else "inf"
    return f"{a / b:.2f}x"


def _describe(p: RampParams) -> str:
    return (
        f"R={p.warm_rate:g} req/s, c={p.cold_fraction:g}, T={p.warmup_s:g} s, D={p.deadline_s:g} s, "
        f"W={p.warm_replicas}, S={p.seconds} s, A={p.arrival_rate:g} req/s"
    )


def _comparison_table(params: RampParams, results: dict[RampPolicy, RampResult]) -> Table:
    table = Table(
        title="Ramp-back after a replica loss: equal share vs rate-weighted", caption=_describe(params)
    )
    table.add_column("figure")
    for policy in results:
        table.add_column(policy.value, justify="right")
    both = len(results) == 2
    if both:
        table.add_column("equal / rate", justify="right")
    for key in _FIGURES:
        vals = [getattr(r, key) for r in results.values()]
        row = [_FIGURE_LABELS[key], *(_fmt(v) for v in vals)]
        if both:
            row.append(_ratio(vals[0], vals[1]))
        table.add_row(*row)
    return table


def _sweep_table(
    name: str, params: RampParams, rows: list[tuple[float | int, dict[RampPolicy, RampResult]]]
) -> Table:
    policies = list(rows[0][1])
    table = Table(title=f"Ramp-back sweep over {name}", caption=_describe(params) + f"; {name} varies")
    table.add_column(name, justify="right")
    for heading in ("late", "peak wait (s)", "goodput"):
        for policy in policies:
            table.add_column(f"{policy.value} {heading}", justify="right")
    if len(policies) == 2:
        table.add_column("late equal / rate", justify="right")
    for value, results in rows:
        cells = [f"{value:g}"]
        for figure in ("late", "peak_wait_new", "goodput"):
            cells += [_fmt(getattr(results[p], figure)) for p in policies]
        if len(policies) == 2:
            cells.append(_ratio(results[RampPolicy.EQUAL].late, results[RampPolicy.RATE].late))
        table.add_row(*cells)
    return table


def plot_waits(traces: list[tuple[str, RampTrace]], deadline_s: float, path: Path) -> None:
    """Draw the replacement's queue wait per second for each run, with the deadline line."""
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=110)
    for label, trace in traces:
        style = "-" if trace.policy is RampPolicy.EQUAL else "--"
        ax.plot(range(len(trace.wait_new)), trace.wait_new, style, linewidth=2.2, label=label, clip_on=False)
    ax.axhline(
        deadline_s, color="crimson", linestyle=":", linewidth=1.5, label=f"deadline D = {deadline_s:g} s"
    )
    ax.set_xlabel("seconds since the replacement joined")
    ax.set_ylabel("queue wait on the replacement (s)")
    ax.set_title("Replacement's queue wait while it warms up: equal share vs rate-weighted")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@app.command("ramp")
def ramp(
    policy: RampPolicy | None = typer.Option(
        None, "--policy", help="Run one policy; without it both run side by side with the ratio."
    ),
    warm_rate: float = typer.Option(20.0, "--warm-rate", help="R: requests/s a warm replica sustains."),
    cold_fraction: float = typer.Option(
        0.25, "--cold-fraction", help="c in (0, 1]: the replacement's starting rate as a fraction of R."
    ),
    warmup: float = typer.Option(
        120.0, "--warmup", help="T: seconds until the replacement is warm (0 = warm)."
    ),
    deadline: float = typer.Option(30.0, "--deadline", help="D: a request waiting longer than this is late."),
    warm_replicas: int = typer.Option(3, "--warm-replicas", help="W: warm surviving replicas."),
    seconds: int = typer.Option(600, "--seconds", help="S: horizon of the model in seconds."),
    arrival: float | None = typer.Option(
        None, "--arrival", help="A: arrivals per second (default W x R: the replacement is headroom)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (the five figures, unrounded)."),
    sweep: str | None = typer.Option(
        None, "--sweep", help="Vary one input, e.g. cold-fraction=1,0.75,0.5,0.25 or warmup=30,120,600."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write a PNG of the replacement's queue wait over time, both policies."
    ),
) -> None:
    """Equal-share vs rate-weighted ramp-back: late requests while a cold replacement warms up."""
    base_values: dict[str, Any] = {
        "warm_rate": warm_rate,
        "cold_fraction": cold_fraction,
        "warmup_s": warmup,
        "deadline_s": deadline,
        "warm_replicas": warm_replicas,
        "seconds": seconds,
        "arrival": arrival,
    }
    policies = [policy] if policy is not None else [RampPolicy.EQUAL, RampPolicy.RATE]
    try:
        if plot is not None and plot.suffix.lower() != ".png":
            raise _BadInput(f"--plot {str(plot)!r}: the file name must end in .png.")
        if plot is not None and not plot.resolve().parent.is_dir():
            raise _BadInput(f"--plot {str(plot)!r}: directory {str(plot.resolve().parent)!r} does not exist.")
        base = _params(base_values)
        # Validate every sweep point before running anything: one bad value, one error, no output.
        points: list[tuple[float | int, RampParams]] = []
        sweep_name = ""
        if sweep is not None:
            sweep_name, raw_values = _parse_sweep(sweep)
            for raw in raw_values:
                value = _sweep_value(sweep_name, raw)
                points.append((value, _params({**base_values, _SWEEPABLE[sweep_name]: value})))
    except _BadInput as exc:
        raise fail(str(exc)) from None

    console = Console()
    # The plot always shows both policies: the contrast is the point of the picture.
    traces: list[tuple[str, RampTrace]] = []
    if sweep is None:
        runs = {p: simulate_ramp_trace(base, p) for p in RampPolicy}
        results = {p: runs[p].result for p in policies}
        traces = [(f"{p.value}", t) for p, t in runs.items()]
        if as_json:
            if policy is not None:
                typer.echo(json.dumps(results[policy].model_dump()))
            else:
                typer.echo(json.dumps({p.value: r.model_dump() for p, r in results.items()}))
        else:
            console.print(_comparison_table(base, results))
    else:
        rows: list[tuple[float | int, dict[RampPolicy, RampResult]]] = []
        for value, params in points:
            runs = {p: simulate_ramp_trace(params, p) for p in RampPolicy}
            rows.append((value, {p: runs[p].result for p in policies}))
            traces += [(f"{p.value}, {sweep_name}={value:g}", t) for p, t in runs.items()]
        if as_json:
            key = _SWEEPABLE[sweep_name]
            out = [
                {key: value, **{p.value: r.model_dump() for p, r in results.items()}}
                for value, results in rows
            ]
            typer.echo(json.dumps(out))
        else:
            console.print(_sweep_table(sweep_name, base, rows))
    if plot is not None:
        plot_waits(traces, base.deadline_s, plot)
        Console(stderr=True).print(f"wrote {plot}", highlight=False)
