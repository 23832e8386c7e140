"""The world's issue tracker: the part of Jira's REST API v2 that ``ticket.create`` uses.

* ``POST /rest/api/2/issue`` — ``{"fields": {project, issuetype, summary, description, labels}}`` →
  ``201 {"id", "key", "self"}``; a missing field is ``400`` with Jira's ``errors`` map.
* ``GET /rest/api/2/issue/{key}`` — the issue, or ``404``.
* ``GET /rest/api/2/search`` (Data Center) and ``GET /rest/api/2/search/jql`` (Cloud) — JQL limited to
  ``field = "value"`` clauses joined by ``AND`` on ``project`` and ``labels`` (all fleetmend's probe
  asks); anything else is ``400``, as Jira answers a query it cannot parse.

Like Jira, it takes no idempotency key: a repeated create is a second issue. Every route wants an
``Authorization`` header (Basic or Bearer) and answers ``401`` without one; any token is accepted.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from sim.serving.layer import ServingLayer

_CLAUSE = re.compile(r'^\s*(project|labels)\s*=\s*"?([^"\s]+)"?\s*$', re.IGNORECASE)


def _errors(status: int, messages: list[str], errors: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"errorMessages": messages, "errors": errors or {}}, status_code=status)


def _unauthenticated(request: Request) -> JSONResponse | None:
    auth = request.headers.get("authorization", "")
    if auth.startswith(("Basic ", "Bearer ")) and len(auth.split(" ", 1)[1].strip()) > 0:
        return None
    return _errors(401, ["You are not authenticated. Authentication required to perform this operation."])


def parse_jql(jql: str) -> dict[str, str] | str:
    """``{"project": ..., "labels": ...}`` from ``a = "x" AND b = "y"``, or why it cannot be parsed."""
    wanted: dict[str, str] = {}
    if not jql.strip():
        return wanted
    for clause in re.split(r"\s+AND\s+", jql.strip(), flags=re.IGNORECASE):
        match = _CLAUSE.match(clause)
        if match is None:
            return (
                f"Error in the JQL Query: {clause!r} is not supported here (the simulated Jira takes "
                'project = "KEY" and labels = "label", joined by AND)'
            )
        wanted[match.group(1).lower()] = match.group(2)
    return wanted


def install_jira_routes(api: APIRouter, layer: ServingLayer) -> None:
    def issue_view(request: Request, issue: dict[str, Any]) -> dict[str, Any]:
        return {**issue, "self": str(request.base_url).rstrip("/") + f"/rest/api/2/issue/{issue['id']}"}

    @api.post("/rest/api/2/issue", status_code=201, tags=["jira"])
    async def create_issue(request: Request) -> JSONResponse:
        if (refused := _unauthenticated(request)) is not None:
            return refused
        try:
            body = await request.json()
        except ValueError:
            return _errors(400, ["The request body is not JSON."])
        fields = body.get("fields") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            return _errors(400, ['The request body needs a "fields" object.'])
        missing = {}
        if not (fields.get("project") or {}).get("key"):
            missing["project"] = "Specify a valid project ID or key"
        if not (fields.get("issuetype") or {}).get("name"):
            missing["issuetype"] = "Specify an issue type"
        if not str(fields.get("summary") or "").strip():
            missing["summary"] = "You must specify a summary of the issue."
        labels = fields.get("labels") or []
        if not isinstance(labels, list) or any(not isinstance(x, str) or " " in x for x in labels):
            missing["labels"] = "Labels are strings without spaces."
        if missing:
            return _errors(400, [], missing)
        issue = layer.create_issue(
            project=fields["project"]["key"],
            issue_type=fields["issuetype"]["name"],
            summary=str(fields["summary"]),
            description=str(fields.get("description") or ""),
            labels=[str(x) for x in labels],
        )
        view = issue_view(request, issue)
        return JSONResponse({"id": view["id"], "key": view["key"], "self": view["self"]}, status_code=201)

    @api.get("/rest/api/2/issue/{key}", tags=["jira"])
    async def get_issue(key: str, request: Request) -> JSONResponse:
        if (refused := _unauthenticated(request)) is not None:
            return refused
        for issue in layer.issues:
            if key in (issue["key"], issue["id"]):
                return JSONResponse(issue_view(request, issue))
        return _errors(404, ["Issue Does Not Exist"])

    async def search(request: Request, cloud: bool) -> JSONResponse:
        if (refused := _unauthenticated(request)) is not None:
            return refused
        wanted = parse_jql(request.query_params.get("jql", ""))
        if isinstance(wanted, str):
            return _errors(400, [wanted])
        found = [
            issue_view(request, i)
            for i in layer.issues
            if ("project" not in wanted or i["fields"]["project"]["key"] == wanted["project"])
            and ("labels" not in wanted or wanted["labels"] in i["fields"]["labels"])
        ]
        limit = int(request.query_params.get("maxResults", "50") or 50)
        if cloud:
            return JSONResponse({"issues": found[:limit], "isLast": len(found) <= limit})
        return JSONResponse({"startAt": 0, "maxResults": limit, "total": len(found), "issues": found[:limit]})

    @api.get("/rest/api/2/search", tags=["jira"])
    async def search_datacenter(request: Request) -> JSONResponse:
        return await search(request, cloud=False)

    @api.get("/rest/api/2/search/jql", tags=["jira"])
    async def search_cloud(request: Request) -> JSONResponse:
        return await search(request, cloud=True)
