"""A Hugging Face tokenizer (a checkpoint's tokenizer.json) behind the project's tokenizer protocol.

The directory is what a checkpoint ships: tokenizer.json (read with the `tokenizers` library),
tokenizer_config.json (named special tokens, add_bos_token, chat_template), optionally
chat_template.jinja and generation_config.json (extra stop ids). Encoding adds no special tokens,
exactly as `AutoTokenizer(dir)(text, add_special_tokens=False)` does; `add_bos` says whether HF
would prepend BOS to a plain text (add_special_tokens=True, tokenizer.json's post-processor).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from lm.errors import UserError

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
SPACE_MARK = "\u2581"  # sentencepiece-style tokenizers spell a space so


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"data.tokenizer: cannot read '{path}': {e}") from e
    if not isinstance(value, dict):
        raise UserError(f"data.tokenizer: '{path}' holds {type(value).__name__}; expected a JSON object")
    return value


def _token_text(value) -> str | None:
    """A named special token as tokenizer_config writes it: a string or a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _ids(value) -> list[int]:
    """generation_config's eos_token_id: an int, a list of ints, or absent."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


class HFTokenizer:
    """tokenizer.json plus its config files in `path`. bos_id is -1 when the model has no BOS
    (Qwen); pad_id falls back to eos_id; stop_ids are eos_id and generation_config's eos ids."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # lazy: only HF checkpoints need it

        self.path = Path(path)
        self._file = self.path / "tokenizer.json"
        try:
            self._json = self._file.read_bytes()
            self._tok = Tokenizer.from_str(self._json.decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise UserError(f"data.tokenizer: cannot load '{self._file}': {str(e).splitlines()[0]}") from e
        self._tok.no_truncation()  # a file may carry them; transformers' plain call applies neither
        self._tok.no_padding()
        self._config = _read_json(self.path / "tokenizer_config.json")
        if "added_tokens_decoder" not in self._config:  # older checkpoints: transformers lets this file win
            legacy = _read_json(self.path / "special_tokens_map.json")
            self._config.update({k: v for k, v in legacy.items() if k.endswith("_token")})
        generation = _read_json(self.path / "generation_config.json")
        self._added = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}
        self._specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.name = "hf-" + re.sub(r"[^A-Za-z0-9_.-]", "_", self.path.resolve().name)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        # BOS is the tokenizer's, as transformers sees it: generation_config may name one (Qwen's
        # <|endoftext|>) that the tokenizer never adds and templates never see.
        self.bos_id = self._named_id("bos_token")
        eos = self._named_id("eos_token")
        extra_stops = _ids(generation.get("eos_token_id"))
        if eos < 0 and extra_stops:
            eos = extra_stops[0]
        if eos < 0:
            raise UserError(
                f"data.tokenizer: '{self.path}' names no EOS token (tokenizer_config.json eos_token "
                "or generation_config.json eos_token_id)"
            )
        self.eos_id = eos
        pad = self._named_id("pad_token")
        self.pad_id = pad if pad >= 0 else eos
        self.stop_ids = tuple(dict.fromkeys([eos] + [i for i in extra_stops if 0 <= i < self.vocab_size]))
        self.add_bos = self._adds_bos()

    def _named_id(self, key: str) -> int:
        text = _token_text(self._config.get(key))
        i = self._tok.token_to_id(text) if text else None
        return -1 if i is None else int(i)

    def _adds_bos(self) -> bool:
        if self.bos_id < 0:
            return False
        # tokenizer.json's post-processor decides: transformers ignores tokenizer_config's add_bos_token
        # whenever a tokenizer.json is there.
        with_specials = self._tok.encode("a", add_special_tokens=True).ids
        return (
            len(with_specials) > len(self._tok.encode("a", add_special_tokens=False).ids)
            and with_specials[0] == self.bos_id
        )

    def encode(self, text: str | bytes) -> np.ndarray:
        return np.asarray(self.encode_offsets(text)[0], np.int32)

    def encode_offsets(self, text: str | bytes) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """(ids, [(start, end)] character offsets of each token in `text`), no special tokens added."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        enc = self._tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int32), list(enc.offsets)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def special_id(self, token: str) -> int:
        """Id of an added token such as "<|im_end|>"; UserError if the tokenizer lacks it."""
        if token not in self._added:
            raise UserError(f"data.tokenizer: '{token}' is not a special or added token of '{self._file}'")
        return self._added[token]

    def special_tokens(self) -> dict[str, int]:
        """Every special token's text and id (what decode drops)."""
        return {t: i for t, i in self._added.items() if i in self._specials}

    def chat_template(self) -> str | None:
        """The model's jinja chat template: chat_template.jinja, else tokenizer_config.json's
        chat_template (a string, or a list of {name, template} of which "default" is used)."""
        source = self.chat_template_file()
        if source is None:
            return None
        if source.suffix == ".jinja":
            return source.read_text(encoding="utf-8")
        value = self._config["chat_template"]
        if isinstance(value, list):
            return next(t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default")
        return value

    def chat_template_file(self) -> Path | None:
        """The file the chat template comes from (None when there is none)."""
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja
        value = self._config.get("chat_template")
        if isinstance(value, list):
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        return self.path / "tokenizer_config.json" if isinstance(value, str) and value else None

    def template_variables(self) -> dict[str, str]:
        """The named special tokens a chat template sees (bos_token, eos_token, ...), as transformers passes them."""
        keys = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        return {k: t for k in keys if (t := _token_text(self._config.get(k))) is not None}

    def token_bytes(self) -> np.ndarray:
        """[vocab] int32: UTF-8 bytes each id decodes to; 0 for special ids. Byte-level BPE (GPT-2 style,
        Llama 3, Qwen) pieces are spelled in a 256-character alphabet, one character per byte;
        sentencepiece-style pieces spell a space as "\u2581" and byte-fallback pieces <0xNN> are one byte."""
        from tokenizers.pre_tokenizers import ByteLevel

        decoder = json.dumps(json.loads(self._json).get("decoder"), ensure_ascii=False)
        byte_level = '"ByteLevel"' in decoder
        metaspace = '"Metaspace"' in decoder or SPACE_MARK in decoder
        byte_fallback = '"ByteFallback"' in decoder
        alphabet = set(ByteLevel.alphabet())
        out = np.zeros(self.vocab_size, np.int32)
        for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in self._specials or i >= self.vocab_size:
                continue
            if byte_level and all(c in alphabet for c in piece):
                out[i] = len(piece)  # the decoder maps each alphabet character back to one byte
            elif byte_fallback and _BYTE_PIECE.fullmatch(piece):
                out[i] = 1
            else:
                out[i] = len((piece.replace(SPACE_MARK, " ") if metaspace else piece).encode("utf-8"))
        return out

    def fingerprint(self) -> str:
        ids = f"bos={self.bos_id},eos={self.eos_id},pad={self.pad_id}"
        return "hf:" + hashlib.sha256(self._json + ids.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"HFTokenizer('{self.path}')"
