"""``pods/exec`` over WebSockets: what ``kubectl exec POD -- curl -s localhost:8000/metrics`` needs.

kubectl ≥ 1.30 opens exec as a WebSocket (KEP-4006, "Transition from SPDY to WebSockets"): a ``GET``
of ``/api/v1/namespaces/{ns}/pods/{name}/exec?command=...&stdout=true&stderr=true`` with
``Upgrade: websocket`` and the RemoteCommand subprotocols it speaks in ``Sec-WebSocket-Protocol``,
newest first (``v5.channel.k8s.io``, ``v4.channel.k8s.io``, ...). It falls back to SPDY (a ``POST``)
only when the upgrade itself fails. The channel framing (apimachinery ``wsstream``): every binary
message starts with one byte naming its stream, stdin=0, stdout=1, stderr=2, error=3, resize=4;
the error stream carries one ``metav1.Status`` (v4+) — ``Success``, or ``Failure`` with reason
``NonZeroExitCode`` and a cause ``{"reason": "ExitCode", "message": "<code>"}`` that kubectl turns
into "command terminated with exit code N" and its own exit status; any other ``Failure`` is printed
as ``error: <message>`` with exit 1. v5 adds a stream CLOSE signal, a message ``[255, <stream>]``: the
client's half-close of stdin (kubectl's own reader logs "Unknown stream" for one sent its way, so the
server sends none); stdin is not read here. Closing the WebSocket ends every stream, and kubectl,
which reads the error stream to its end, then reports.

The simulated container runs no shell. What it answers, from the pod's own engine (the sim's
engines listen on ``{podIP}:{port}``, ``sim.serving.pods``), the way curl would:

* ``curl [-s] [-S] [-f] [-m SECS] [http://]localhost:PORT/PATH`` (also ``127.0.0.1`` or the pod IP):
  the engine's answer body on stdout; curl's progress meter on stderr unless ``-s``; nothing
  listening (no engine, engine dead) is curl's exit 7, ``-f`` and an HTTP error its exit 22;
* ``cat FILE`` for ``/etc/hostname``, ``/etc/hosts``, ``/etc/resolv.conf`` and the service-account
  ``namespace`` file.

Any other command is refused on the error stream with a Status naming what is answered (exit 1).
Before the upgrade, the checks the apiserver makes: pod and container exist (404 / 400), the pod is
running (400), its node's kubelet answers (500 "error dialing backend" on a lost node), the bearer
token (401); a plain request (SPDY, or none) gets a 400 saying so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx
from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response

from sim.k8s.errors import ApiError, bad_request, not_found, unauthorized

Obj = dict[str, Any]
STDOUT, STDERR, ERROR = 1, 2, 3
PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")  # ours, in preference order
FILES_SERVED = (
    "/etc/hostname",
    "/etc/hosts",
    "/etc/resolv.conf",
    "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
)
CURL_TIMEOUT_S = 10.0


class ExecResult:
    """What a command wrote and how it ended (``error``: a Failure Status that is not an exit code)."""

    def __init__(self, stdout: bytes = b"", stderr: bytes = b"", exit_code: int = 0, error: str = "") -> None:
        self.stdout = stdout
        self.stderr = stderr
        self.exit_code = exit_code
        self.error = error

    def status(self, command: list[str]) -> Obj:
        """The error stream's Status (remotecommand v4 ``errorDecoderV4``'s input)."""
        if self.error:
            return {"metadata": {}, "status": "Failure", "message": self.error, "reason": "InternalError"}
        if self.exit_code == 0:
            return {"metadata": {}, "status": "Success"}
        return {
            "metadata": {},
            "status": "Failure",
            "message": (
                f"command terminated with non-zero exit code: error executing command {_go_list(command)}, "
                f"exit code {self.exit_code}"
            ),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": str(self.exit_code)}]},
        }


def _go_list(command: list[str]) -> str:
    return "[" + " ".join(command) + "]"


# ------------------------------------------------------------------- the container's commands
async def run_command(pod: Obj, command: list[str]) -> ExecResult:
    """Run ``command`` in the simulated container of ``pod``."""
    if not command:
        return ExecResult(error="you must specify at least one command for the container")
    program = command[0].rsplit("/", 1)[-1]
    if program == "curl":
        return await _curl(pod, command[1:])
    if program == "cat" and len(command) >= 2:
        return _cat(pod, command[1:])
    return ExecResult(error=_unsupported(command))


def _unsupported(command: list[str]) -> str:
    return (
        f"error executing command in container: the simulated container runs no shell: {command[0]!r} "
        "is not available (answered: `curl [-s] [-S] [-f] localhost:PORT/PATH` from the pod's engine, "
        f"and `cat` of {', '.join(FILES_SERVED)})"
    )


def _cat(pod: Obj, paths: list[str]) -> ExecResult:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ip, name = status.get("podIP", ""), meta.get("name", "")
    namespace = meta.get("namespace", "")
    contents = {
        "/etc/hostname": f"{name}\n",
        "/etc/hosts": (
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{ip}\t{name}\n"
        ),
        "/etc/resolv.conf": (
            f"search {namespace}.svc.cluster.local svc.cluster.local cluster.local\n"
            "nameserver 10.96.0.10\noptions ndots:5\n"
        ),
        "/var/run/secrets/kubernetes.io/serviceaccount/namespace": namespace,
    }
    out = b""
    for path in paths:
        if path.startswith("-"):
            return ExecResult(error=_unsupported(["cat", *paths]))
        if path not in contents:
            return ExecResult(
                stdout=out,
                error=(
                    f"error executing command in container: the simulated container holds no file {path!r} "
                    f"(answered: {', '.join(FILES_SERVED)})"
                ),
            )
        out += contents[path].encode()
    return ExecResult(stdout=out)


async def _curl(pod: Obj, args: list[str]) -> ExecResult:
    silent = show_error = fail = False
    timeout = CURL_TIMEOUT_S
    urls: list[str] = []
    items = iter(args)
    for arg in items:
        if arg in ("--silent",):
            silent = True
        elif arg in ("--show-error",):
            show_error = True
        elif arg in ("--fail",):
            fail = True
        elif arg in ("-m", "--max-time"):
            try:
                timeout = float(next(items))
            except (StopIteration, ValueError):
                return ExecResult(
                    stderr=b"curl: option --max-time: expected a proper numerical parameter\n", exit_code=2
                )
        elif arg.startswith("-") and not arg.startswith("--") and set(arg[1:]) <= {"s", "S", "f"}:
            silent |= "s" in arg
            show_error |= "S" in arg
            fail |= "f" in arg
        elif arg.startswith("-"):
            return ExecResult(error=_unsupported(["curl", *args]))
        else:
            urls.append(arg)
    if len(urls) != 1:
        return ExecResult(error=_unsupported(["curl", *args]))
    ip = (pod.get("status") or {}).get("podIP", "")
    target = urls[0] if "://" in urls[0] else f"http://{urls[0]}"
    parts = urlsplit(target)
    if parts.scheme != "http" or parts.hostname not in ("localhost", "127.0.0.1", ip):
        return ExecResult(error=_unsupported(["curl", *args]))
    port = parts.port or 80
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    quiet_errors = silent and not show_error
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            answer = await client.get(f"http://{ip}:{port}{path}")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
        elapsed = int((time.monotonic() - started) * 1000)
        message = (
            f"curl: (7) Failed to connect to {parts.hostname} port {port} after {elapsed} ms: "
            "Couldn't connect to server\n"
        )
        return ExecResult(stderr=b"" if quiet_errors else _meter(0) + message.encode(), exit_code=7)
    except httpx.TimeoutException:
        message = (
            f"curl: (28) Operation timed out after {int(timeout * 1000)} milliseconds with 0 bytes received\n"
        )
        return ExecResult(stderr=b"" if quiet_errors else _meter(0) + message.encode(), exit_code=28)
    body = answer.content
    if fail and answer.status_code >= 400:
        message = f"curl: (22) The requested URL returned error: {answer.status_code}\n"
        return ExecResult(stderr=b"" if quiet_errors else _meter(0) + message.encode(), exit_code=22)
    return ExecResult(stdout=body, stderr=b"" if silent else _meter(len(body)))


def _meter(size: int) -> bytes:
    """curl's progress meter, as it writes it to a stderr that is not a terminal."""
    header = (
        "  % Total    % Received % Xferd  Average Speed   Time    Time     Time  Current\n"
        "                                 Dload  Upload   Total   Spent    Left  Speed\n"
    )
    done = 100 if size else 0
    line = (
        f"\r{done:>3} {size:>5}  {done:>3} {size:>5}    0     0      0      0 "
        "--:--:-- --:--:-- --:--:--     0\n"
    )
    return (header + line).encode()


# ------------------------------------------------------------------- the API side
def _target(
    find_pod: Callable[[str, str], Obj | None],
    node_lost: Callable[[str], bool],
    namespace: str,
    name: str,
    container: str | None,
) -> Obj:
    """The checks the apiserver (and the kubelet) make before a stream opens."""
    pod = find_pod(namespace, name)
    if pod is None:
        raise not_found("pods", name)
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if node and node_lost(node):
        # The apiserver cannot reach that node's kubelet: its dial fails, whatever the pod's stale status.
        host = (pod.get("status") or {}).get("hostIP", node)
        raise ApiError(
            500, "InternalError", f"error dialing backend: dial tcp {host}:10250: connect: no route to host"
        )
    names = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    if container and container not in names:
        raise bad_request(f"container {container} is not valid for pod {name}")
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Succeeded", "Failed"):
        raise bad_request(f"cannot exec into a container in a completed pod; current phase is {phase}")
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    wanted = container or (names[0] if names else "")
    running = any(s.get("name") == wanted and "running" in (s.get("state") or {}) for s in statuses)
    if not running:
        raise bad_request(f'unable to upgrade connection: container not found ("{wanted}")')
    return pod


def _frame(stream: int, data: bytes) -> bytes:
    return bytes([stream]) + data


def exec_router(
    authenticate: Callable[[dict[str, str]], object | None],
    find_pod: Callable[[str, str], Obj | None],
    node_lost: Callable[[str], bool],
) -> APIRouter:
    """Routes for ``pods/{name}/exec``: the WebSocket stream, and the plain request's refusal.

    ``authenticate(headers)``: the API server's bearer-token check (None: 401). ``find_pod(ns, name)``;
    ``node_lost(node)``: its kubelet does not answer (the stream cannot open).
    """
    router = APIRouter()
    path = "/api/v1/namespaces/{namespace}/pods/{name}/exec"

    @router.websocket(path)
    async def exec_stream(websocket: WebSocket, namespace: str, name: str) -> None:
        headers = {k.lower(): v for k, v in websocket.headers.items()}
        query = websocket.query_params
        offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        protocol = next((p for p in PROTOCOLS if p in offered), None)
        try:
            if authenticate(headers) is None:
                raise unauthorized()
            pod = _target(find_pod, node_lost, namespace, name, query.get("container"))
            if protocol is None:
                raise bad_request(
                    f"the simulated API server speaks the RemoteCommand subprotocols {', '.join(PROTOCOLS)}; "
                    f"offered: {', '.join(offered) or 'none'}"
                )
        except ApiError as error:
            await websocket.send_denial_response(
                JSONResponse(error.status(), status_code=error.code, headers=error.headers)
            )
            return
        await websocket.accept(subprotocol=protocol)
        command = query.getlist("command")
        result = await run_command(pod, command)
        for stream, data, wanted in (
            (STDOUT, result.stdout, query.get("stdout") in ("true", "1")),
            (STDERR, result.stderr, query.get("stderr") in ("true", "1")),
        ):
            if wanted and data:
                await websocket.send_bytes(_frame(stream, data))
        await websocket.send_bytes(_frame(ERROR, json.dumps(result.status(command)).encode()))
        await websocket.close()

    @router.api_route(path, methods=["GET", "POST"], include_in_schema=False)
    async def exec_plain(request: Request, namespace: str, name: str) -> Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            if authenticate(headers) is None:
                raise unauthorized()
            _target(find_pod, node_lost, namespace, name, request.query_params.get("container"))
            upgrade = headers.get("upgrade", "")
            raise bad_request(
                "Upgrade request required"
                if not upgrade
                else f"the simulated API server streams exec over WebSockets (v5.channel.k8s.io) only, "
                f"not {upgrade}"
            )
        except ApiError as error:
            return JSONResponse(error.status(), status_code=error.code, headers=error.headers)

    return router
