"""Scheduled scale-downs as Temporal Schedules (``fleetmend schedule ...``).

A schedule starts ``PlannedScaleDown`` for one pool to an absolute target
(``--to N``) on a cron spec in a time zone, with optional jitter. Overlap policy
is **skip**: a scale-down still draining when the next one is due is never
joined by a second one. While a replica-loss incident is open on the pool the
scheduled run yields by itself (the workflow checks), so a schedule never
fights a recovery.

Schedule ids are ``scale-down/<namespace>/<service>/to-<N>`` unless named; the
scale-down's full input is kept in the schedule's memo so ``list`` and
``describe`` show it without decoding workflow payloads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, field_validator
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError, RPCStatusCode

from fleet import search_attributes as sa
from fleet.incident import PLANNED_SCALE_DOWN_WORKFLOW, PoolRef, scale_down_workflow_id
from fleet.scale_down import ScaleDownInput

SCHEDULE_PREFIX = "scale-down/"
MEMO_KEY = "scale_down"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")


class ScheduleError(ValueError):
    """A schedule request that cannot be carried out; the message says what to do."""


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m`` or ``2h`` as seconds."""
    match = _DURATION.match(text)
    if not match:
        raise ScheduleError(f"duration {text!r}: use seconds, or a number with s, m or h (e.g. 30s, 15m, 2h)")
    value = float(match.group(1))
    return value * {"s": 1, "m": 60, "h": 3600}[match.group(2) or "s"]


def parse_pool(text: str) -> PoolRef:
    namespace, _, service = text.partition("/")
    if not namespace or not service:
        raise ScheduleError(f"pool {text!r}: write it as NAMESPACE/SERVICE, e.g. inference/llama")
    try:
        return PoolRef(namespace=namespace, service=service)
    except ValueError as err:
        raise ScheduleError(f"pool {text!r}: namespace and service must be DNS labels ({err})") from None


class ScaleDownSchedule(BaseModel):
    """What ``fleetmend schedule create`` asks for."""

    model_config = ConfigDict(extra="forbid")

    pool: PoolRef
    to: int = Field(ge=0, description="Serving replica groups to keep")
    cron: str = Field(min_length=1)
    timezone: str = "UTC"
    jitter_s: float = Field(0.0, ge=0)
    drain_deadline_s: float = Field(600.0, gt=0)
    dry_run: bool = False
    group_capacity_tokens_per_s: float | None = Field(None, gt=0)
    note: str = Field("", max_length=1000)
    schedule_id: str | None = Field(None, min_length=1, max_length=200)

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"unknown time zone {value!r}: use an IANA name such as UTC or Europe/Berlin"
            ) from None
        return value

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, value: str) -> str:
        fields = value.split()
        if not value.startswith("@") and len(fields) not in (5, 6, 7):
            raise ValueError(
                f"cron {value!r} has {len(fields)} field(s): give 'minute hour day-of-month month day-of-week', "
                "e.g. '0 2 * * *' for 02:00 every day"
            )
        return value

    @property
    def id(self) -> str:
        return self.schedule_id or f"{SCHEDULE_PREFIX}{self.pool.namespace}/{self.pool.service}/to-{self.to}"

    def workflow_input(self) -> ScaleDownInput:
        return ScaleDownInput(
            pool=self.pool,
            target_groups=self.to,
            drain_deadline_s=self.drain_deadline_s,
            dry_run=self.dry_run,
            group_capacity_tokens_per_s=self.group_capacity_tokens_per_s,
            requested_by=f"schedule {self.id}",
        )


class ScheduleView(BaseModel):
    """One scale-down schedule as ``list`` and ``describe`` show it."""

    id: str
    pool: str | None = None
    to: int | None = None
    cron: list[str] = Field(default_factory=list)
    timezone: str = "UTC"
    jitter_s: float = 0.0
    drain_deadline_s: float | None = None
    dry_run: bool = False
    paused: bool = False
    note: str = ""
    next_runs: list[datetime] = Field(default_factory=list)
    recent_runs: list[str] = Field(default_factory=list, description="Workflow ids of recent runs")
    running: list[str] = Field(default_factory=list)


def _memo_fields(memo: Mapping[str, object] | None) -> dict[str, object]:
    data = (memo or {}).get(MEMO_KEY)
    return dict(data) if isinstance(data, dict) else {}


async def create_schedule(client: Client, req: ScaleDownSchedule, task_queue: str) -> str:
    """Create the schedule; an existing id is an error (delete it first, or name another with --id)."""
    inp = req.workflow_input()
    action = ScheduleActionStartWorkflow(
        PLANNED_SCALE_DOWN_WORKFLOW,
        inp,
        id=scale_down_workflow_id(req.pool),
        task_queue=task_queue,
        static_summary=f"Scheduled scale-down of {req.pool.key} to {req.to} replica groups",
        typed_search_attributes=TypedSearchAttributes(
            [
                SearchAttributePair(sa.FLEETMEND_KIND, "scale-down"),
                SearchAttributePair(sa.FLEETMEND_NAMESPACE, req.pool.namespace),
                SearchAttributePair(sa.FLEETMEND_POOL, req.pool.key),
                SearchAttributePair(sa.FLEETMEND_DRY_RUN, req.dry_run),
            ]
        ),
    )
    spec = ScheduleSpec(
        cron_expressions=[req.cron],
        time_zone_name=req.timezone,
        jitter=timedelta(seconds=req.jitter_s) if req.jitter_s else None,
    )
    schedule = Schedule(
        action=action,
        spec=spec,
        policy=SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP),
        state=ScheduleState(
            note=req.note or f"created by fleetmend schedule create ({req.pool.key} -> {req.to})"
        ),
    )
    memo = {MEMO_KEY: req.model_dump(mode="json")}
    try:
        await client.create_schedule(req.id, schedule, memo=memo)
    except ScheduleAlreadyRunningError:
        raise ScheduleError(
            f"schedule {req.id} already exists: `fleetmend schedule delete {req.id}` first, or pass --id NAME"
        ) from None
    except RPCError as err:
        if err.status == RPCStatusCode.INVALID_ARGUMENT:
            raise ScheduleError(f"Temporal refused the schedule: {err.message}") from None
        raise
    return req.id


async def list_schedules(client: Client) -> list[ScheduleView]:
    """Every fleetmend scale-down schedule (ids under ``scale-down/``, or with a scale-down memo)."""
    out: list[ScheduleView] = []
    async for entry in await client.list_schedules():
        memo = _memo_fields(await entry.memo())
        if not entry.id.startswith(SCHEDULE_PREFIX) and not memo:
            continue
        view = ScheduleView(id=entry.id, **_view_fields(memo))
        if entry.schedule is not None:
            spec = entry.schedule.spec
            view.cron = _cron_of(spec, memo)
            view.paused = entry.schedule.state.paused
            view.note = entry.schedule.state.note or ""
        if entry.info is not None:
            view.next_runs = list(entry.info.next_action_times)[:3]
            view.recent_runs = [
                a.action.workflow_id for a in entry.info.recent_actions if hasattr(a.action, "workflow_id")
            ][-5:]
        out.append(view)
    return sorted(out, key=lambda v: v.id)


def _cron_of(spec: ScheduleSpec, memo: dict[str, object]) -> list[str]:
    """The cron as written: the server normalises cron expressions into calendar specs."""
    if spec.cron_expressions:
        return list(spec.cron_expressions)
    if isinstance(memo.get("cron"), str):
        return [str(memo["cron"])]
    return [f"{len(spec.calendars)} calendar spec(s)"] if spec.calendars else []


def _view_fields(memo: dict[str, object]) -> dict[str, object]:
    if not memo:
        return {}
    pool = memo.get("pool")
    pool_key = f"{pool['namespace']}/{pool['service']}" if isinstance(pool, dict) else None
    return {
        "pool": pool_key,
        "to": memo.get("to"),
        "timezone": memo.get("timezone") or "UTC",
        "jitter_s": memo.get("jitter_s") or 0.0,
        "drain_deadline_s": memo.get("drain_deadline_s"),
        "dry_run": bool(memo.get("dry_run")),
    }


async def describe_schedule(client: Client, schedule_id: str) -> ScheduleView:
    desc = await _describe(client, schedule_id)
    memo = _memo_fields(await desc.memo())
    spec = desc.schedule.spec
    return ScheduleView(
        id=schedule_id,
        **_view_fields(memo),
        cron=_cron_of(spec, memo),
        paused=desc.schedule.state.paused,
        note=desc.schedule.state.note or "",
        next_runs=list(desc.info.next_action_times)[:5],
        recent_runs=[
            a.action.workflow_id for a in desc.info.recent_actions if hasattr(a.action, "workflow_id")
        ],
        running=[r.workflow_id for r in desc.info.running_actions],
    )


async def _describe(client: Client, schedule_id: str):  # type: ignore[no-untyped-def]
    try:
        return await client.get_schedule_handle(schedule_id).describe()
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            raise ScheduleError(f"no schedule {schedule_id!r}: see `fleetmend schedule list`") from None
        raise


async def pause_schedule(client: Client, schedule_id: str, note: str) -> None:
    if not note.strip():
        raise ScheduleError("pausing needs a --note saying why (the next operator reads it)")
    await _describe(client, schedule_id)
    await client.get_schedule_handle(schedule_id).pause(note=note)


async def unpause_schedule(client: Client, schedule_id: str, note: str) -> None:
    if not note.strip():
        raise ScheduleError("unpausing needs a --note saying why")
    await _describe(client, schedule_id)
    await client.get_schedule_handle(schedule_id).unpause(note=note)


async def trigger_schedule(client: Client, schedule_id: str) -> None:
    """Run it now (the overlap policy still applies: skipped while a run is in progress)."""
    await _describe(client, schedule_id)
    await client.get_schedule_handle(schedule_id).trigger()


async def delete_schedule(client: Client, schedule_id: str) -> None:
    """Delete the schedule; a run already started keeps running (abort it with its ``abort`` Update)."""
    await _describe(client, schedule_id)
    await client.get_schedule_handle(schedule_id).delete()
