"""Safetensors files read piece by piece and written in shards, without a whole-model host copy.

Reading: a checkpoint directory's tensors (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) are indexed from their headers; a tensor, or a range of its
rows, is read with positioned reads straight into a fresh array. Nothing is memory-mapped: the
pages of a mapping would count in the process's resident memory until it is closed, and a
loader that places each piece on its devices at once never needs them again.

Writing: tensors are streamed into shards of at most `max_bytes` with the index Hugging Face
writes (`model.safetensors.index.json`), or into one `model.safetensors` when they fit.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct

import ml_dtypes
import numpy as np

from lm.errors import UserError

DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


ALIGN = 64  # XLA:CPU takes a host buffer without copying it only when it is 64-byte aligned


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """np.empty, starting on an ALIGN-byte boundary (numpy's large arrays start 16 bytes past a page)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class TensorFiles:
    """The tensors of a checkpoint directory, by name: shape, dtype, and reads of all or some rows."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        self.entries: dict[str, tuple[pathlib.Path, np.dtype, tuple, int]] = {}
        for path in self._files():
            self._index(path)

    def _files(self) -> list[pathlib.Path]:
        index = self.directory / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise UserError(f"{index}: not a safetensors index (expected a 'weight_map' object): {e}") from None
            return [self.directory / f for f in sorted(set(weight_map.values()))]
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"'{self.directory}' holds no *.safetensors file and no {INDEX}")
        return files

    def _index(self, path: pathlib.Path) -> None:
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise UserError(f"{path}: not a readable safetensors file: {e}") from None
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                raise UserError(f"{path}: tensor '{name}' has dtype {info['dtype']}, which lm does not read")
            dtype = np.dtype(DTYPES[info["dtype"]])
            start, end = info["data_offsets"]
            shape = tuple(info["shape"])
            if end - start != math.prod(shape) * dtype.itemsize or 8 + n + end > size:
                raise UserError(f"{path}: tensor '{name}' is cut short or malformed ({end - start} bytes for "
                                f"shape {shape} {info['dtype']}; file has {size} bytes)")
            self.entries[name] = (path, dtype, shape, 8 + n + start)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][1]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, or rows [start, stop) of its first axis: one positioned read."""
        path, dtype, shape, offset = self.entries[name]
        start, stop = (0, shape[0] if shape else 1) if rows is None else (rows.start or 0, rows.stop)
        row = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        out = aligned_empty(((stop - start),) + shape[1:] if shape else (), dtype)
        with open(path, "rb") as f:
            n = os.preadv(f.fileno(), [memoryview(out.reshape(-1).view(np.uint8))], offset + start * row)
        if n != out.nbytes:
            raise UserError(f"{path}: tensor '{name}' ends early ({n} of {out.nbytes} bytes read)")
        return out


def write_sharded(directory, tensors, max_bytes: int = 5 * 2**30, metadata: dict | None = None) -> list[str]:
    """Writes (name, array) pairs, an iterable consumed once, into shards of at most max_bytes
    (a larger tensor gets a shard of its own) and the index; one `model.safetensors` when all fit.
    Returns the file names written."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards, current, size, total = [], {}, 0, 0
    tmp = lambda i: directory / f".shard-{i:05d}.safetensors"
    for name, array in tensors:
        array = np.ascontiguousarray(array)
        if current and size + array.nbytes > max_bytes:
            save_file(current, str(tmp(len(shards))), metadata=metadata)
            shards.append(list(current))
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
        total += array.nbytes
    if current or not shards:
        save_file(current, str(tmp(len(shards))), metadata=metadata)
        shards.append(list(current))
    if len(shards) == 1:
        tmp(0).replace(directory / SINGLE)
        return [SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, name in enumerate(names):
        tmp(i).replace(directory / name)
    weight_map = {t: names[i] for i, keys in enumerate(shards) for t in keys}
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names + [INDEX]


def write_streamed(path, tensors, metadata: dict | None = None) -> int:
    """One safetensors file from (name, leaf) pairs whose leaves know their shape and dtype
    (numpy, jax or lazy arrays): the header first, then each leaf read and written in turn, so
    only one tensor is on the host at a time. Returns the bytes of tensor data written."""
    path = pathlib.Path(path)
    entries, offset = [], 0
    for name, leaf in tensors:
        dtype = np.dtype(leaf.dtype)
        if dtype not in NAMES:
            raise UserError(f"{path}: tensor '{name}' has dtype {dtype}, which safetensors files here do not hold")
        size = math.prod(leaf.shape) * dtype.itemsize
        entries.append((name, leaf, dtype, offset, offset + size))
        offset += size
    header = {name: {"dtype": NAMES[dtype], "shape": list(leaf.shape), "data_offsets": [start, end]}
              for name, leaf, dtype, start, end in entries}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, leaf, dtype, start, end in entries:
            data = np.ascontiguousarray(np.asarray(leaf), dtype=dtype)
            f.write(memoryview(data.reshape(-1).view(np.uint8)))
    tmp.replace(path)
    return offset
