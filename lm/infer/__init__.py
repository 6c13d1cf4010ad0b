"""Inference: the generation engine (`engine/`: paged KV cache, continuous batching) behind
`generate.Generator`, text completion, `lm sample`, quantized weights at load, speculative
decoding, and `lm serve` (`serve/`)."""

__all__ = ["SamplingParams", "Session", "load_trained"]


def __getattr__(name: str):
    # imported on first use: `lm`'s parser reads lm.infer.cli and must not import jax
    if name == "SamplingParams":
        from lm.infer.sampling import SamplingParams

        return SamplingParams
    if name == "Session":
        from lm.infer.session import Session

        return Session
    if name == "load_trained":
        from lm.store.load import load_trained

        return load_trained
    raise AttributeError(f"module 'lm.infer' has no attribute {name!r}")
