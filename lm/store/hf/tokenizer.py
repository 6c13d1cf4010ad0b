"""A model's tokenizer and chat template as a Hugging Face directory ships them, so that
`AutoTokenizer.from_pretrained(dir)` gives our ids and `apply_chat_template` our format.

- An HF tokenizer (a model imported from a Hugging Face directory, or trained here with one):
  its files are copied as they are (tokenizer.json, tokenizer_config.json, special tokens, the
  chat template); a tokenizer without a chat template gets ours.
- Our sentencepiece BPE (lm.data.spm): a `tokenizer.json` built with the `tokenizers` library
  that gives sentencepiece's ids: the same vocabulary (ids = piece ids), merges from the pieces
  (a piece is merged from two pieces, earlier pieces first, as sentencepiece's scores rank
  them), spaces spelled "\u2581", no dummy prefix, byte fallback, no pre-tokenizer (sentencepiece
  merges over the whole text; the pieces never cross a space or join digits). The control
  pieces (<s>, </s>, <pad>, <|system|>, <|user|>, <|assistant|>, <|end|>) and <unk> are special
  added tokens.
- The byte tokenizer: byte-fallback pieces <0x00>..<0xFF> (ids 0..255) and <s>, </s>, <pad>.

Where `AutoTokenizer` and ours can differ:

- Special-token text inside a text: HF matches the literal string "<|user|>" (or "<s>") as the
  special token, so that a rendered chat finds its markers; ours encodes such text as plain
  pieces (no text can produce a control id).
- A literal "\u2581" in a text: ours encodes it as its three bytes, HF as the space piece.
- A whole rendered chat: our template (lm.data.chat) encodes marker, newline and content
  separately and joins the ids; HF tokenizes the rendered text at once, so the newline after a
  role marker merges with the start of the content where a piece spans both (a piece "\\n#" for
  a content starting with "#", "\\n\\n" for one starting with a newline). The markers and <|end|>
  are single special ids either way, so nothing else merges across them, and a content that
  starts with a space never merges so (no piece joins a newline and the space after it). The
  text is the same; only such a first piece of a content differs.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

from lm.errors import UserError

SPACE_MARK = "\u2581"
# Our chat format (lm.data.chat) as a jinja template, for transformers' apply_chat_template.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}\n"
    "{{- raise_exception('roles are system, user and assistant; got ' + message['role']) -}}\n"
    "{%- endif -%}\n"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|assistant|>\\n' -}}\n"
    "{%- endif -%}"
)
# What a Hugging Face tokenizer directory may hold (generation_config.json is written, not copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """What config.json and generation_config.json name: eos[0] is the tokenizer's EOS, the rest
    the chat template's end-of-turn ids."""

    bos: int | None
    eos: tuple[int, ...]
    pad: int | None


def tokenizer_json(tok) -> str:
    """`tok` (an HF, sentencepiece or byte tokenizer) as a Hugging Face tokenizer.json (its text)."""
    source = getattr(tok, "path", None)
    if source is not None and (pathlib.Path(source) / "tokenizer.json").is_file():
        return (pathlib.Path(source) / "tokenizer.json").read_text()
    if source is not None and pathlib.Path(source).suffix == ".model":
        return spm_tokenizer(pathlib.Path(source).read_bytes(), str(source)).to_str()
    if getattr(tok, "name", "") == "byte":
        return byte_tokenizer(tok).to_str()
    raise UserError(f"tokenizer {tok!r}: only Hugging Face, sentencepiece and byte tokenizers have a tokenizer.json")


def write_tokenizer(tok, out, max_len: int | None = None) -> SpecialIds:
    """Writes `tok` (an HF, sentencepiece or byte tokenizer) and its chat template into `out`."""
    from lm.data.chat import ChatTemplate

    out = pathlib.Path(out)
    source = getattr(tok, "path", None)
    if source is not None and (pathlib.Path(source) / "tokenizer.json").is_file():
        generation = _copy_hf_files(pathlib.Path(source), out, has_template=bool(tok.chat_template()))
    elif source is not None and pathlib.Path(source).suffix == ".model":
        generation = _write_built(spm_tokenizer(pathlib.Path(source).read_bytes(), str(source)), tok, out, max_len)
    elif getattr(tok, "name", "") == "byte":
        generation = _write_built(byte_tokenizer(tok), tok, out, max_len)
    else:
        raise UserError(f"tokenizer {tok!r}: only Hugging Face, sentencepiece and byte tokenizers can be exported")
    stops = ChatTemplate.for_tokenizer(tok).stop_ids
    ids = SpecialIds(
        bos=tok.bos_id if tok.bos_id >= 0 else None,
        eos=tuple(dict.fromkeys([int(tok.eos_id), *map(int, stops)])),
        pad=tok.pad_id if tok.pad_id >= 0 else None,
    )
    generation.update(
        bos_token_id=ids.bos, pad_token_id=ids.pad, eos_token_id=list(ids.eos) if len(ids.eos) > 1 else ids.eos[0]
    )
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def _copy_hf_files(source: pathlib.Path, out: pathlib.Path, has_template: bool) -> dict:
    """The tokenizer files of an HF directory, as they are; its generation_config.json as the
    start of ours (sampling settings kept)."""
    if source.resolve() != out.resolve():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
    if not has_template:
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation = source / "generation_config.json"
    try:
        return json.loads(generation.read_text()) if generation.is_file() else {}
    except ValueError as e:
        raise UserError(f"{generation}: not JSON: {e}") from None


def _write_built(hf_tok, tok, out: pathlib.Path, max_len: int | None) -> dict:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and the chat template for a
    tokenizer built here (no BOS added to plain text: ours adds none either)."""
    hf_tok.save(str(out / "tokenizer.json"))
    name = lambda i: hf_tok.id_to_token(i) if i is not None and i >= 0 else None
    named = {"bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id), "pad_token": name(tok.pad_id)}
    if hf_tok.token_to_id("<unk>") is not None:
        named["unk_token"] = "<unk>"
    named = {k: v for k, v in named.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **named,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if max_len:
        config["model_max_length"] = int(max_len)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(named, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return {}


def spm_tokenizer(model: bytes, source: str = "sentencepiece model"):
    """A `tokenizers.Tokenizer` that encodes as our sentencepiece BPE model (serialized proto) does."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    proto = pb.ModelProto()
    proto.ParseFromString(model)
    _check_spm(proto, source)
    kinds = pb.ModelProto.SentencePiece
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = [(i, p.piece, p.score) for i, p in enumerate(proto.pieces) if p.type == kinds.NORMAL]
    mergeable = {piece for _, piece, _ in normal}
    merges = []
    for _, piece, _ in sorted(normal, key=lambda t: (-t[2], t[0])):  # sentencepiece merges by score
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        merges += sorted(
            ((a, b) for a, b in splits if a in mergeable and b in mergeable),
            key=lambda ab: (vocab[ab[0]], vocab[ab[1]]),
        )
    unk = next((p.piece for p in proto.pieces if p.type == kinds.UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.Replace(" ", SPACE_MARK)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(
        [
            AddedToken(p.piece, special=True, normalized=False)
            for p in proto.pieces
            if p.type in (kinds.CONTROL, kinds.UNKNOWN)
        ]
    )
    return tok


def _check_spm(proto, source: str) -> None:
    """The sentencepiece settings the built tokenizer reproduces (lm.data.spm trains with them)."""
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    wanted = [
        ("trainer_spec.model_type", trainer.model_type, 2, "BPE"),
        ("trainer_spec.byte_fallback", trainer.byte_fallback, True, "True"),
        ("trainer_spec.treat_whitespace_as_suffix", trainer.treat_whitespace_as_suffix, False, "False"),
        ("normalizer_spec.name", norm.name, "identity", "'identity'"),
        ("normalizer_spec.add_dummy_prefix", norm.add_dummy_prefix, False, "False"),
        ("normalizer_spec.remove_extra_whitespaces", norm.remove_extra_whitespaces, False, "False"),
        ("normalizer_spec.escape_whitespaces", norm.escape_whitespaces, True, "True"),
    ]
    for key, value, expected, shown in wanted:
        if value != expected:
            raise UserError(
                f"{source}: {key}={value!r}; a tokenizer.json is written only for sentencepiece "
                f"models trained as lm trains them ({key}={shown})"
            )
    if any(p.type == p.USER_DEFINED for p in proto.pieces):
        raise UserError(f"{source}: user-defined pieces are not supported in a tokenizer.json export")


def byte_tokenizer(tok):
    """A `tokenizers.Tokenizer` for the byte tokenizer: every character as its UTF-8 bytes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    specials = {tok.bos_id: "<s>", tok.eos_id: "</s>", tok.pad_id: "<pad>"}
    vocab.update({t: i for i, t in specials.items()})
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    return hf
