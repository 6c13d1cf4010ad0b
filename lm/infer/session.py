"""A loaded model placed on the mesh of its config, ready to complete prompts."""

from __future__ import annotations

import jax

from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete
from lm.train.setup import build_run


class Session:
    """Builds the run of the model's config (mesh, rule table, model), places the params with
    their training shardings, and keeps one compiled generator per sampling setting."""

    def __init__(self, loaded, devices=None):
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.run = build_run(loaded.config, devices=devices)
        self.params = jax.device_put(loaded.params, self.run.state_shardings.params)
        self._generators: dict = {}

    def generator(self, sampling: SamplingParams) -> Generator:
        if sampling not in self._generators:
            self._generators[sampling] = Generator(
                self.run.model, self.params, sampling, eos_id=self.tokenizer.eos_id,
                max_len=self.run.spec.max_seq_len, mesh=self.run.mesh, rules=self.run.rules)
        return self._generators[sampling]

    def complete(self, prompts: list[str], sampling: SamplingParams, stop=(), stream=None) -> list[dict]:
        return complete(self.generator(sampling), self.tokenizer, prompts, stop=stop, stream=stream)
