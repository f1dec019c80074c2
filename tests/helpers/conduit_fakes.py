"""Real local HTTP servers for the Conduit and feed-hook tests (and a few tests of them).

:class:`FakeServer` is a ``ThreadingHTTPServer`` on 127.0.0.1 at a random port: it records
every request and answers with whatever the test's responder returns, so clients are
exercised over real sockets (form encoding, timeouts, closed connections), not mocks.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

TOKEN = "api-" + "abcdefghijklmnopqrstuvwx0123"  # the shape of a Phorge API token


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def form(self) -> dict[str, list[str]]:
        return parse_qs(self.body.decode("ascii"), keep_blank_values=True, strict_parsing=True)

    @property
    def params(self) -> Any:
        """The decoded Conduit ``params`` field."""
        return json.loads(self.form["params"][0])


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    cut_after: int | None = None  # close the connection after this many bytes of the body


def conduit_result(result: Any) -> Reply:
    return Reply(
        body=json.dumps({"result": result, "error_code": None, "error_info": None}).encode()
    )


def conduit_error(code: str, info: str) -> Reply:
    return Reply(body=json.dumps({"result": None, "error_code": code, "error_info": info}).encode())


class FakeServer:
    """An HTTP server on a random local port, answering with ``responder(request)``."""

    def __init__(
        self, responder: Callable[[Request], Reply | None] | None = None, port: int = 0
    ) -> None:
        self.requests: list[Request] = []
        self.responder = responder or (lambda request: conduit_result(None))
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(
                    self.command,
                    self.path,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length),
                )
                server.requests.append(request)
                reply = server.responder(request)
                if reply is None:  # hang up unanswered, as a server going down does
                    self.close_connection = True
                    return
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body[: reply.cut_after])
                    if reply.cut_after is not None:
                        self.close_connection = True  # mid-response, as a dying server does
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            do_POST = _serve
            do_GET = _serve

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def execute_answer(**fields: Any) -> dict[str, Any]:
    """A ``worker.execute`` result shaped as the extension's (every key present)."""
    return {
        "result": None,
        "duration": 0,
        "followups": [],
        "yieldDuration": None,
        "retryWait": None,
        "message": None,
        "requiredLease": None,
        "maximumRetryCount": None,
        "warnings": [],
        **fields,
    }
