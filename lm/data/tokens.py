"""On-disk helpers shared by the data files: atomic writes and the token dtype.

Every data file is written to a temp file in the same directory, fsynced and
renamed, so a reader sees the old file or the complete new one, never a half.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lm.outputs import atomic_open  # noqa: F401 (the data files' writer, re-exported)


def write_json(path: Path, obj) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
