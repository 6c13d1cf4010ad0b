"""Speculative decoding against plain decoding at batch 1 on a trained target: new tokens/s,
drafts kept, tokens per target call.

Target: the demo's GRPO model; drafts: (a) the demo's distilled student (same tokenizer, half the
width), (b) prompt-lookup n-grams. Prompts: the held-out task conversations rendered with the
chat template (as `lm sample --chat`), decoded one at a time until the end of the answer or
--max-new-tokens. Every method decodes the same prompts; methods alternate within each round
(the machine's speed drifts) and the median round is reported, with its ratio to plain decoding
in the same round. Greedy rows also check that speculation returned plain decoding's tokens.
Before each table, the cost of one target (and draft) call feeding t = 1, 2 and k+1 tokens:
speculation pays only where a call over k+1 tokens costs little more than one over 1 token and
a draft call costs little next to a target call. A second table (--big) decodes a random-weight
target, wider and deeper, with n-gram drafts: its greedy output repeats itself, the best case
for prompt lookup, showing what verification in one call buys where a call is expensive.

    PYTHONPATH=. python bench/speculative.py [--target RUN] [--draft RUN] [--prompts JSONL]
        [--n 24] [--rounds 3] [--k 2 4] [--temperature 0] [--big 512:8]

Prints figures only; asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = re.sub(
    r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from lm.config import base_config  # noqa: E402
from lm.data.chat import ChatTemplate, prompt_ids  # noqa: E402
from lm.infer.generate import Generation, Generator, generation_context  # noqa: E402
from lm.infer.sampling import SamplingParams, choose  # noqa: E402
from lm.infer.speculative import NGRAM, DraftModel, SpeculativeDecoder, _decoding, on_one_device  # noqa: E402
from lm.model.cache import decode_step, init_cache  # noqa: E402
from lm.model.spec import ModelSpec  # noqa: E402
from lm.model.transformer import Transformer, init_params  # noqa: E402
from lm.store.load import load_trained  # noqa: E402


class DensePlain:
    """Plain batch-1 decoding on the same dense KV cache, prompt padding and compiled-once program
    as the speculative decoder (one jitted call: prefill, then a loop of one-token steps): the
    fair peer. The library's `Generator` is measured beside it (its engine serves many requests
    at once, and pays a host round trip per step)."""

    def __init__(self, model, params, sampling: SamplingParams, eos_id: tuple[int, ...], max_len: int):
        self.model, self.params = _decoding(model, params)
        self.sampling, self.eos, self.max_len = sampling, jnp.asarray(eos_id, jnp.int32), max_len
        self.fn = jax.jit(self._generate)

    def _generate(self, params, cache, ids, length, eos, rng):
        n = self.sampling.max_new_tokens
        seg = (jnp.arange(ids.shape[1]) < length).astype(jnp.int32)[None]
        pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
        logits, cache = decode_step(self.model, params, cache, ids, seg, pos, logits_at=(length - 1)[None])
        token = choose(jax.random.fold_in(rng, 0), logits[:, 0], self.sampling)[0][0]
        out = jnp.zeros((n,), jnp.int32).at[0].set(token)

        def body(c):
            i, token, cache, out, _ = c
            logits, cache = decode_step(
                self.model, params, cache, token[None, None], jnp.ones((1, 1), jnp.int32), (length + i - 1)[None, None]
            )
            token = choose(jax.random.fold_in(rng, i), logits[:, 0], self.sampling)[0][0]
            return i + 1, token, cache, out.at[i].set(token), jnp.isin(token, eos)

        c = jax.lax.while_loop(
            lambda c: (c[0] < n) & ~c[4], body, (jnp.int32(1), token, cache, out, jnp.isin(token, eos))
        )
        return c[3], c[0]

    def __call__(self, prompts: list):
        (prompt,) = prompts
        width = min(max(16, 1 << (len(prompt) - 1).bit_length()), self.max_len)
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(prompt)] = prompt
        out, n = self.fn(
            self.params,
            init_cache(self.model, 1, self.max_len),
            jnp.asarray(ids),
            jnp.int32(len(prompt)),
            self.eos,
            jax.random.PRNGKey(self.sampling.seed),
        )
        return Generation([np.asarray(out)[: int(n)]], [], [])


def chat_prompts(path: str, n: int, template) -> list[list[int]]:
    rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()][:n]
    return [prompt_ids(template, r["messages"][:-1]) for r in rows]  # up to the last user turn


class Method:
    """A name and a decoder called on one prompt at a time; keeps the last pass's outputs and stats."""

    def __init__(self, name: str, decode, prompts: list):
        self.name, self.decode, self.prompts = name, decode, prompts
        self.rates: list[float] = []
        self.ids, self.stats = self.run()  # compile (every prefill width the prompts need), then keep outputs

    def run(self):
        ids, proposed, accepted, calls = [], 0, 0, 0
        for p in self.prompts:
            out = self.decode([p])
            ids.append(out.ids[0].tolist())
            proposed += getattr(out, "proposed", 0)
            accepted += getattr(out, "accepted", 0)
            calls += getattr(out, "target_calls", len(out.ids[0]))
        return ids, (proposed, accepted, calls)

    def time_once(self) -> float:
        start = time.perf_counter()
        ids, _ = self.run()
        rate = sum(len(i) for i in ids) / (time.perf_counter() - start)
        self.rates.append(rate)
        return rate


def call_costs(models: dict, widths: list[int], max_len: int, reps: int = 50, rounds: int = 3) -> None:
    """Microseconds of one cache call feeding t tokens (t = 1: plain decoding; t = k+1: a
    verification), per model; medians of interleaved rounds. Speculation pays only when a
    verification costs much less than the t plain steps it may replace."""
    calls = {}
    for name, (model, params) in models.items():
        model, params = _decoding(model, params)
        fn = jax.jit(functools.partial(decode_step, model), donate_argnums=1)
        for t in widths:
            x = jnp.ones((1, t), jnp.int32)
            cache = fn(params, init_cache(model, 1, max_len), x, x, 16 + jnp.arange(t)[None])[1]  # compile
            calls[name, t] = [fn, params, cache, x, []]
    for _ in range(rounds):
        for key, entry in calls.items():
            fn, params, cache, x, times = entry
            pos = 16 + jnp.arange(x.shape[1])[None]
            start = time.perf_counter()
            for _ in range(reps):
                logits, cache = fn(params, cache, x, x, pos)
            logits.block_until_ready()
            times.append((time.perf_counter() - start) / reps * 1e6)
            entry[2] = cache
    print(f"{'one cache call, us':<24}" + "".join(f"{f't={t}':>9}" for t in widths))
    for name in models:
        row = [statistics.median(calls[name, t][4]) for t in widths]
        print(
            f"{name:<24}"
            + "".join(f"{v:>9.0f}" for v in row)
            + "   ("
            + ", ".join(f"t={t}: {v / row[0]:.2f}x t=1" for t, v in zip(widths[1:], row[1:]))
            + ")"
        )


def compare(t_model, t_params, drafts: dict, prompts, sampling, eos, ks, rounds: int, generator: bool) -> None:
    """The table: plain decoding, each draft alone, speculation with each draft and k."""
    max_len = min(
        [generation_context(t_model.spec)]
        + [d.model.spec.max_seq_len for d in drafts.values() if isinstance(d, DraftModel)]
    )
    methods = [Method("plain, dense cache", DensePlain(t_model, t_params, sampling, eos, max_len), prompts)]
    if generator:
        methods.append(Method("plain, Generator", Generator(t_model, t_params, sampling, eos_id=eos), prompts))
    for name, d in drafts.items():
        if isinstance(d, DraftModel):
            methods.append(Method(f"{name} alone", DensePlain(d.model, d.params, sampling, eos, max_len), prompts))
    for k in ks:
        for name, d in drafts.items():
            spec = SpeculativeDecoder(t_model, t_params, sampling, draft=d, k=k, eos_id=eos)
            methods.append(Method(f"{name}, k={k}", spec, prompts))
    for _ in range(rounds):
        for method in methods:
            method.time_once()
    base = methods[0]
    tokens = sum(len(i) for i in base.ids)
    print(f"{tokens} new tokens per pass (mean {tokens / len(prompts):.1f} per prompt); median of {rounds} rounds")
    print(f"{'method':<24} {'tokens/s':>9} {'vs plain':>9} {'kept':>14} {'tok/call':>9} {'same ids':>9}")
    for method in methods:
        ratio = statistics.median(r / b for r, b in zip(method.rates, base.rates))
        proposed, accepted, calls = method.stats
        kept = f"{accepted}/{proposed} {accepted / proposed:.0%}" if proposed else "-"
        per_call = f"{sum(len(i) for i in method.ids) / calls:.2f}" if proposed else "-"
        greedy_peer = sampling.greedy and "alone" not in method.name
        same = ("yes" if method.ids == base.ids else "NO") if greedy_peer else "-"
        print(
            f"{method.name:<24} {statistics.median(method.rates):>9.1f} {ratio:>8.2f}x {kept:>14} {per_call:>9} "
            f"{same:>9}"
        )


def random_target(vocab: int, d_model: int, layers: int, max_len: int):
    """A random-weight target of the given width and depth (the config's other defaults)."""
    m = base_config().model
    m.update(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=layers,
        n_heads=max(1, d_model // 64),
        n_kv_heads=max(1, d_model // 128),
        d_ff=d_model * 3,
        max_seq_len=max_len,
    )
    model = Transformer(ModelSpec.from_config(m))
    return model, jax.jit(lambda k: nn.unbox(init_params(model, k)))(jax.random.PRNGKey(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo-hf/grpo")
    ap.add_argument("--draft", default="runs/demo-hf/distilled")
    ap.add_argument("--prompts", default="runs/demo-hf/task/heldout.jsonl")
    ap.add_argument("--n", type=int, default=24, help="prompts per pass")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="drafted tokens per step")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument(
        "--big",
        default="512:8",
        help="D_MODEL:LAYERS of a random-weight target decoded with n-gram drafts after the demo tables (empty: skip)",
    )
    args = ap.parse_args()

    target, draft = load_trained(args.target, None, None), load_trained(args.draft, None, None)
    template = ChatTemplate.for_tokenizer(target.tokenizer)
    prompts = chat_prompts(args.prompts, args.n, template)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0)
    eos = template.stop_ids
    t_model, t_params = on_one_device(target)
    d_model, d_params = on_one_device(draft)
    m, dm = target.config.model, draft.config.model
    print(
        f"target {args.target}: d_model {m.d_model}, {m.n_layers} layers; draft {args.draft}: d_model "
        f"{dm.d_model}, {dm.n_layers} layers; {len(prompts)} chat prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens; temperature {args.temperature}; {jax.devices()[0].device_kind}"
    )
    widths = [1, 2] + [k + 1 for k in args.k if k + 1 > 2]
    call_costs({"target": (t_model, t_params), "distilled draft": (d_model, d_params)}, widths, 256)
    compare(
        t_model,
        t_params,
        {"distilled draft": DraftModel(d_model, d_params), "n-gram drafts": NGRAM},
        prompts,
        sampling,
        eos,
        args.k,
        args.rounds,
        generator=True,
    )
    if args.big:
        width, layers = (int(x) for x in args.big.split(":"))
        model, params = random_target(m.vocab_size, width, layers, 256)
        n = sum(x.size for x in jax.tree.leaves(params))
        print(
            f"\nrandom-weight target: d_model {width}, {layers} layers, {n / 1e6:.0f}M params, the same prompts "
            f"(its greedy output repeats itself: a best case for n-gram drafts), eos never"
        )
        call_costs({"random target": (model, params)}, widths, 256)
        compare(
            model,
            params,
            {"n-gram drafts": NGRAM},
            prompts[: max(4, args.n // 4)],
            sampling,
            (-1,),
            args.k,
            args.rounds,
            generator=False,
        )


if __name__ == "__main__":
    main()
