"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1, for testing the LLM policy over real HTTP.

Each POST /v1/chat/completions takes the next behaviour from a queue (the default one when it is empty) and
records the request (headers, JSON body, start and end times), so tests can check prompts, headers,
retries and concurrency.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOFTMAX = ROOT / "examples" / "candidates" / "softmax"


@dataclass(frozen=True)
class Reply:
    """A chat.completion: text content and/or tool calls, after an optional delay."""

    content: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    prompt_tokens: int = 1000
    completion_tokens: int = 500
    finish_reason: str | None = None
    delay_s: float = 0.0
    usage: bool = True


@dataclass(frozen=True)
class Status:
    """An HTTP error with an OpenAI-style error body."""

    code: int
    message: str = "error"
    retry_after: str | None = None
    delay_s: float = 0.0


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    started: float
    finished: float = 0.0

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages", [])

    def text(self) -> str:
        """Every message's content, joined: what a prompt assertion searches."""
        return "\n".join(str(m.get("content") or "") for m in self.messages)


def good_content(label: str = "vectorized row softmax", prose: str = "Rows stay in registers.") -> str:
    src = (SOFTMAX / "kernel.cu").read_text()
    launcher = (SOFTMAX / "launcher.py").read_text()
    return f"EDIT: {label}\n{prose}\n\n```cuda\n{src}```\n\n```python\n{launcher}```\n"


def good(**kw: Any) -> Reply:
    return Reply(content=good_content(), **kw)


def malformed() -> Reply:
    return Reply(content="I would start by using shared memory, then vectorise the loads.")


def tool_call(name: str, arguments: dict[str, Any] | str, call_id: str = "call_1") -> Reply:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return Reply(content=None, tool_calls=(call,), finish_reason="tool_calls")


@dataclass
class LoopbackLLM:
    default: Reply | Status = field(default_factory=good)
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._queue: list[Reply | Status] = []
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                server._handle(self)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def script(self, *behaviours: Reply | Status) -> LoopbackLLM:
        with self._lock:
            self._queue.extend(behaviours)
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> LoopbackLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- serving ----------------------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            body = {"_raw": raw.decode(errors="replace")}
        rec = Recorded(h.path, {k.lower(): v for k, v in h.headers.items()}, body, time.monotonic())
        with self._lock:
            self.requests.append(rec)
            behaviour = self._queue.pop(0) if self._queue else self.default
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if h.path.rstrip("/") != "/v1/chat/completions":
                self._send(h, 404, {"error": {"message": f"no route {h.path}", "type": "not_found"}})
                return
            time.sleep(behaviour.delay_s)
            if isinstance(behaviour, Status):
                headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after is not None else {}
                err = {"error": {"message": behaviour.message, "type": "error", "code": behaviour.code}}
                self._send(h, behaviour.code, err, headers)
            else:
                self._send(h, 200, self._completion(behaviour, body))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout test)
        finally:
            rec.finished = time.monotonic()
            with self._lock:
                self.in_flight -= 1

    @staticmethod
    def _completion(r: Reply, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": r.content}
        if r.tool_calls:
            message["tool_calls"] = list(r.tool_calls)
        out: dict[str, Any] = {
            "id": "chatcmpl-loopback",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "loopback"),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": r.finish_reason or ("tool_calls" if r.tool_calls else "stop"),
                }
            ],
        }
        if r.usage:
            out["usage"] = {
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "total_tokens": r.prompt_tokens + r.completion_tokens,
            }
        return out

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, code: int, payload: dict, headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(payload).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(data)
