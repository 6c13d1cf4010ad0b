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
from lm.outputs import publish, replacing, temp_name

DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


ALIGN = 64  # XLA:CPU takes a host buffer without copying it only when it is 64-byte aligned


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """np.empty, starting on an ALIGN-byte boundary (numpy's large arrays start 16 bytes past a page)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start : start + nbytes].view(dtype).reshape(shape)


MAX_HEADER = 100_000_000  # bytes: the bound the safetensors library itself sets on a header
FLOATS = {"BF16", "F16", "F32", "F64"}


INF_BITS = {np.dtype(ml_dtypes.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}  # |x| >= this: Inf or NaN
BLOCK = 1 << 22  # values per step of the check


def nonfinite(x: np.ndarray) -> bool:
    """Whether a floating array holds a NaN or an infinity: one pass, in blocks of bounded memory
    (2-byte floats by their bits: all exponent bits set)."""
    x = np.asarray(x)
    if x.dtype in INF_BITS:
        flat, bits = x.reshape(-1).view(np.uint16), INF_BITS[x.dtype]
        buf = np.empty(min(BLOCK, flat.size), np.uint16)
        for i in range(0, flat.size, BLOCK):
            part = buf[: len(flat[i : i + BLOCK])]
            np.bitwise_and(flat[i : i + BLOCK], 0x7FFF, out=part)
            if int(part.max()) >= bits:
                return True
        return False
    if x.dtype.kind != "f":
        return False
    flat = x.reshape(-1)
    return any(not np.isfinite(flat[i : i + BLOCK]).all() for i in range(0, flat.size, BLOCK))


def refuse_nonfinite(x: np.ndarray, name: str, source) -> None:
    """A UserError naming the tensor when it holds a NaN or an infinity."""
    if nonfinite(x):
        raise UserError(
            f"{source}: tensor '{name}' holds non-finite values (NaN or Inf): the checkpoint is corrupt or diverged"
        )


def check_finite(tree, source: str, prefix: str = "") -> None:
    """Refuses a params tree (nested dicts of arrays) with a NaN or an infinity, naming the leaf."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            check_finite(value, source, f"{prefix}{key}/")
    elif nonfinite(np.asarray(tree)):
        raise UserError(
            f"{source}: param '{prefix.rstrip('/')}' holds non-finite values (NaN or Inf): the "
            "checkpoint is corrupt or diverged"
        )


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: pathlib.Path) -> tuple[dict, int]:
    """A safetensors file's header, checked before anything else is read: (the JSON object, the
    offset where tensor data starts). One UserError line naming the file otherwise."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UserError(
                    f"{path}: not a safetensors file ({size} bytes; expected an 8-byte header length first)"
                )
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > min(size - 8, MAX_HEADER):
                raise UserError(
                    f"{path}: not a safetensors file (header length {n}; expected 2 to "
                    f"{min(size - 8, MAX_HEADER)} for a file of {size} bytes)"
                )
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: not a readable safetensors file: {reason}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: safetensors header is a JSON {type(header).__name__}; expected an object of tensors")
    return header, 8 + n


def _check_entry(path: pathlib.Path, name: str, info, data: int, size: int) -> tuple:
    """(dtype, shape, start) of one header entry, checked against the file; a UserError otherwise."""
    where = f"{path}: tensor {name!r:.80}"
    if not isinstance(info, dict):
        raise UserError(
            f"{where}: header entry is a {type(info).__name__}; expected an object with dtype, shape and data_offsets"
        )
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise UserError(f"{where}: dtype {dtype!r:.40}; expected one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_int(d) for d in shape):
        raise UserError(f"{where}: shape {shape!r:.60}; expected a list of integers >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_int(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise UserError(f"{where}: data_offsets {offsets!r:.60}; expected [start, end] with 0 <= start <= end")
    start, end = offsets
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if end - start != math.prod(shape) * itemsize or data + end > size:
        raise UserError(
            f"{where} is cut short or malformed ({end - start} bytes at {start} for shape "
            f"{tuple(shape)} {dtype}, which needs {math.prod(shape) * itemsize}; the file has "
            f"{size - data} bytes of data)"
        )
    return np.dtype(DTYPES[dtype]), tuple(shape), data + start


class TensorFiles:
    """The tensors of a checkpoint directory, by name: shape, dtype, and reads of all or some rows.
    Headers and the index are checked when it is made; every read is checked for NaN and Inf."""

    def __init__(self, directory):
        self.directory = pathlib.Path(directory)
        self.entries: dict[str, tuple[pathlib.Path, np.dtype, tuple, int]] = {}
        weight_map = self._weight_map()
        files = sorted(set(weight_map.values())) if weight_map is not None else self._files()
        for path in files:
            self._index(path)
        for name, path in (weight_map or {}).items():
            if name not in self.entries or self.entries[name][0] != path:
                raise UserError(
                    f"{self.directory / INDEX}: weight_map puts {name!r:.80} in '{path.name}', whose "
                    "header does not hold it"
                )

    def _weight_map(self) -> dict[str, pathlib.Path] | None:
        """The index's tensor -> file map (None without an index), checked: an object of names to the
        names of files in this directory."""
        index = self.directory / INDEX
        if not index.is_file():
            return None
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, RecursionError, AttributeError) as e:
            raise UserError(f"{index}: not a safetensors index: {str(e).splitlines()[0] if str(e) else e!r}") from None
        if not isinstance(weight_map, dict):
            raise UserError(
                f"{index}: 'weight_map' is {type(weight_map).__name__}; expected an object of tensor "
                "names to file names"
            )
        out = {}
        for name, file in weight_map.items():
            if (
                not isinstance(file, str)
                or "\0" in file
                or pathlib.PurePath(file).name != file
                or file in ("", ".", "..")
            ):
                raise UserError(
                    f"{index}: weight_map[{name!r:.80}] = {file!r:.60}; expected the name of a file in "
                    f"'{self.directory}'"
                )
            try:
                found = (self.directory / file).is_file()
            except (OSError, ValueError):
                found = False
            if not found:
                raise UserError(
                    f"{index}: weight_map[{name!r:.80}] names {file!r:.60}, which is not in '{self.directory}'"
                )
            out[name] = self.directory / file
        return out

    def _files(self) -> list[pathlib.Path]:
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"'{self.directory}' holds no *.safetensors file and no {INDEX}")
        return files

    def _index(self, path: pathlib.Path) -> None:
        header, data = read_header(path)
        size = path.stat().st_size
        for name, info in header.items():
            if name == "__metadata__":
                if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                    raise UserError(f"{path}: header '__metadata__' = {info!r:.60}; expected an object of strings")
                continue
            dtype, shape, start = _check_entry(path, name, info, data, size)
            if name in self.entries and self.entries[name][0] != path:
                raise UserError(f"{path}: tensor '{name:.80}' is also in {self.entries[name][0].name}")
            self.entries[name] = (path, dtype, shape, start)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple:
        return self.entries[name][2]

    def dtype(self, name: str) -> np.dtype:
        return self.entries[name][1]

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """The tensor, or rows [start, stop) of its first axis: one positioned read, refused when it
        holds a NaN or an infinity."""
        path, dtype, shape, offset = self.entries[name]
        start, stop = (0, shape[0] if shape else 1) if rows is None else (rows.start or 0, rows.stop)
        row = math.prod(shape[1:]) * dtype.itemsize if shape else dtype.itemsize
        out = aligned_empty(((stop - start),) + shape[1:] if shape else (), dtype)
        with open(path, "rb") as f:
            n = os.preadv(f.fileno(), [memoryview(out.reshape(-1).view(np.uint8))], offset + start * row)
        if n != out.nbytes:
            raise UserError(f"{path}: tensor '{name}' ends early ({n} of {out.nbytes} bytes read)")
        refuse_nonfinite(out, name, path)
        return out


def write_sharded(directory, tensors, max_bytes: int = 5 * 2**30, metadata: dict | None = None) -> list[str]:
    """Writes (name, array) pairs, an iterable consumed once, into shards of at most max_bytes
    (a larger tensor gets a shard of its own) and the index; one `model.safetensors` when all fit.
    Returns the file names written. Shards are written under temporary names and renamed when all
    are done; the weight files of an earlier write that this one does not replace (other shard
    names, a single file or an index) are removed then, and nothing else in the directory."""
    from safetensors.numpy import save_file

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards, current, size, total, temps = [], {}, 0, 0, []

    def save(part: dict) -> None:
        temps.append(temp_name(directory / f"shard-{len(temps):05d}.safetensors"))
        save_file(part, str(temps[-1]), metadata=metadata)
        shards.append(list(part))

    try:
        for name, array in tensors:
            array = np.ascontiguousarray(array)
            if current and size + array.nbytes > max_bytes:
                save(current)
                current, size = {}, 0
            current[name] = array
            size += array.nbytes
            total += array.nbytes
        if current or not shards:
            save(current)
    except BaseException:
        for path in temps:
            path.unlink(missing_ok=True)
        raise
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    stale = {directory / SINGLE, directory / INDEX, *directory.glob("model-*-of-*.safetensors")}
    stale -= {directory / n for n in names}
    for path, name in zip(temps, names):
        publish(path, directory / name)
    if len(shards) > 1:
        weight_map = {t: names[i] for i, keys in enumerate(shards) for t in keys}
        with replacing(directory / INDEX) as tmp:
            tmp.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        stale.discard(directory / INDEX)
    for path in stale:  # after the new files are in place
        path.unlink(missing_ok=True)
    return names if len(shards) == 1 else names + [INDEX]


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
    header = {
        name: {"dtype": NAMES[dtype], "shape": list(leaf.shape), "data_offsets": [start, end]}
        for name, leaf, dtype, start, end in entries
    }
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with replacing(path) as tmp, open(tmp, "wb") as f:  # an interrupted write leaves `path` as it was
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, leaf, dtype, start, end in entries:
            data = np.ascontiguousarray(np.asarray(leaf), dtype=dtype)
            f.write(memoryview(data.reshape(-1).view(np.uint8)))
    return offset
