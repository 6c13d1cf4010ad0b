"""A loaded model placed on the mesh of its config, ready to complete prompts."""

from __future__ import annotations

import pathlib

from lm.config import rules_table
from lm.data.chat import chat_prompts
from lm.infer.engine.engine import EngineConfig
from lm.infer.generate import Generator, generation_context
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete, complete_ids
from lm.model.build import build_model
from lm.model.quant import quantize_for_inference
from lm.store.load import load_trained


class Session:
    """Builds the model of its config on its mesh, places the params with their shardings, and
    keeps one compiled generator per sampling setting. quantize: "int8" or "int4" weight-only
    quantization (lm.model.quant), applied weight by weight as the params are placed. slots: the
    engine's requests decoded together (default: every prompt of a call at once); kv_cache: the KV
    cache's pages as "int8" or "fp8" ("": the compute dtype); speculate: drafts per row and step
    (0: off), by prompt lookup or, given `draft` (a loaded model with the same tokenizer), by
    that model, placed on this model's mesh."""

    def __init__(
        self,
        loaded,
        devices=None,
        quantize: str | None = None,
        slots: int | None = None,
        kv_cache: str = "",
        speculate: int = 0,
        draft=None,
    ):
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        engine = dict(kv_cache=kv_cache, speculate=speculate)
        self.config = EngineConfig(slots=slots or 16, **engine) if slots or kv_cache or speculate else None
        self.built = build_model(loaded.config, devices, rules=rules_table(loaded.config))
        self.built.check(loaded.params, loaded.source)
        self.params = place_params(self.built, loaded.params, quantize)
        self.draft = None if draft is None else self._place_draft(draft, quantize)
        self._generators: dict = {}

    def _place_draft(self, draft, quantize):
        """The draft's built model on this model's mesh and rules, its params placed there."""
        built = build_model(draft.config, mesh=self.built.mesh, rules=self.built.rules)
        built.check(draft.params, draft.source)
        return built, place_params(built, draft.params, quantize)

    @property
    def draft_module(self):
        return None if self.draft is None else self.draft[0].module

    @property
    def drafted(self) -> dict:
        """Speculation's drafts proposed and accepted, and its target passes, over every call."""
        tallies = [g.drafted for g in self._generators.values()]
        return {name: sum(t[name] for t in tallies) for name in ("proposed", "accepted", "passes")}

    @property
    def engine_params(self):
        """The params an engine of this session takes: a (target, draft) pair with a draft."""
        return self.params if self.draft is None else (self.params, self.draft[1])

    def generator(self, sampling: SamplingParams, eos_id=None) -> Generator:
        eos_id = eos_id or self.tokenizer.eos_id
        if (sampling, eos_id) not in self._generators:
            self._generators[(sampling, eos_id)] = Generator(
                self.built.module,
                self.engine_params,
                sampling,
                eos_id=eos_id,
                max_len=generation_context(self.built.spec),
                mesh=self.built.mesh,
                rules=self.built.rules,
                config=self.config,
                draft=self.draft_module,
            )
        return self._generators[(sampling, eos_id)]

    def complete(self, prompts: list[str], sampling: SamplingParams, stop=(), stream=None) -> list[dict]:
        return complete(self.generator(sampling), self.tokenizer, prompts, stop=stop, stream=stream)

    def chat(self, conversations: list, sampling: SamplingParams, stop=(), stream=None) -> list[dict]:
        """Assistant replies to conversations (each ending with a user turn, or a string: one user
        turn), with the chat template."""
        prompts, template = chat_prompts(self.tokenizer, conversations)
        return complete_ids(
            self.generator(sampling, template.stop_ids),
            self.tokenizer,
            prompts,
            stop=tuple(stop) + template.stop_strings,
            stream=stream,
        )


def place_params(built, params, quantize: str | None = None):
    """Params on `built`'s mesh, quantized on the way when asked ("none" or None: as they are)."""
    if quantize in (None, "none"):
        return built.place(params)
    return quantize_for_inference(built, params, quantize)


def load_draft(path: str):
    """A draft model from an `lm train` workdir, an `lm export` or a Hugging Face directory."""
    run_dir = (pathlib.Path(path) / "checkpoints").is_dir()
    return load_trained(path if run_dir else None, None if run_dir else path)
