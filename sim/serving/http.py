"""HTTP API of the serving layer (paths and shapes from ``fleet.protocol``).

Mounted on the simulator's one port by ``sim.serving.attach``. The engines are not here:
each listens on its own pod IP (``sim.serving.pods``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from fleet.protocol import (
    AdmissionChange,
    FaultRequest,
    JournalPage,
    NotifyMessage,
    Outcome,
    RetryPolicyChange,
    RouterState,
    RoutingSet,
    WeightsChange,
)
from fleet.vocabulary import MODEL_LABEL, TIER_HEADER, Tier
from sim.serving.faults import FaultError
from sim.serving.jira import install_jira_routes
from sim.serving.kubeview import pod_labels
from sim.serving.layer import ServingLayer
from sim.serving.loadgen import install_load_routes
from sim.serving.router import CompletionRequest, GatewayError, StaleVersion
from sim.serving.streams import collect, completion_body, error_body, sse_chunks
from sim.serving.supervisor import is_leader
from sim.serving.telemetry import gpu_assignment, render_dcgm, render_kube_state

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class EffectsConfig(BaseModel):
    """Where the gateway's "model" proposes external effects, and for which share of requests."""

    model_config = ConfigDict(extra="forbid")
    url: str | None = Field(
        default=None, description="fleetmend's effect endpoint, e.g. http://host:8088/v1/effects"
    )
    share: float = Field(default=0.0, ge=0.0, le=1.0)
    kind: str = Field(default="ticket", min_length=1)
    target: str = Field(default="jira", min_length=1)
    token: str | None = Field(
        default=None,
        min_length=1,
        description="bearer token sent with every proposal (fleetmend's FLEETMEND_EFFECTS_TOKEN); "
        "write-only: reads show only whether one is set",
    )
    token_set: bool = Field(default=False, description="read-only: a token is configured")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"detail": message, **extra}, status_code=status)


def build_router(layer: ServingLayer) -> APIRouter:
    api = APIRouter()
    router = layer.router

    # ---- router admin ---------------------------------------------------------------------
    def pool_or_404(ns: str, svc: str) -> str:
        key = f"{ns}/{svc}"
        try:
            router.pool(key)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        return key

    @api.get("/router/v1/pools/{ns}/{svc}/state", response_model=RouterState, tags=["router"])
    async def get_state(ns: str, svc: str) -> RouterState:
        return router.state(pool_or_404(ns, svc))

    @api.get("/router/v1/pools/{ns}/{svc}/routing-set", response_model=RoutingSet, tags=["router"])
    async def get_routing_set(ns: str, svc: str) -> RoutingSet:
        return router.routing_set(pool_or_404(ns, svc))

    def versioned(apply: Any, key: str, change: Any) -> Any:
        try:
            return apply(key, change)
        except StaleVersion as exc:
            return _error(409, str(exc), current_version=exc.current)
        except ValueError as exc:
            return _error(422, str(exc))

    @api.put("/router/v1/pools/{ns}/{svc}/weights", response_model=RouterState, tags=["router"])
    async def put_weights(ns: str, svc: str, change: WeightsChange) -> Any:
        return versioned(router.set_weights, pool_or_404(ns, svc), change)

    @api.put("/router/v1/pools/{ns}/{svc}/admission", response_model=RouterState, tags=["router"])
    async def put_admission(ns: str, svc: str, change: AdmissionChange) -> Any:
        return versioned(router.set_admission, pool_or_404(ns, svc), change)

    @api.put("/router/v1/pools/{ns}/{svc}/retry-policy", response_model=RouterState, tags=["router"])
    async def put_retry(ns: str, svc: str, change: RetryPolicyChange) -> Any:
        return versioned(router.set_retry_policy, pool_or_404(ns, svc), change)

    @api.get("/router/v1/journal", response_model=JournalPage, tags=["router"])
    async def get_journal(
        pool: str | None = None,
        replica: str | None = None,
        since: float | None = None,
        until: float | None = None,
        outcome: Outcome | None = None,
        request_id: str | None = None,
        limit: int = Query(1000, ge=1, le=10_000),
    ) -> JournalPage:
        return layer.journal.query(
            pool=pool,
            replica=replica,
            since=since,
            until=until,
            outcome=outcome,
            request_id=request_id,
            limit=limit,
        )

    # ---- data plane --------------------------------------------------------------------------
    @api.get("/v1/models", tags=["gateway"])
    async def list_models() -> dict[str, Any]:
        served = router.served_models()
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "owned_by": p} for m, p in sorted(served.items())],
        }

    @api.post("/v1/completions", tags=["gateway"])
    async def completions(
        body: CompletionRequest,
        x_request_id: str | None = Header(None),
        x_fleetmend_tier: str | None = Header(None),
    ) -> Response:
        if x_request_id and not body.request_id:
            body.request_id = x_request_id
        if x_fleetmend_tier is not None:
            try:
                body.tier = Tier(x_fleetmend_tier)
            except ValueError:
                known = [t.value for t in Tier]
                return JSONResponse(
                    error_body(
                        400,
                        "invalid_tier",
                        f"{TIER_HEADER}: {x_fleetmend_tier!r} is not a tier; use one of {known}",
                    ),
                    status_code=400,
                )
        try:
            completion = await router.complete(body)
        except GatewayError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        headers = {
            "x-request-id": completion.request_id,
            "x-fleetmend-replica": completion.replica,
            "x-fleetmend-attempt": str(completion.attempt),
        }
        if body.stream:
            return StreamingResponse(
                sse_chunks(
                    completion.request_id, completion.model, completion.events(), completion.first_tokens
                ),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        tokens, finish, error = await collect(completion.events(), completion.first_tokens)
        if error is not None:
            return JSONResponse(
                error_body(502, "upstream_failed", error.message), status_code=502, headers=headers
            )
        return JSONResponse(
            completion_body(completion.request_id, completion.model, tokens, finish), headers=headers
        )

    # ---- engines and nodes ----------------------------------------------------------------------
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
        c = router.config
        return EffectsConfig(
            url=c.effect_url,
            share=c.effect_share,
            kind=c.effect_kind,
            target=c.effect_target,
            token_set=c.effect_token is not None,
        )

    @api.put("/sim/v1/serving/effects", response_model=EffectsConfig, tags=["sim"])
    async def put_effects(body: EffectsConfig) -> EffectsConfig:
        if body.url is not None and not body.url.startswith(("http://", "https://")):
            raise HTTPException(422, f"url must be an http(s) URL (got {body.url!r})")
        c = router.config
        c.effect_url, c.effect_share, c.effect_kind, c.effect_target, c.effect_token = (
            body.url,
            body.share,
            body.kind,
            body.target,
            body.token,
        )
        return body.model_copy(update={"token": None, "token_set": body.token is not None})

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
