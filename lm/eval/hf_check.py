"""An exported Hugging Face checkpoint, reloaded by transformers, answers as `lm` does: greedy replies
to held-out conversations from both, through each side's own chat template and generation loop."""

from __future__ import annotations

import pathlib

import numpy as np

from lm.data.chat import ChatTemplate, prompt_ids
from lm.errors import UserError
from lm.eval.answers import read_conversations
from lm.infer.sampling import SamplingParams
from lm.infer.session import Session
from lm.store.load import load_trained


def compare_with_transformers(workdir, export_dir, conversations_path, n: int = 16, max_new_tokens: int = 16) -> dict:
    """{'n', 'same_answers', 'same_prompt_ids', 'examples'}: the greedy answers of the run in `workdir`
    (`lm sample --chat`'s path) against transformers' `generate` on `export_dir` (AutoTokenizer's
    `apply_chat_template`, the exported generation_config's stop ids)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise UserError(f"comparing with transformers needs it installed (pip install 'lm[hf]'): {e}") from None
    conversations = [c[:-1] for c in read_conversations(conversations_path, n)]
    session = Session(load_trained(workdir=str(workdir)))
    ours = session.chat(conversations, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))

    template = ChatTemplate.for_tokenizer(session.tokenizer)
    tok = AutoTokenizer.from_pretrained(pathlib.Path(export_dir))
    model = AutoModelForCausalLM.from_pretrained(pathlib.Path(export_dir), dtype=torch.float32).eval()
    stops = model.generation_config.eos_token_id
    rows, same, same_ids = [], 0, 0
    for messages, mine in zip(conversations, ours):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        same_ids += ids == prompt_ids(template, messages)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stops,
                pad_token_id=tok.pad_token_id,
            )[0, len(ids) :]
        theirs = tok.decode(out, skip_special_tokens=True)
        same += theirs == mine["text"]
        rows.append({"prompt": messages[-1]["content"], "lm": mine["text"], "transformers": theirs})
    return {
        "n": len(rows),
        "same_answers": same,
        "same_prompt_ids": same_ids,
        "examples": rows,
        "agreement": float(np.mean([r["lm"] == r["transformers"] for r in rows])) if rows else 0.0,
    }
