"""`lm serve`: a run, an export or a Hugging Face directory behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import os
import sys

from lm.errors import UserError
from lm.infer.serve.protocol import MAX_BODY, MAX_WAITING
from lm.verb import add_kv_cache, add_model_source

GRACE_S = 30.0  # after SIGTERM/SIGINT: how long running requests may take before they are aborted


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve `lm train`'s newest checkpoint (--workdir), an `lm export` or a Hugging Face model "
        "directory (--params) at /v1/completions, /v1/chat/completions, /v1/models and /health. "
        "SIGTERM or Ctrl-C stops taking requests, lets running ones finish (--grace) and exits 0.",
    )
    add_model_source(p)
    p.add_argument("--tokenizer", help="a tokenizer to use instead of the model's own")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: a free one)")
    p.add_argument("--model-name", help="the name clients give as `model` (default: the --workdir/--params path)")
    p.add_argument("--quantize", choices=("none", "int8", "int4"), default="none", help="weight quantization")
    p.add_argument("--slots", type=int, default=16, help="requests decoded together")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV-cache page")
    add_kv_cache(p)
    p.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="draft K tokens per request and step (by prompt lookup, or by --draft's model) and verify them "
        "in one pass (0: off; with --draft: 4); greedy answers are unchanged, sampled ones keep their distribution",
    )
    p.add_argument(
        "--draft",
        metavar="WORKDIR|EXPORT",
        help="speculate with drafts from this smaller model with the same tokenizer (an `lm train` workdir, "
        "an `lm export` or a Hugging Face directory) instead of prompt lookup",
    )
    p.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="prefill every prompt whole (by default full pages of prompts seen before are reused)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        help="positions a prompt and its new tokens may take (default: the model's context, at most 4096)",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=GRACE_S,
        help="seconds running requests may take after a stop; "
        "then each ends with a 503 error (a stream: an error "
        "event and [DONE])",
    )
    p.add_argument(
        "--max-body-mib", type=float, default=MAX_BODY / 2**20, help="largest request body taken, in MiB (larger: 413)"
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LM_API_KEY"),
        help="answer /v1 only with 'Authorization: Bearer KEY' (default: $LM_API_KEY; unset: anyone)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=MAX_WAITING,
        help="requests that may wait for a slot; more get 429 with Retry-After",
    )


def _check_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UserError(
            f"lm serve needs {e.name or 'fastapi and uvicorn'}, which is not installed: pip install 'lm[serve]'"
        ) from None


def _check_flags(args) -> None:
    for name in ("slots", "page_size", "max_model_len", "max_waiting"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} {value}: expected at least 1")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 0 to 65535")
    if args.grace < 0:
        raise UserError(f"--grace {args.grace}: expected seconds >= 0")
    if not args.max_body_mib > 0:
        raise UserError(f"--max-body-mib {args.max_body_mib:g}: expected a size > 0")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key (or $LM_API_KEY) is empty: give a key, or unset it to serve without one")


def run(args, overrides=()) -> int:
    _check_flags(args)
    _check_extra()
    from lm.infer.serve.app import make_app
    from lm.infer.serve.engine_backend import make_backend
    from lm.infer.serve.server import bind, make_server, url_of
    from lm.store.load import load_trained

    args.model_name = args.model_name or (args.workdir or args.params).rstrip("/")
    sock = bind(args.host, args.port)  # before loading: a taken port fails at once
    try:
        backend = make_backend(load_trained(args.workdir, args.params, args.tokenizer), args)
        app = make_app(
            backend, max_body=int(args.max_body_mib * 2**20), max_waiting=args.max_waiting, api_key=args.api_key
        )
        server = make_server(app, args.grace, args.access_log)
        print(f"lm serve: {args.model_name} at {url_of(sock)}/v1 (context {backend.context} positions)", flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            backend.shutdown(cancel=True)
    finally:
        sock.close()
    if server.stopped_by:
        print(f"lm serve: stopped by {server.stopped_by}", file=sys.stderr)
    return 0
