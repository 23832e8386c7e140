"""The simulator's own control API: shapes of its ``/sim/v1`` requests and answers.

These are the simulator's, for tests, benches and the demo to drive the world; fleetmend's
adapters never call them (they speak Kubernetes, Envoy, Prometheus text, Slack and Jira).

Paths (all JSON, on the simulator's one port):

  GET  /sim/v1/clock -> ClockReading      POST /sim/v1/faults <- FaultRequest
  GET  /sim/v1/actions?since_seq=          -> list[fleet.actionlog.ActionLogEntry]
  POST /sim/v1/notify <- NotifyMessage (Slack-compatible: {"text": ...})
  GET  /sim/v1/notify -> list[NotifyMessage]

Engines listen each at its own pod IP as in a cluster (``http://{podIP}:8000``, the port
configurable): ``POST /v1/completions``, ``GET /v1/models``, ``GET /metrics`` (vLLM Prometheus
text), ``GET /health``. Nodes: ``GET /nodes/{node}/metrics`` (dcgm-exporter text). Users reach the
engines through a gateway (Envoy, configured by fleetmend's control plane); the simulator has none.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from fleet.vocabulary import FaultKind


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ClockReading(_Wire):
    now: float
    speed: float


class FaultRequest(_Wire):
    kind: FaultKind
    target: str
    params: dict[str, Any] = Field(default_factory=dict)
    at: float | None = None  # sim time; None = now


class NotifyMessage(_Wire):
    model_config = ConfigDict(extra="allow")
    text: str
