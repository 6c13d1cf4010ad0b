"""Running the app under uvicorn: on a socket bound beforehand (so port 0 works and the URL is
known before serving), stopped gracefully by SIGTERM/SIGINT in the main thread or by `stop()`.

A stop closes the listening socket, lets running requests finish for `grace` seconds, then
cancels what is left (each cancelled request cancels its Stream). A second SIGINT stops at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

import uvicorn

SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


class Server(uvicorn.Server):
    """uvicorn's server whose signal handling ends with a return (exit 0), not by re-raising the
    signal; `stopped_by` names the signal that stopped it."""

    stopped_by: str | None = None

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
    """uvicorn leaves the process's logging set-up alone (its own replaces every handler, a test
    runner's too): its warnings reach stderr through logging's last-resort handler, and the access
    log, when asked for, through a handler of its own."""
    if access_log:
        log = logging.getLogger("uvicorn.access")
        if not log.handlers:
            log.addHandler(logging.StreamHandler())
    config = uvicorn.Config(app, lifespan="off", log_level="info" if access_log else "warning",
                            access_log=access_log, timeout_graceful_shutdown=grace, ws="none", log_config=None)
    return Server(config)


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
