"""HTTP API of the serving layer: nodes' and the cluster's metrics, faults, load, sinks.

Mounted on the simulator's one port by ``sim.serving.attach``. The engines are not here:
each listens on its own pod IP (``sim.serving.pods``), and users reach them through a gateway
(``PUT /sim/v1/gateway``); the simulator has no gateway of its own.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from fleet.vocabulary import MODEL_LABEL
from sim.control import FaultRequest, NotifyMessage
from sim.serving.effects import EffectsConfig
from sim.serving.faults import FaultError
from sim.serving.jira import install_jira_routes
from sim.serving.kubeview import pod_labels
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import install_load_routes
from sim.serving.supervisor import is_leader
from sim.serving.telemetry import gpu_assignment, render_dcgm, render_kube_state

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": message, **extra}, status_code=status)


def build_router(layer: ServingLayer) -> APIRouter:
    api = APIRouter()

    # ---- nodes ---------------------------------------------------------------------------------
    @api.get("/nodes/{node}/metrics", tags=["nodes"])
    async def node_metrics(node: str) -> Response:
        try:
            tel = layer.node_telemetry(node)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        if layer.world.is_node_lost(node):
            return PlainTextResponse(f"dcgm-exporter on {node} is not answering\n", status_code=503)
        text = render_dcgm(
            tel, gpu_assignment(layer.kube, node), layer.gpu_utilisation(node), layer.clock.now()
        )
        return Response(text, media_type=PROMETHEUS_TEXT)

    @api.get("/metrics", tags=["cluster"])
    async def kube_state_metrics() -> Response:
        return Response(render_kube_state(layer.kube), media_type=PROMETHEUS_TEXT)

    @api.get("/sim/v1/prometheus/targets", tags=["sim"])
    async def prometheus_targets(request: Request) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: every engine at its pod IP, every node's DCGM page.

        Engines are listed as kubernetes_sd (role pod) would find them: every serving pod with
        an IP (leaders of multi-node groups), started or not, at ``{podIP}:{engine_port}``, so a
        pod whose engine is loading, crashed or gone scrapes as down."""
        host = request.headers.get("host", request.url.netloc)
        out: list[dict[str, Any]] = []
        port = layer.settings.engine_port
        replicas = sorted(
            (p["metadata"]["namespace"], p["metadata"]["name"], (p.get("status") or {}).get("podIP"))
            for p in layer.kube.pods()
            if MODEL_LABEL in pod_labels(p) and is_leader(p) and (p.get("status") or {}).get("podIP")
        )
        for ns, pod, ip in replicas:
            out.append(
                {
                    "targets": [f"{ip}:{port}"],
                    "labels": {"job": "vllm", "namespace": ns, "pod": pod},
                }
            )
        for node in sorted(n["metadata"]["name"] for n in layer.kube.nodes()):
            out.append(
                {
                    "targets": [host],
                    "labels": {
                        "__metrics_path__": f"/nodes/{node}/metrics",
                        "job": "dcgm-exporter",
                        "node": node,
                    },
                }
            )
        return out

    # ---- simulator control ----------------------------------------------------------------------
    @api.post("/sim/v1/faults", status_code=202, tags=["sim"])
    async def post_fault(fault: FaultRequest) -> Any:
        try:
            return layer.submit_fault(fault)
        except FaultError as exc:
            return _error(exc.status, exc.message)
        except KeyError as exc:  # e.g. the pod exists but its container is not running on a node
            return _error(409, f"cannot apply {fault.kind.value} to {fault.target} now: {exc.args[0]}")

    @api.get("/sim/v1/serving/effects", response_model=EffectsConfig, tags=["sim"])
    async def get_effects() -> EffectsConfig:
        return layer.effects.config.shown()

    @api.put("/sim/v1/serving/effects", response_model=EffectsConfig, tags=["sim"])
    async def put_effects(body: EffectsConfig) -> EffectsConfig:
        if body.url is not None and not body.url.startswith(("http://", "https://")):
            raise HTTPException(422, f"url must be an http(s) URL (got {body.url!r})")
        layer.effects.config = body.model_copy(update={"token_set": body.token is not None})
        return layer.effects.config.shown()

    @api.post("/sim/v1/notify", tags=["sim"])
    async def post_notify(message: NotifyMessage) -> Response:
        layer.notify(message)
        return PlainTextResponse("ok")  # what a Slack incoming webhook answers

    @api.get("/sim/v1/notify", response_model=list[NotifyMessage], tags=["sim"])
    async def get_notify() -> list[dict[str, Any]]:
        return layer.notifications

    install_load_routes(api, layer)
    install_jira_routes(api, layer)
    return api
