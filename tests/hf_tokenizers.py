"""Hugging Face tokenizer directories built here, as checkpoints ship them (no downloads): BPEs
trained with the `tokenizers` library on standard-library sources, saved by transformers with a
chat template. Llama-3-like (byte level, BOS), Qwen2.5-like (byte level, ChatML, no BOS) and
Gemma-like (sentencepiece style: "\u2581" spaces, byte fallback pieces, BOS)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}
    {{- content }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""  # noqa: E501 (the template as published)
LLAMA3_GENERATION_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
QWEN_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") -}}
    {{- message['content'] | trim -}}
    {{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}"""


def stdlib_text(limit: int, skip: int = 0) -> str:
    """Whole standard-library modules, in a fixed order, until `limit` characters."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for path in sorted(root.glob("*.py"))[skip:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        n += len(text)
        if n >= limit:
            break
    return "".join(out)[:limit]


def _byte_level(split: str, specials: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([stdlib_text(300_000)], trainer)
    tok.add_special_tokens(specials)
    return tok


def _sentencepiece_style(specials: list[str]):
    """BPE over "\u2581"-spelled text whose vocabulary holds the 256 byte pieces, as Gemma's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    plain = Tokenizer(models.BPE())
    plain.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    plain.train_from_iterator([stdlib_text(300_000)], trainers.BpeTrainer(vocab_size=1200, show_progress=False))
    model = json.loads(plain.to_str())["model"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab={p: i for i, p in enumerate(pieces)},
            merges=merges,
            byte_fallback=True,
            unk_token="<unk>",
            fuse_unk=True,
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(specials)
    return tok


def save(tok, path: Path, template: str | None, generation: dict | None = None, **named) -> Path:
    """The directory a checkpoint ships: tokenizer.json, tokenizer_config.json, chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(path)
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def llama3_like(path: Path) -> Path:
    from tokenizers import processors

    tok = _byte_level(LLAMA3_SPLIT, LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    stops = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    return save(
        tok,
        path,
        LLAMA3_TEMPLATE,
        {"bos_token_id": bos, "eos_token_id": stops},
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


def qwen_like(path: Path) -> Path:
    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = _byte_level(split, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    ends = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    return save(
        tok,
        path,
        QWEN_TEMPLATE,
        {"bos_token_id": ends[1], "eos_token_id": ends},
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


def gemma_like(path: Path) -> Path:
    from tokenizers import processors

    tok = _sentencepiece_style(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)]
    )
    return save(
        tok,
        path,
        GEMMA_TEMPLATE,
        {"eos_token_id": 1},  # <end_of_turn> comes from the template
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
