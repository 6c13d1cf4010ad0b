"""A local reward endpoint for tests: a threaded http.server on 127.0.0.1, port 0.

Each POST is recorded (its JSON body); `script` is a list of replies used in order (the last one
repeats): a status, a body (bytes, or a callable of the request's JSON giving a JSON value) and
a hang (the handler waits until the server closes: a timeout on the client's side), and headers
to send; each request's headers are kept too."""

from __future__ import annotations

import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable


@dataclasses.dataclass
class Reply:
    status: int = 200
    body: bytes | Callable[[dict], Any] = b'{"rewards": []}'
    hang: bool = False
    headers: dict = dataclasses.field(default_factory=dict)  # sent with the reply


def digit_share(batch: dict) -> dict:
    return {"rewards": [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in batch["completions"]]}


class RewardServer:
    def __init__(self, *script: Reply):
        self.script, self.requests = list(script) or [Reply(body=digit_share)], []
        self.headers: list[dict] = []  # each request's headers
        self.release, self.lock = threading.Event(), threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append(batch)
                    server.headers.append(dict(self.headers))
                    reply = server.script[min(len(server.requests), len(server.script)) - 1]
                if reply.hang:
                    server.release.wait(120)
                    return
                body = reply.body if isinstance(reply.body, bytes) else json.dumps(reply.body(batch)).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda request, address: None  # a client that gave up: nothing to say
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RewardServer:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
