"""lm: train language models end to end in JAX/Flax."""

__version__ = "0.1.0"
