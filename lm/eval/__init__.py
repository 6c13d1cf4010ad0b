"""Evaluation: held-out answers generated with the chat template and scored (more to come:
bits per byte per set, multiple choice, contamination)."""
