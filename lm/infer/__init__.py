"""Inference: the KV-cache sampler (`generate.Generator`), text completion, `lm sample`."""

from lm.infer.sampling import SamplingParams
from lm.infer.session import Session
from lm.store.load import load_trained

__all__ = ["SamplingParams", "Session", "load_trained"]
