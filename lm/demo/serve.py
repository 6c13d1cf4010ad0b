"""`lm demo`'s serving stage: the GRPO model behind `lm serve`'s OpenAI API answering held-out prompts
from concurrent clients, its answers quantized to int8 and int4, and speculative decoding with the
distilled student as the draft."""

from __future__ import annotations

import concurrent.futures
import pathlib
import time

import numpy as np

from lm.data.chat import chat_prompts
from lm.eval.answers import exact_match, read_conversations
from lm.infer.engine.engine import EngineConfig
from lm.infer.sampling import SamplingParams
from lm.infer.session import Session
from lm.model.quant import weight_bytes
from lm.store.load import load_trained

MAX_NEW = 16  # the sort task's answers are a few tokens


def serving(root: pathlib.Path, heldout: pathlib.Path, clients: int = 16, n_served: int = 64, n_spec: int = 16) -> dict:
    conversations = read_conversations(heldout)
    loaded = load_trained(str(root / "grpo"))
    out = {"served": _served(loaded, conversations[:n_served], clients)}
    out["quantized"] = _quantized(loaded, conversations)
    out["speculative"] = _speculative(loaded, load_trained(str(root / "distilled")), conversations[:n_spec])
    return out


def _served(loaded, conversations: list, clients: int) -> dict:
    """Chat requests from `clients` threads through the OpenAI client; their answers against the
    engine's offline greedy answers (what `lm eval` scores)."""
    from openai import OpenAI

    from lm.infer.serve.app import make_app
    from lm.infer.serve.engine_backend import EngineBackend
    from lm.infer.serve.server import InThread

    session = Session(loaded)
    offline = exact_match(
        session.built.module,
        session.params,
        loaded.tokenizer,
        conversations,
        max_new_tokens=MAX_NEW,
        mesh=session.built.mesh,
        rules=session.built.rules,
        keep=len(conversations),
    )
    backend = EngineBackend(session, "grpo", config=EngineConfig(slots=clients, idle_block=16))
    with InThread(make_app(backend)) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def ask(messages):
            t0 = time.perf_counter()
            reply = client.chat.completions.create(
                model="grpo", messages=messages[:-1], temperature=0, max_tokens=MAX_NEW
            )
            return reply.choices[0].message.content, time.perf_counter() - t0

        ask(conversations[0])  # compiles the first shapes: the figures below are of a warm server
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(ask, conversations))
        wall = time.perf_counter() - start
    backend.shutdown(cancel=True)
    right = [a.strip() == c[-1]["content"].strip() for (a, _), c in zip(answers, conversations)]
    same = [a == e[2] for (a, _), e in zip(answers, offline["examples"])]
    latency = np.asarray([t for _, t in answers])
    return {
        "n": len(conversations),
        "clients": clients,
        "exact_match": sum(right) / len(right),
        "same_as_offline": int(sum(same)),
        "requests_per_s": len(conversations) / wall,
        "p50_s": float(np.percentile(latency, 50)),
        "p99_s": float(np.percentile(latency, 99)),
    }


def _quantized(loaded, conversations: list) -> dict:
    """Held-out exact match and weight bytes of the model as float, int8 and int4."""
    rows = {}
    for mode in ("none", "int8", "int4"):
        session = Session(loaded, quantize=mode)
        done = exact_match(
            session.built.module,
            session.params,
            loaded.tokenizer,
            conversations,
            max_new_tokens=MAX_NEW,
            mesh=session.built.mesh,
            rules=session.built.rules,
        )
        rows[mode] = {"exact_match": done["exact_match"], "weight_bytes": weight_bytes(session.params)["all"]}
    return rows


def _speculative(loaded, student, conversations: list) -> dict:
    """Greedy answers with the student (or prompt lookup) drafting 4 tokens per row and target pass
    in the engine, against plain greedy decoding: identical tokens, and how many drafts the target
    kept."""
    prompts, template = chat_prompts(loaded.tokenizer, [c[:-1] for c in conversations])
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)
    plain = Session(loaded).generator(greedy, template.stop_ids)(prompts)
    out = {}
    for name, draft in (("student", student), ("ngram", None)):
        generator = Session(loaded, speculate=4, draft=draft).generator(greedy, template.stop_ids)
        spec, drafted = generator(prompts), generator.drafted
        same = sum(np.array_equal(a, b) for a, b in zip(spec.ids, plain.ids))
        out[name] = {
            "n": len(prompts),
            "same_as_plain": int(same),
            "acceptance": drafted["accepted"] / max(drafted["proposed"], 1),
            "tokens_per_call": (drafted["accepted"] + drafted["passes"]) / max(drafted["passes"], 1),
        }
    return out


def serving_lines(s: dict) -> list[str]:
    """The evidence table's lines for the serving stage."""
    sv, q = s["served"], s["quantized"]
    lines = [
        f"lm serve (OpenAI API, {sv['clients']} concurrent clients, continuous batching): {sv['n']} held-out chat "
        f"requests, exact match {sv['exact_match']:.1%}, {sv['same_as_offline']}/{sv['n']} answers equal the "
        f"offline engine's; {sv['requests_per_s']:.1f} requests/s, latency p50 {sv['p50_s']:.2f} s, "
        f"p99 {sv['p99_s']:.2f} s",
        "weight-only quantization of the GRPO model (held-out exact match, weight bytes):",
    ]
    float_bytes = q["none"]["weight_bytes"]
    for mode, r in q.items():
        lines.append(
            f"  {mode if mode != 'none' else 'float32':8} {r['exact_match']:6.1%}  "
            f"{r['weight_bytes'] / 2**20:6.2f} MiB ({r['weight_bytes'] / float_bytes:.2f}x)"
        )
    for name, r in s["speculative"].items():
        lines.append(
            f"speculative decoding, {name} drafts (k=4): {r['same_as_plain']}/{r['n']} greedy answers equal "
            f"plain decoding, {r['acceptance']:.0%} of drafts kept, {r['tokens_per_call']:.2f} tokens per "
            "target pass"
        )
    return lines
