"""An engine running on its own thread, for a server: requests arrive from any thread and join the
running batch at the engine's next iteration."""

from __future__ import annotations

import queue
import threading

from lm.errors import UserError
from lm.infer.engine.engine import Engine, Request


class EngineService:
    """Owns the engine; `submit` checks a request (a UserError goes back to the caller at once)
    and queues it; the loop thread adds queued requests and steps while there is work."""

    def __init__(self, engine: Engine, params):
        self.engine, self.params = engine, engine.prepare(params)
        self.error: BaseException | None = None
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._wake = threading.Event()
        self._closing = self._cancel = False
        self._thread = threading.Thread(target=self._loop, name="lm-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> Request:
        if self._closing:
            raise UserError("the server is shutting down; no new requests")
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error}")
        self.engine.check(request.prompt, request.sampling)
        self._inbox.put(request)
        self._wake.set()
        return request

    @property
    def waiting(self) -> int:
        """Requests submitted that have no slot yet (read from any thread: a moment's count)."""
        return self._inbox.qsize() + len(self.engine.waiting)

    def _loop(self) -> None:
        try:
            while True:
                while not self._inbox.empty():
                    self.engine.add(self._inbox.get())
                if self._cancel:
                    self._cancel_all()
                if not self.engine.busy:
                    if self._closing and self._inbox.empty():
                        return
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self.engine.step(self.params)
        except BaseException as e:  # noqa: BLE001 - every waiting client must hear of it
            self.error = e
            self._cancel_all()
            raise

    def _cancel_all(self) -> None:
        for r in list(self.engine.waiting) + [r for r in self.engine.running if r is not None]:
            r.cancelled = True
        while not self._inbox.empty():
            r = self._inbox.get()
            r.cancelled = True
            self.engine.add(r)
        if self.error is not None:  # the loop is gone: end them here
            for r in list(self.engine.waiting) + [r for r in self.engine.running if r is not None]:
                self.engine._finish(r, "cancelled")

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Takes no new requests; lets the running ones finish (or cancels them), then stops."""
        self._closing = True
        self._cancel = self._cancel or cancel
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():  # past the grace period: cancel what is left
            self._cancel = True
            self._wake.set()
            self._thread.join()
