"""A trivial activity that proves the worker → activity path (and its thread pool) works.

``fleetmend demo`` runs it through the smoke workflow until the real incident
procedures are wired in; tests use it to check a real worker end to end.
"""

from __future__ import annotations

import os
import socket
import threading

from pydantic import BaseModel
from temporalio import activity


class SmokeRequest(BaseModel):
    message: str


class SmokeReply(BaseModel):
    echo: str
    worker_host: str
    worker_pid: int
    thread: str
    attempt: int


@activity.defn(name="smoke_probe")
def smoke_probe(request: SmokeRequest) -> SmokeReply:
    """Echo the message with where it ran: the worker's host, process and executor thread.

    Synchronous on purpose: fleetmend's Kubernetes activities are too (the official
    client is sync), so this exercises the same thread-pool executor.
    """
    return SmokeReply(
        echo=request.message,
        worker_host=socket.gethostname(),
        worker_pid=os.getpid(),
        thread=threading.current_thread().name,
        attempt=activity.info().attempt,
    )
