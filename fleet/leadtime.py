"""Step 6 of the replica-loss procedure: how long until new warm capacity exists.

When no warm spare exists, the incident channel gets the expected lead time as
a number, not "scaling up...". It is the sum of the phases a replacement goes
through:

    node provisioning + image pull + weight load + distributed init + warm-up

Each phase starts from configuration (``LeadTimeConfig``) and is blended with
what earlier recoveries of the **same model** actually took (``PastRecovery``,
from the incident records): with ``n`` measured samples of median ``m`` and the
configured value ``c``, the estimate is ``(n*m + c) / (n + 1)`` - the config
counts as one more observation, so one odd recovery does not swing the number
and a consistent history wins. Phases that do not apply are zero: no
provisioning when a node with room exists, no image pull when the image is
cached, no distributed init for a single-pod group.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median

from pydantic import BaseModel, ConfigDict, Field

PHASES = ("provisioning", "image_pull", "weight_load", "distributed_init", "warmup")


class LeadTimeConfig(BaseModel):
    """Configured phase durations in seconds (an operator's best knowledge of the fleet)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provisioning_s: float = Field(default=600.0, ge=0)
    image_pull_s: float = Field(default=180.0, ge=0)
    weight_load_s: float = Field(default=300.0, ge=0)
    distributed_init_s: float = Field(default=60.0, ge=0)
    warmup_s: float = Field(default=120.0, ge=0)


class PastRecovery(BaseModel):
    """Measured phase durations of one earlier recovery (None = not measured)."""

    model_config = ConfigDict(frozen=True)

    model: str
    provisioning_s: float | None = Field(default=None, ge=0)
    image_pull_s: float | None = Field(default=None, ge=0)
    weight_load_s: float | None = Field(default=None, ge=0)
    distributed_init_s: float | None = Field(default=None, ge=0)
    warmup_s: float | None = Field(default=None, ge=0)


class LeadTimePhase(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    seconds: float
    source: str  # "config", "config blended with N earlier recoveries", "not needed: ..."
    samples: int = 0


class LeadTimeEstimate(BaseModel):
    model_config = ConfigDict(frozen=True)

    model: str
    total_s: float
    phases: tuple[LeadTimePhase, ...]
    text: str


def _human(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m} min {s:02d} s" if s else f"{m} min"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def estimate_lead_time(
    model: str,
    config: LeadTimeConfig | None = None,
    history: Iterable[PastRecovery] = (),
    needs_new_node: bool = True,
    image_cached: bool = False,
    multi_node: bool = False,
) -> LeadTimeEstimate:
    cfg = config or LeadTimeConfig()
    same_model = [h for h in history if h.model == model]
    skip = {
        "provisioning": None if needs_new_node else "a node with room exists",
        "image_pull": "image cached on the target node" if image_cached else None,
        "distributed_init": None if multi_node else "single-pod group",
    }
    phases: list[LeadTimePhase] = []
    for name in PHASES:
        field = f"{name}_s"
        if skip.get(name):
            phases.append(LeadTimePhase(name=name, seconds=0.0, source=f"not needed: {skip[name]}"))
            continue
        configured = float(getattr(cfg, field))
        samples = [float(v) for h in same_model if (v := getattr(h, field)) is not None]
        if samples:
            n = len(samples)
            seconds = (n * median(samples) + configured) / (n + 1)
            source = f"config {_human(configured)} blended with {n} earlier recover{'y' if n == 1 else 'ies'}"
        else:
            seconds, source = configured, "config"
        phases.append(LeadTimePhase(name=name, seconds=seconds, source=source, samples=len(samples)))
    total = sum(p.seconds for p in phases)
    detail = ", ".join(f"{p.name.replace('_', ' ')} {_human(p.seconds)}" for p in phases if p.seconds > 0)
    text = f"Expected lead time for new {model} capacity: {_human(total)} ({total:.0f} s) = {detail}"
    return LeadTimeEstimate(model=model, total_s=total, phases=tuple(phases), text=text)
