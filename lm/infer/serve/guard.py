"""The app's outer layer: bodies over the size limit are refused (413) before they are read, and
whatever escapes the app still gets an OpenAI error object, never a plain-text 500.

It sits inside Starlette's ServerErrorMiddleware, which would otherwise answer an exception with
"Internal Server Error" in plain text and hand a traceback to the server's log.
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.requests import ClientDisconnect

from lm.infer.serve.protocol import RequestError, error_body

log = logging.getLogger("lm.serve")


class TooLarge(RequestError):
    def __init__(self, limit: int, size: int | None = None):
        said = f"has {size} bytes" if size is not None else "is longer"
        super().__init__(
            f"the request body {said}; this server takes at most {limit} bytes", status=413, code="request_too_large"
        )


def shutting_down() -> RequestError:
    # 503, not a 200 with a partial text: OpenAI's SDKs retry a 503 (another replica may answer)
    # and raise when retries run out, where a cut text with an unknown finish_reason would pass
    # for a whole answer
    return RequestError(
        "the server is shutting down and its grace period ran out before this request finished; retry it",
        status=503,
        code="server_shutting_down",
        kind="server_error",
    )


class Guard:
    """ASGI middleware. `stopping()`: whether the server's grace period is over (then a request
    cancelled by the server's last resort ends with a 503 instead of a traceback)."""

    def __init__(self, app, max_body: int, stopping=lambda: False):
        self.app, self.max_body, self.stopping = app, max_body, stopping

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            declared = _content_length(scope)
            if declared is not None and declared > self.max_body:
                raise TooLarge(self.max_body, declared)
            await self.app(scope, self._limited(receive), sending)
        except RequestError as e:  # raised outside the app's handlers (a body over the limit)
            if not started:
                await _send_json(send, e.status, e.body())
        except ClientDisconnect:  # it left while sending its body: nobody to answer
            pass
        except Exception as e:  # noqa: BLE001 (a bug: its traceback goes to the log once, the client gets JSON)
            log.error("lm serve: %s %s failed", scope.get("method"), scope.get("path"), exc_info=e)
            if not started:
                await _send_json(send, 500, error_body(f"internal error: {type(e).__name__}: {e}", kind="server_error"))
        except asyncio.CancelledError:
            if not self.stopping():
                raise
            if not started:  # a stream already begun is closed by the server
                await _send_json(send, 503, shutting_down().body())

    def _limited(self, receive):
        """`receive` that raises TooLarge once the body read so far is over the limit (a body
        sent without a Content-Length)."""
        total = 0

        async def receiving():
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body:
                    raise TooLarge(self.max_body)
            return message

        return receiving


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
