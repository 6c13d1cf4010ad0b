"""A loaded model placed on the mesh of its config, ready to complete prompts."""

from __future__ import annotations

import jax

from lm.errors import UserError
from lm.infer.generate import Generator
from lm.infer.sampling import SamplingParams
from lm.infer.text import complete, complete_ids
from lm.train.setup import build_run


class Session:
    """Builds the run of the model's config (mesh, rule table, model), places the params with
    their training shardings, and keeps one compiled generator per sampling setting."""

    def __init__(self, loaded, devices=None):
        self.loaded, self.tokenizer = loaded, loaded.tokenizer
        self.run = build_run(loaded.config, devices=devices)
        self.params = jax.device_put(loaded.params, self.run.state_shardings.params)
        self._generators: dict = {}

    def generator(self, sampling: SamplingParams, eos_id=None) -> Generator:
        eos_id = eos_id or self.tokenizer.eos_id
        if (sampling, eos_id) not in self._generators:
            self._generators[(sampling, eos_id)] = Generator(
                self.run.model, self.params, sampling, eos_id=eos_id,
                max_len=self.run.spec.max_seq_len, mesh=self.run.mesh, rules=self.run.rules)
        return self._generators[(sampling, eos_id)]

    def complete(self, prompts: list[str], sampling: SamplingParams, stop=(), stream=None) -> list[dict]:
        return complete(self.generator(sampling), self.tokenizer, prompts, stop=stop, stream=stream)

    def chat(self, conversations: list[list[dict]], sampling: SamplingParams, stop=(), stream=None) -> list[dict]:
        """Assistant replies to conversations (each ending with a user turn), with the chat template."""
        from lm.data.chat import ChatTemplate, check_messages

        template = ChatTemplate.for_tokenizer(self.tokenizer)
        prompts = []
        for i, messages in enumerate(conversations):
            try:
                check_messages(messages, for_prompt=True)
            except ValueError as e:
                raise UserError(f"conversation {i}: {e}") from None
            prompts.append([int(t) for t in template.prompt(messages)])
        return complete_ids(self.generator(sampling, template.stop_ids), self.tokenizer, prompts,
                            stop=tuple(stop) + template.stop_strings, stream=stream)
