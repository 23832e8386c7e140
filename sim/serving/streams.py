"""One request's tokens, from the engine to an OpenAI-style response.

``TokenStream`` is the sink an engine writes one request's progress into
(``sim.serving.engine.TokenSink``); ``events`` yields its progress as ``StreamEvent``s.
``sse_chunks`` renders events as vLLM's ``/v1/completions`` SSE stream (``data: {...}``
chunks ending ``data: [DONE]``), ``completion_body`` as its non-streamed answer.
Every engine's own HTTP server (``sim.serving.pods``) answers with these.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from sim.clock import SimClock
from sim.serving.engine import Engine, EngineRequest


@dataclass
class StreamEvent:
    kind: Literal["tokens", "done", "error"]
    count: int = 0
    finish_reason: str | None = None
    message: str = ""
    cause: Literal["aborted", "stalled", ""] = ""


class TokenStream:
    """The reader's side of one engine request: the sink the engine writes into."""

    def __init__(self) -> None:
        self.pending_tokens = 0
        self.total_tokens = 0
        self.first_token_at: float | None = None
        self.finished: str | None = None
        self.aborted: str | None = None
        self.last_event_at = 0.0
        self.wakeup = asyncio.Event()

    # ---- TokenSink --------------------------------------------------------------------
    def on_tokens(self, count: int, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        self.pending_tokens += count
        self.total_tokens += count
        self.last_event_at = now
        self.wakeup.set()

    def on_finished(self, reason: str, now: float) -> None:
        self.finished = reason
        self.last_event_at = now
        self.wakeup.set()

    def on_aborted(self, reason: str, now: float) -> None:
        self.aborted = reason
        self.last_event_at = now
        self.wakeup.set()

    # ---- reading ----------------------------------------------------------------------
    def take_pending(self) -> int:
        count, self.pending_tokens = self.pending_tokens, 0
        return count

    async def events(
        self,
        clock: SimClock,
        engine: Engine,
        ereq: EngineRequest,
        idle_timeout_s: float | None = None,
        interval_s: float = 0.0,
    ) -> AsyncIterator[StreamEvent]:
        """Tokens as the engine produces them, then ``done`` or one ``error`` (engine aborted, or no
        token for ``idle_timeout_s`` sim seconds). A reader that stops early cancels the engine request.

        ``interval_s`` (sim seconds) coalesces tokens: after a chunk, the next one waits until that
        much time has passed, carrying every token made meanwhile. The first token, the end and an
        error are never held back, so TTFT, end-to-end time and a cut stream read the same.
        """
        ended = False
        hold_until = 0.0  # wall (loop) time before which tokens are held for the next chunk
        loop = asyncio.get_running_loop()
        try:
            while True:
                ending = self.finished is not None or self.aborted is not None
                if self.pending_tokens and (ending or loop.time() >= hold_until):
                    yield StreamEvent("tokens", count=self.take_pending())
                    if interval_s > 0:
                        hold_until = loop.time() + clock.real_seconds(interval_s)
                    continue
                if self.finished is not None:
                    ended = True
                    yield StreamEvent("done", finish_reason=self.finished)
                    return
                if self.aborted is not None:
                    ended = True
                    yield StreamEvent("error", message=self.aborted, cause="aborted")
                    return
                self.wakeup.clear()
                timeout = None if idle_timeout_s is None else max(clock.real_seconds(idle_timeout_s), 0.001)
                if self.pending_tokens:  # held: wake at the end of the interval, or when the stream ends
                    held = max(0.001, hold_until - loop.time())
                    timeout = held if timeout is None else min(timeout, held)
                try:
                    await asyncio.wait_for(self.wakeup.wait(), timeout=timeout)
                except TimeoutError:
                    if self.pending_tokens:
                        continue  # the interval is over: send what was held
                    engine.cancel(ereq, clock.now())
                    ended = True
                    yield StreamEvent(
                        "error",
                        message=f"no token for {idle_timeout_s:g}s after {self.total_tokens} token(s)",
                        cause="stalled",
                    )
                    return
        finally:
            if not ended:
                engine.cancel(ereq, clock.now())


# ---- the OpenAI /v1/completions wire format ------------------------------------------------
def sse(payload: Any) -> bytes:
    return b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n"


TOKEN_TEXT = " tok"


def error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` shape (``{"error": {...}}``)."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


async def sse_chunks(
    request_id: str,
    model: str,
    events: AsyncIterator[StreamEvent],
    first_tokens: int = 0,
    on_error: Callable[[StreamEvent], bytes | None] | None = None,
) -> AsyncIterator[bytes]:
    """``text_completion`` chunks for ``events``; ``[DONE]`` after the finish chunk.

    An error event becomes what ``on_error`` returns (``None``: end the stream with nothing
    more); by default a ``terminal_stream_error`` chunk with no ``[DONE]``.
    """
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}

    def chunk(text: str, finish: str | None) -> bytes:
        return sse(
            {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        )

    try:
        if first_tokens:
            yield chunk(TOKEN_TEXT * first_tokens, None)
        async for event in events:
            if event.kind == "tokens":
                yield chunk(TOKEN_TEXT * event.count, None)
            elif event.kind == "done":
                yield chunk("", event.finish_reason)
                yield sse(b"[DONE]")
            else:
                tail = (
                    on_error(event)
                    if on_error is not None
                    else sse(error_body(502, "terminal_stream_error", event.message))
                )
                if tail:
                    yield tail
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def collect(
    events: AsyncIterator[StreamEvent], first_tokens: int = 0
) -> tuple[int, str | None, StreamEvent | None]:
    """(tokens, finish_reason, error event or None) once the stream ended."""
    tokens = first_tokens
    finish: str | None = None
    try:
        async for event in events:
            if event.kind == "tokens":
                tokens += event.count
            elif event.kind == "done":
                finish = event.finish_reason
            else:
                return tokens, None, event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return tokens, finish, None


def completion_body(
    request_id: str, model: str, tokens: int, finish: str | None, prompt_tokens: int | None = None
) -> dict[str, Any]:
    usage: dict[str, int] = {"completion_tokens": tokens}
    if prompt_tokens is not None:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens,
        }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": TOKEN_TEXT * tokens, "logprobs": None, "finish_reason": finish}],
        "usage": usage,
    }
