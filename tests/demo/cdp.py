"""Drive headless Chromium over the Chrome DevTools Protocol with a small stdlib websocket client.

The Temporal UI is a single-page app that fetches as it renders (workers,
current details via a query): a test has to wait, in real time, until the text
it looks for is on the page. ``--dump-dom`` with a virtual time budget does not
wait for those fetches, so this opens a page, polls ``document.body.innerText``
and takes screenshots through CDP. No Playwright, no browser download.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

CHROMIUM = Path("/usr/bin/chromium")
# The flags the machine notes require (no sandbox as root, no background connections to a closed network).
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1600,1300",
]


class WebSocket:
    """Just enough RFC 6455 for CDP: masked text frames out, (fragmented) text frames in."""

    def __init__(self, url: str, timeout_s: float = 30) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError("websocket handshake: connection closed")
            head += chunk
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake refused: {head[:200]!r}")

    def send(self, text: str) -> None:
        payload = text.encode()
        header = bytearray([0x81])
        n = len(payload)
        if n < 126:
            header.append(0x80 | n)
        elif n < 1 << 16:
            header.append(0x80 | 126)
            header += struct.pack("!H", n)
        else:
            header.append(0x80 | 127)
            header += struct.pack("!Q", n)
        mask = os.urandom(4)
        self.sock.sendall(bytes(header) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("websocket closed")
            buf += chunk
        return bytes(buf)

    def recv(self) -> str:
        message = bytearray()
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._exact(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._exact(8))
            payload = self._exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("websocket closed by the browser")
            if opcode in (0x1, 0x2, 0x0):
                message += payload
                if b0 & 0x80:
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


class Page:
    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        """Visible text, including same-origin iframes (the UI renders Markdown in ``/render`` iframes)."""
        script = """(() => {
            let text = document.body ? document.body.innerText : '';
            for (const frame of document.querySelectorAll('iframe')) {
                try { text += '\\n[' + frame.id + '] ' + (frame.contentDocument?.body?.innerText || ''); }
                catch (e) {}
            }
            return text;
        })()"""
        result = self.call("Runtime.evaluate", expression=script)
        return str(result.get("result", {}).get("value", ""))

    def wait_for_text(self, *needles: str, timeout_s: float = 30) -> str:
        """The page's visible text (whitespace collapsed) once every needle is on it, else an AssertionError."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = " ".join(self.text().split())  # layout whitespace is not what a reader sees
            if all(n in text for n in needles):
                return text
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"{missing} not on the page after {timeout_s} s; page text:\n{text[-3000:]}")

    def click_text(self, label: str) -> None:
        """Click the first link or button whose text is ``label``."""
        script = (
            "(() => { const el = [...document.querySelectorAll('a,button')]"
            f".find(e => e.innerText.trim() === {json.dumps(label)}); if (el) {{ el.click(); return true; }}"
            " return false; })()"
        )
        assert self.call("Runtime.evaluate", expression=script)["result"]["value"], f"no {label!r} to click"

    def screenshot(self, target: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        target.write_bytes(base64.b64decode(data))
        return target


@contextmanager
def browser(timeout_s: float = 30) -> Iterator[Page]:
    """Headless Chromium with one page, over CDP; stopped on exit."""
    # Chromium's helpers (crashpad, zygote) can still be writing to the profile a moment after the
    # browser exits: its own session is stopped as a whole, and a leftover file is not a failure.
    with tempfile.TemporaryDirectory(prefix="fleetmend-chromium-", ignore_cleanup_errors=True) as profile:
        proc = subprocess.Popen(
            [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            port = _devtools_port(proc, Path(profile), timeout_s)
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            page_url = next(t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page")
            ws = WebSocket(page_url)
            try:
                page = Page(ws)
                page.call("Page.enable")
                yield page
            finally:
                ws.close()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _devtools_port(proc: subprocess.Popen[str], profile: Path, timeout_s: float) -> int:
    # Chromium writes the port it chose to DevToolsActivePort in the profile directory.
    deadline = time.monotonic() + timeout_s
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited: {proc.stderr.read() if proc.stderr else ''}"[-2000:])
        if marker.exists():
            first = marker.read_text().splitlines()
            if first and re.fullmatch(r"\d+", first[0]):
                return int(first[0])
        time.sleep(0.1)
    raise RuntimeError("chromium did not open its DevTools port")
