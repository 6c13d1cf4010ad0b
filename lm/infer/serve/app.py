"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, /health and
/metrics (Prometheus), over one `Backend` that every request shares. With an API key, /v1 answers
only requests that carry it (`Authorization: Bearer KEY`, what OpenAI's clients send); a request
arriving while `max_waiting` requests wait for a slot is refused with 429 and Retry-After.

A backend's Stream is blocking, so each request's Deltas are read by a thread of its own and
handed to the event loop: a request waiting for its turn holds no worker of the loop's pool.
A client that goes away cancels its request (a stream notices when a write fails; a plain
request is polled while it waits). When a stopping server's grace period ends, `Inflight.abort`
ends every running request with an error object (a plain one: 503; a stream: an error event,
then [DONE]) rather than cutting it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import threading
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from lm.errors import UserError
from lm.infer.grammar import grammar_of
from lm.infer.sampling import SamplingParams
from lm.infer.serve.backend import Backend, Delta, Stream
from lm.infer.serve.guard import Guard, shutting_down
from lm.infer.serve.metrics import CONTENT_TYPE, Metrics, Tracker
from lm.infer.serve.protocol import (
    MAX_BODY,
    MAX_WAITING,
    RequestError,
    check_content_type,
    chunk_body,
    completion_body,
    error_body,
    new_id,
    now,
    parse_request,
    usage,
)
from lm.infer.serve.tools import ToolError, ToolPlan, finish_reason, plan

POLL_S = 0.25  # how often a plain request checks that its client is still there
RETRY_AFTER_S = 1
_END, _ABORT = object(), object()


class Inflight:
    """The requests that are generating now (each by its inbox of Deltas). Used on the event loop only."""

    def __init__(self):
        self.inboxes: set[asyncio.Queue] = set()
        self.aborted = False

    def add(self, inbox: asyncio.Queue) -> None:
        self.inboxes.add(inbox)
        if self.aborted:
            inbox.put_nowait(_ABORT)

    def abort(self) -> int:
        """Ends every running request (each after the text it already has); how many there were."""
        self.aborted = True
        for inbox in self.inboxes:
            inbox.put_nowait(_ABORT)
        return len(self.inboxes)


class Aborted(Exception):
    pass


def make_app(
    backend: Backend, max_body: int = MAX_BODY, max_waiting: int = MAX_WAITING, api_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="lm serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.inflight = inflight = Inflight()
    app.state.metrics = metrics = Metrics(backend.load)
    app.add_middleware(Guard, max_body=max_body, stopping=lambda: inflight.aborted)
    started = now()
    limits = Limits(api_key, max_waiting, backend, metrics)

    @app.exception_handler(RequestError)
    async def refused(request, e: RequestError):
        metrics.refused.labels(str(e.status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 429 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):  # unknown paths and methods, in OpenAI's shape
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {e.detail}"), status_code=e.status_code, headers=e.headers
        )  # a 405's Allow

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        limits.authorize(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": backend.model_name,
                    "object": "model",
                    "created": started,
                    "owned_by": "lm",
                    "max_model_len": backend.context,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(backend, inflight, limits, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _answer(backend, inflight, limits, request, "chat")

    return app


class Limits:
    """Who may ask (the API key) and how many may wait; the metrics every answer feeds."""

    def __init__(self, api_key: str | None, max_waiting: int, backend: Backend, metrics: Metrics):
        self.api_key, self.max_waiting, self.backend, self.metrics = api_key, max_waiting, backend, metrics

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), self.api_key.encode()):
            said = "no API key was given" if not given else "the API key is not this server's"
            raise RequestError(
                f"{said}: send 'Authorization: Bearer <key>' with the key `lm serve --api-key` was started with",
                status=401,
                code="invalid_api_key",
            )

    def admit(self) -> None:
        waiting = self.backend.load().waiting
        if waiting >= self.max_waiting:
            raise RequestError(
                f"{waiting} requests are waiting for a slot (at most {self.max_waiting}, --max-waiting); "
                f"retry in {RETRY_AFTER_S} s",
                status=429,
                code="rate_limit_exceeded",
                kind="requests",
            )


def _submit(backend: Backend, req) -> tuple[Stream, ToolPlan | None]:
    """The request's Stream, after the checks that need the tokenizer (prompt, context), and how
    its tools are served (None: it has none)."""
    if req.model != backend.model_name:
        raise RequestError(
            f"model '{req.model}' does not exist; this server serves '{backend.model_name}'",
            "model",
            status=404,
            code="model_not_found",
        )
    try:
        tools = plan(req.tools, getattr(backend, "tool_syntax", None), req.schema) if req.tools else None
    except ToolError as e:
        raise RequestError(str(e), e.param) from None
    param = "prompt" if req.kind == "completion" else "messages"
    try:
        rendered = {"tools": tools.tools} if tools else {}
        ids, template_stop = backend.prompt_ids(prompt=req.prompt, messages=req.messages, **rendered)
    except (ValueError, UserError) as e:
        raise RequestError(f"'{param}': {e}", param) from None
    if not ids:
        raise RequestError(f"'{param}' has no tokens", param)
    room = backend.context - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(ids)} tokens and the model's context is {backend.context} "
            "positions: no room for a new token; shorten it",
            param,
            code="context_length_exceeded",
        )
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise RequestError(
            f"the prompt's {len(ids)} tokens + max_tokens={max_tokens} exceed the model's context "
            f"of {backend.context}; at most {room} new tokens fit",
            "max_tokens",
            code="context_length_exceeded",
        )
    try:
        sampling = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            seed=_seed(req.seed),
        )
    except UserError as e:
        raise RequestError(str(e)) from None
    try:
        grammar = grammar_of(req.schema) if req.schema is not None else tools.grammar if tools else None
    except UserError as e:
        raise RequestError(str(e), "response_format") from None
    kept = {"keep": tools.keep} if tools and tools.keep else {}
    try:
        return backend.submit(ids, sampling, req.stop + tuple(template_stop), grammar, **kept), tools
    except UserError as e:  # the backend takes no more requests
        raise RequestError(str(e), status=503, code="unavailable", kind="server_error") from None


def _seed(seed: int | None) -> int:
    """A request without a seed samples differently from the last one (as OpenAI's does)."""
    return secrets.randbits(31) if seed is None else seed % 2**32


async def _answer(backend: Backend, inflight: Inflight, limits: Limits, request: Request, kind: str):
    arrived = time.perf_counter()
    limits.authorize(request)
    check_content_type(request.headers.get("content-type"))
    req = parse_request(await request.body(), kind)
    limits.admit()
    stream, tools = _submit(backend, req)
    tracker = Tracker(limits.metrics, stream.prompt_tokens, arrived)
    rid, created = new_id(kind), now()
    if req.stream:
        events = _events(stream, inflight, tracker, req, rid, created, backend.model_name, tools)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    texts, tokens, finish = [], 0, None
    watcher = asyncio.create_task(_cancel_when_gone(request, stream))
    try:
        async for delta in _deltas(stream, inflight, tracker):
            texts.append(delta.text)
            tokens += len(delta.token_ids)
            finish = delta.finish_reason
    except Aborted:
        raise shutting_down() from None
    except UserError as e:
        raise RequestError(str(e)) from None
    except Exception as e:  # noqa: BLE001 (the backend failed: say so, keep serving)
        return JSONResponse(error_body(f"generation failed: {e}", kind="server_error"), status_code=500)
    finally:
        watcher.cancel()
    if finish == "cancelled" and await request.is_disconnected():  # nobody reads this
        return JSONResponse(error_body("the client disconnected"), status_code=499)
    text, calls = "".join(texts), None
    if tools is not None and (answer := tools.answer()) is not None:
        text, calls = answer.whole(text)
    used = usage(stream.prompt_tokens, tokens)
    return completion_body(kind, rid, created, backend.model_name, text, finish_reason(finish, calls), used, calls)


async def _events(
    stream: Stream, inflight: Inflight, tracker: Tracker, req, rid: str, created: int, model: str, tools=None
) -> AsyncIterator[str]:
    """Server-sent events: (chat: the assistant role first) a chunk per piece of text, (with tools)
    one with the tool calls, one with the finish reason, the usage chunk if asked for, then [DONE].
    An aborted stream ends with the error event and [DONE]: OpenAI's SDKs raise on it, so a cut
    text never passes for a whole one."""
    tokens, answer = 0, tools.answer() if tools is not None else None
    chunk = functools.partial(chunk_body, req.kind, rid, created, model, include_usage=req.include_usage)
    try:
        if req.kind == "chat":
            yield _event(chunk("", None, role=True))
        async for delta in _deltas(stream, inflight, tracker):
            tokens += len(delta.token_ids)
            if text := answer.add(delta.text) if answer is not None else delta.text:
                yield _event(chunk(text, None))
            if delta.finish_reason is not None:
                rest, calls = answer.end() if answer is not None else ("", None)
                if rest and not (calls and rest.isspace()):
                    yield _event(chunk(rest, None))
                if calls:
                    yield _event(chunk("", None, tool_calls=calls))
                yield _event(chunk("", finish_reason(delta.finish_reason, calls)))
        if req.include_usage:
            yield _event(chunk(None, None) | {"usage": usage(stream.prompt_tokens, tokens)})
    except Aborted:
        yield _event(shutting_down().body())
    except Exception as e:  # noqa: BLE001 (reported in the stream: its headers are already sent)
        kind = "invalid_request_error" if isinstance(e, UserError) else "server_error"
        yield _event(error_body(f"generation failed: {e}", kind=kind))
    yield "data: [DONE]\n\n"


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _cancel_when_gone(request: Request, stream: Stream) -> None:
    """Cancels the stream of a plain request whose client disconnects while it waits."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_S)
    stream.cancel()


async def _deltas(stream: Stream, inflight: Inflight, tracker: Tracker) -> AsyncIterator[Delta]:
    """The Stream's Deltas, read by a thread and timed by `tracker`; the Stream is cancelled if the
    reader stops early (a stream's client went away, or the server is stopping: Aborted)."""
    loop = asyncio.get_running_loop()
    inbox: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(inbox.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server has stopped
            stream.cancel()

    def pump() -> None:
        try:
            for delta in stream:
                put(delta)
        except BaseException as e:  # noqa: BLE001 (re-raised in the reader)
            put(e)
        put(_END)

    threading.Thread(target=pump, name="lm-serve-reader", daemon=True).start()
    finished = False
    inflight.add(inbox)
    try:
        while (item := await inbox.get()) is not _END:
            if item is _ABORT:
                tracker.end("aborted")
                raise Aborted
            if isinstance(item, BaseException):
                finished = True
                tracker.end("error")
                raise item
            tracker.delta(item.token_ids, item.finish_reason)
            yield item
        finished = True
    finally:
        inflight.inboxes.discard(inbox)
        if not finished:
            tracker.end("cancelled")
            stream.cancel()
