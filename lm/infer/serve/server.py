"""Running the app under uvicorn: on a socket bound beforehand (so port 0 works and the URL is
known before serving), stopped gracefully by SIGTERM/SIGINT in the main thread or by `stop()`.

A stop closes the listening socket, lets running requests finish for `grace` seconds, then
aborts what is left: each aborted request cancels its Stream and ends with an error object (the
app's `Inflight.abort`), and the log gets one line. A request that has not ended `LAST_WORDS_S`
later (a client that reads nothing) is cancelled by uvicorn. A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lm.infer.serve.protocol import error_body

SIGNALS = (signal.SIGINT, signal.SIGTERM)
LAST_WORDS_S = 5.0  # after the grace: for aborted requests to send their error objects
log = logging.getLogger("lm.serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from lm.errors import UserError

        raise UserError(f"--host {host} --port {port}: cannot listen there ({e.strerror})") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class JsonH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol whose answer to a request it cannot parse (bad request line,
    headers too long, ...) is an OpenAI error object, not plain text."""

    def send_400_response(self, msg: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # a response is under way: only closing is left
            self.transport.close()
            return
        body = json.dumps(error_body(f"malformed HTTP request ({msg.rstrip('.')})", code="bad_http")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class Server(uvicorn.Server):
    """uvicorn's server whose signal handling ends with a return (exit 0), not by re-raising the
    signal, and whose stop aborts running requests when the grace period ends (`abort()` ends
    them and says how many); `stopped_by` names the signal that stopped it."""

    stopped_by: str | None = None

    def __init__(self, config: uvicorn.Config, grace: float, abort):
        super().__init__(config)
        self.grace, self.abort = grace, abort

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _grace_over(self) -> None:
        n = self.abort()
        if n:  # (grace 0 with nothing running: nothing to say)
            log.warning("lm serve: grace period over, %d request%s aborted", n, "" if n == 1 else "s")

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def handle_exit(self, sig, frame) -> None:
        self.stopped_by = self.stopped_by or signal.Signals(sig).name
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        self.should_exit = True


def make_server(app, grace: float, access_log: bool = False) -> Server:
    """`app`: make_app's. uvicorn leaves the process's logging set-up alone (its own replaces every
    handler, a test runner's too): its warnings and ours reach stderr through logging's last-resort
    handler, and the access log, when asked for, through a handler of its own."""
    if access_log:
        log = logging.getLogger("uvicorn.access")
        if not log.handlers:
            log.addHandler(logging.StreamHandler())
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="info" if access_log else "warning",
        http=JsonH11,
        access_log=access_log,
        timeout_graceful_shutdown=grace + LAST_WORDS_S,
        ws="none",
        log_config=None,
    )
    return Server(config, grace, app.state.inflight.abort)


class InThread:
    """The app served from a thread of this process on 127.0.0.1 (tests and benchmarks)."""

    def __init__(self, app, grace: float = 5.0, port: int = 0):
        self.sock = bind("127.0.0.1", port)
        self.url = url_of(self.sock)
        self.server = make_server(app, grace)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
