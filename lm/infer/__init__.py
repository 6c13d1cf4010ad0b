"""Inference: the KV-cache sampler (`generate.Generator`), text completion, `lm sample`."""

from lm.infer.load import load_trained
from lm.infer.sampling import SamplingParams
from lm.infer.session import Session

__all__ = ["SamplingParams", "Session", "load_trained"]
