"""`lm rft`: rejection-sampling fine-tuning (best-of-n: Llama 3's post-training loop, RAFT, ReST).

  prompts (finetune.data, as `lm rl` reads them) -> rft.samples responses each from the init model
  through the engine -> rewards (lm rl's: rl.rewards, rl.reward_model, rl.reward_url) -> each
  prompt's best response, kept when its reward is above rft.threshold -> `lm sft` on the kept
  conversations (the same run: steps from finetune.epochs, held-out loss and exact match)

The sampling key of batch b is fold_in(seed, b): the same prompts, model and settings give the
same kept set. It is written to the workdir (rft_kept.jsonl, every sample with its reward in
rft_samples.jsonl) with a report (rft_report.json: how many prompts kept a sample, the reward
distribution of every sample and of the kept ones) and a record of what it came from; a resumed
run reuses it while the record holds. A reward that failed (NaN) never wins a prompt.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import jax
import numpy as np

from lm.data import provenance
from lm.data.cache import data_cache_dir
from lm.data.chat import ChatTemplate
from lm.data.prompts import read_prompts
from lm.data.sft import describe, prepare_sft
from lm.errors import UserError
from lm.eval.answers import plain_model
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.outputs import atomic_open
from lm.store.fingerprint import model_fingerprint
from lm.train.rewards import Rewards
from lm.train.sft import Sft, settings
from lm.train.stage import require_data, run_stage

KEPT, SAMPLES, REPORT = "rft_kept.jsonl", "rft_samples.jsonl", "rft_report.json"


class Rft(Sft):
    """Prompts in; the kept best-of-n conversations, fine-tuned on as `lm sft` does."""

    name = "rft"

    def check(self, config) -> None:
        require_data(
            config.finetune.data, "finetune.data", 'give `lm rft --data prompts.jsonl` ({"prompt": ...} lines)'
        )

    def read(self, ctx):
        self.report = select(ctx)
        kept, tok = ctx.workdir / KEPT, ctx.init.tokenizer
        cache = data_cache_dir(ctx.config.data)
        train = prepare_sft(kept, tok, settings(ctx.config), cache)
        print(f"rft data {kept}: {describe(train.stats)}")
        s = ctx.config.finetune
        heldout = prepare_sft(s.eval_data, tok, settings(ctx.config), cache) if s.eval_data else None
        return train, heldout

    def finish(self, ctx) -> dict:
        return super().finish(ctx) | {"rft": self.report}


def record(ctx) -> dict:
    """What the kept set follows from: the prompts' bytes, the init model, the sampling settings
    and the rewards."""
    c = ctx.config
    digest = hashlib.sha256(pathlib.Path(c.finetune.data).read_bytes()).hexdigest()
    rewards = {k: c.rl[k] for k in ("rewards", "reward_model", "reward_model_weight", "reward_url", "reward_weight")}
    return json.loads(
        json.dumps(
            {
                "prompts": digest,
                "init": model_fingerprint(c.finetune.init),
                "rft": c.rft.to_dict(),
                "rewards": rewards,
                "seq_len": c.data.seq_len,
                "seed": c.train.seed,
            }
        )
    )


def select(ctx) -> dict:
    """The kept set in the workdir (sampled now, or reused on a resume whose record holds); the report."""
    want = record(ctx)
    path = ctx.workdir / REPORT
    if ctx.resume and path.is_file() and (ctx.workdir / KEPT).is_file():
        saved = json.loads(path.read_text())
        if saved.get("record") == want:
            provenance.note_file("prompts", pathlib.Path(ctx.config.finetune.data))  # as sampling would read it
            print(
                f"rft: reusing the kept samples of {ctx.workdir / KEPT} ({saved['kept']} of {saved['prompts']} prompts)"
            )
            return saved
    samples, kept, report = sample(ctx)
    report["record"] = want
    if ctx.is_main:
        for name, rows in ((SAMPLES, samples), (KEPT, kept)):
            with atomic_open(ctx.workdir / name) as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        with atomic_open(path) as f:
            json.dump(report, f, indent=2)
    return report


def sample(ctx) -> tuple[list, list, dict]:
    """(every sample with its reward, the kept conversations, the report)."""
    c, init = ctx.config, ctx.init
    f, s = c.finetune, c.rft
    prompts = read_prompts(
        f.data,
        init.tokenizer,
        seq_len=c.data.seq_len,
        max_new_tokens=s.max_new_tokens,
        on_bad_record=f.on_bad_record,
        max_skipped_fraction=f.max_skipped_fraction,
        limit=s.prompts,
    )
    template = ChatTemplate.for_tokenizer(init.tokenizer)
    built, params = plain_model(init.config, init.params)
    rewards = Rewards.from_config(c.rl)
    rewards.place(built.mesh)
    sampling = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p)
    generate = Generator(
        built.module,
        params,
        sampling,
        eos_id=template.stop_ids,
        max_len=c.data.seq_len,
        mesh=built.mesh,
        rules=built.rules,
    )
    samples, kept, totals, best = [], [], [], []
    n = len(prompts)
    for b, start in enumerate(range(0, n, s.batch_prompts)):
        idx = list(range(start, min(start + s.batch_prompts, n)))
        index = [i for i in idx for _ in range(s.samples)]
        out = generate([prompts.tokens(i) for i in index], rng=jax.random.fold_in(jax.random.PRNGKey(c.train.seed), b))
        texts = [template.answer_text(ids) for ids in out.ids]
        cut = np.array([x == "length" for x in out.finish])
        total, _ = rewards(
            [prompts.prompts[i] for i in index],
            [prompts.messages[i] for i in index],
            texts,
            cut,
            [prompts.columns[i] for i in index],
        )
        total = np.asarray(total, np.float64).reshape(len(idx), s.samples)
        for j, i in enumerate(idx):
            row = total[j]
            for k in range(s.samples):
                samples.append({"prompt": i, "sample": k, "response": texts[j * s.samples + k], "reward": _num(row[k])})
            winner = int(np.nanargmax(row)) if np.isfinite(row).any() else None
            best.append(row[winner] if winner is not None else np.nan)
            if winner is not None and row[winner] > s.threshold:
                reply = {"role": "assistant", "content": texts[j * s.samples + winner]}
                kept.append({"messages": prompts.messages[i] + [reply]})
        totals.append(total)
        print(f"rft: sampled {idx[-1] + 1} of {n} prompts x {s.samples}, kept {len(kept)}", flush=True)
    report = summarize(np.concatenate(totals), np.asarray(best), s.threshold)
    print(
        f"rft: {report['kept']} of {report['prompts']} prompts kept a sample above {s.threshold:g} "
        f"({report['kept_share']:.1%}); mean reward {report['reward']['mean']:.4f} over every sample, "
        f"{report['best']['mean']:.4f} over each prompt's best"
    )
    if not kept:
        raise UserError(
            f"rft: no prompt of {f.data} kept a sample (best rewards {report['best']}); lower rft.threshold "
            f"({s.threshold:g}) or raise rft.samples ({s.samples})"
        )
    return samples, kept, report


def summarize(totals: np.ndarray, best: np.ndarray, threshold: float) -> dict:
    """The report: prompts, kept (best above the threshold), and the distribution of the rewards
    of every sample and of each prompt's best (failed rewards counted apart)."""
    kept = int(np.sum(np.isfinite(best) & (best > threshold)))
    return {
        "prompts": len(best),
        "samples": int(totals.size),
        "kept": kept,
        "kept_share": kept / max(len(best), 1),
        "threshold": threshold,
        "failed_rewards": int(np.sum(~np.isfinite(totals))),
        "reward": distribution(totals.ravel()),
        "best": distribution(best),
    }


def distribution(x: np.ndarray) -> dict:
    """Mean, std, quantiles and a 10-bin histogram of the finite values."""
    x = x[np.isfinite(x)]
    if not len(x):
        return {"n": 0}
    counts, edges = np.histogram(x, bins=10)
    quantiles = np.quantile(x, [0.0, 0.1, 0.5, 0.9, 1.0])
    return {
        "n": len(x),
        "mean": float(x.mean()),
        "std": float(x.std()),
        "quantiles": dict(zip(("min", "p10", "p50", "p90", "max"), map(float, quantiles))),
        "histogram": {"counts": counts.tolist(), "edges": edges.tolist()},
    }


def _num(x) -> float | None:
    return float(x) if np.isfinite(x) else None


def rft(config, workdir, resume: bool = False, show_progress: bool = True) -> dict:
    return run_stage(Rft(), config, workdir, resume, show_progress)
