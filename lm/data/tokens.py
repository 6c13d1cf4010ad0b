"""On-disk helpers shared by the data files: atomic writes and the token dtype.

Every data file is written to a temp file in the same directory, fsynced and
renamed, so a reader sees the old file or the complete new one, never a half.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from lm.outputs import file_mode


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "wb"):
    """Write to a temp file in the same dir; fsync and rename over `path` only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, file_mode())  # mkstemp's 0600 would stay on the renamed file: the umask's mode instead
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (half the disk and page cache), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
