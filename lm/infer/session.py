"""A loaded model placed on the mesh of its config, ready to complete prompts."""

from __future__ import annotations

from lm.config import rules_table
from lm.data.chat import chat_prompts
from lm.infer.engine.engine import EngineConfig
from lm.infer.generate import Generator, generation_context
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete, complete_ids
from lm.model.build import build_model
from lm.model.quant import quantize_for_inference


class Session:
    """Builds the model of its config on its mesh, places the params with their shardings, and
    keeps one compiled generator per sampling setting. quantize: "int8" or "int4" weight-only
    quantization (lm.model.quant), applied weight by weight as the params are placed. slots: the
    engine's requests decoded together (default: every prompt of a call at once); kv_cache: the KV
    cache's pages as "int8" or "fp8" ("": the compute dtype); speculate: prompt-lookup drafts per
    row and step (0: off)."""

    def __init__(
        self,
        loaded,
        devices=None,
        quantize: str | None = None,
        slots: int | None = None,
        kv_cache: str = "",
        speculate: int = 0,
    ):
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        engine = dict(kv_cache=kv_cache, speculate=speculate)
        self.config = EngineConfig(slots=slots or 16, **engine) if slots or kv_cache or speculate else None
        self.built = build_model(loaded.config, devices, rules=rules_table(loaded.config))
        self.built.check(loaded.params, loaded.source)
        self.params = place_params(self.built, loaded.params, quantize)
        self._generators: dict = {}

    def generator(self, sampling: SamplingParams, eos_id=None) -> Generator:
        eos_id = eos_id or self.tokenizer.eos_id
        if (sampling, eos_id) not in self._generators:
            self._generators[(sampling, eos_id)] = Generator(
                self.built.module,
                self.params,
                sampling,
                eos_id=eos_id,
                max_len=generation_context(self.built.spec),
                mesh=self.built.mesh,
                rules=self.built.rules,
                config=self.config,
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
