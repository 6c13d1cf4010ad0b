"""What the server asks of a model (`Backend`, `Stream`, `Delta`): the server talks to nothing else.
lm.infer.serve.engine_backend provides it over the engine."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Protocol

from lm.infer.sampling import SamplingParams
from lm.infer.serve.metrics import Load
from lm.infer.serve.tools import ToolSyntax


@dataclasses.dataclass
class Delta:
    """One piece of a completion as it is generated."""

    text: str  # new text since the previous Delta (may be "")
    token_ids: list[int]  # new token ids since the previous Delta
    finish_reason: str | None  # None while running; then "stop" | "length" | "cancelled"


class Stream(Protocol):
    prompt_tokens: int

    def __iter__(self) -> Iterator[Delta]: ...  # blocking; ends after the Delta with a finish_reason

    def cancel(self) -> None: ...


class Backend(Protocol):
    model_name: str  # what /v1/models lists and a request's `model` must equal
    context: int  # positions a prompt and its new tokens may take
    tool_syntax: ToolSyntax  # what the chat template does with tools (optional: a backend without one takes none)

    def prompt_ids(
        self, prompt: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None
    ) -> tuple[list[int], tuple[str, ...]]:
        """Token ids of a plain prompt, or of a conversation rendered with the model's chat template
        and `tools` (then also the template's stop strings, to add to the request's). Bad messages:
        ValueError. `tools` is passed only to a backend whose tool_syntax renders them."""

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop: tuple[str, ...],
        grammar: str | None = None,
        keep: dict[int, str] | None = None,
    ) -> Stream: ...  # grammar: lm.infer.grammar's, the answer must follow it; keep: special ids written as text

    def load(self) -> Load: ...  # requests waiting and running now, the prefix cache's hit rate (any thread)

    def shutdown(self, cancel: bool) -> None: ...  # stop taking requests; finish or cancel the running ones


FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}  # -> OpenAI's reasons
