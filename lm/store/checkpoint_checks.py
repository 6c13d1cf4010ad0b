"""What makes a training checkpoint trustworthy, and what is said when it is not.

Every item a checkpoint restores is covered by a checksum recorded in its meta item:
  state   an order-sensitive 64-bit hash of the raw bits of each leaf (params, optimizer state,
          rng, step), computed where the arrays are (older checkpoints: a wrapping uint32 sum);
  data    a sha256 of each process's grain iterator state (data/process_I-of-N.json): the
          position of the training batches, and of the RL prompt stream;
  meta    a sha256 of the meta item itself (config, shapes, checksums, the loop's fault counters).
Faults are described in one line naming the item and the file; orbax's and TensorStore's
background threads echo the same failure as tracebacks, which are kept off stderr.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import pathlib
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

from lm.sharding import to_host


class Damaged(ValueError):
    """A checkpoint item that does not match what was saved; the message is the whole reason."""


# ---- checksums -------------------------------------------------------------------------------


def _as_u32(x):
    bits = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)


@jax.jit
def _leaf_sums(tree):
    # the checksums of checkpoints saved before HASH: uint32 addition wraps, so the sum is exact
    return [jnp.sum(_as_u32(x), dtype=jnp.uint32) for x in jax.tree.leaves(tree)]


HASH = "mix64"  # meta["checksum_kind"] of the hash below; a meta without one holds wrapping sums


def _mix(h):
    """murmur3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _global_index(shape):
    """Each element's row-major index in the whole array, as uint32 (built from iotas: no reshape,
    so a sharded array is hashed where its shards are)."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


@jax.jit
def _leaf_hashes(tree):
    # sum over elements of mix(value bits, global index): wrapping addition is exact in any order
    # (sharding and reduction order do not matter) while the index makes it order-sensitive.
    out = []
    for x in jax.tree.leaves(tree):
        bits, index = _as_u32(x), _global_index(x.shape)
        lanes = [
            jnp.sum(_mix(_mix(index ^ jnp.uint32(seed)) ^ (bits * jnp.uint32(0x9E3779B1))), dtype=jnp.uint32)
            for seed in (0x3C6EF372, 0xA54FF53A)
        ]
        out.append(jnp.stack(lanes))
    return out


def checksums(tree, kind: str | None = HASH) -> list[int]:
    """One checksum per leaf: HASH (a 64-bit hash that any changed, swapped or moved element
    changes), or the wrapping uint32 sum of older checkpoints (kind None)."""
    if kind != HASH:
        return [int(v) for v in jax.device_get(_leaf_sums(tree))]
    return [int(v[0]) << 32 | int(v[1]) for v in jax.device_get(_leaf_hashes(tree))]


def _json_digest(value) -> str:
    """sha256 of a JSON value in one canonical spelling (key order and whitespace do not count)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def data_file(process: int, count: int) -> str:
    """The name grain's orbax handler gives one process's iterator state inside the data item."""
    return f"process_{process}-of-{count}.json"


def data_checksums(data_iter) -> dict[str, str]:
    """{file name: sha256} of every process's iterator state, the same dict on every process
    (process 0 writes the meta item, so it must know the digests of the others)."""
    state = data_iter.get_state()
    state = json.loads(state.decode() if isinstance(state, bytes) else json.dumps(state))
    digest = np.frombuffer(bytes.fromhex(_json_digest(state)), np.uint8)
    count = jax.process_count()
    digests = np.asarray(to_host(digest[None]))  # [processes, 32]
    return {data_file(i, count): bytes(d).hex() for i, d in enumerate(digests)}


def verify_data(step_dir: pathlib.Path, saved: dict[str, str]) -> None:
    """Every process's data state file must hold what was saved; each process checks them all
    (the checkpoint directory is shared), so all reach the same verdict without a collective."""
    for name, want in sorted(saved.items()):
        path = step_dir / "data" / name
        where = f"data state '{path.relative_to(step_dir.parent)}'"
        if not path.is_file():
            raise Damaged(f"{where} is missing")
        try:
            got = _json_digest(json.loads(path.read_text()))
        except (ValueError, UnicodeDecodeError) as e:
            raise Damaged(f"{where} is not valid JSON ({_first_line(e)})") from e
        if got != want:
            raise Damaged(f"{where} differs from what was saved (sha256 {got[:12]}... != {want[:12]}...)")


def seal(meta: dict) -> dict:
    """meta as JSON will write it, plus the digest of everything else in it."""
    meta = json.loads(json.dumps(meta))
    return meta | {"meta_checksum": _json_digest(meta)}


def verify_meta(meta: dict, step_dir: pathlib.Path) -> None:
    body = {k: v for k, v in meta.items() if k != "meta_checksum"}
    if _json_digest(body) != meta["meta_checksum"]:
        where = step_dir / "meta" / "metadata"
        raise Damaged(
            f"meta '{where.relative_to(step_dir.parent)}' (config, shapes, checksums, fault counters) "
            "differs from what was saved"
        )


# ---- one-line descriptions of faults ---------------------------------------------------------


def _first_line(error: BaseException) -> str:
    text = str(error).split(" See full TensorStore details")[0].strip().splitlines()
    return (text[0] if text else repr(error))[:300]


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


_TS_READ = re.compile(r'Error reading "([^"]+)" in OCDBT database at local file "([^"]+)"')
_TS_FILE = re.compile(r'(?:Failed writing: |of local file )"([^"]+)"')


def describe(error: BaseException, step_dir: pathlib.Path | None = None) -> str:
    """One line for a failed read or write: the item, the array and the file where they are known."""
    if isinstance(error, Damaged):
        return str(error)
    messages = [str(e) for e in _chain(error)]
    if any("No space left on device" in m for m in messages) or any(
        getattr(e, "errno", None) == 28 for e in _chain(error)
    ):
        files = [f for m in messages for f in _TS_FILE.findall(m)]
        return "no space left on device" + (f" (writing '{files[0]}')" if files else "")
    for m in messages:
        read = _TS_READ.search(m)
        if read:
            return _read_fault(read.group(1), pathlib.Path(read.group(2)), m, step_dir)
    plain = next((e for e in _chain(error) if "TensorStore details" not in str(e)), error)
    return f"{type(plain).__name__}: {_first_line(plain)}"


_ACCESS_ERRNOS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "input/output error",
    errno.EROFS: "read-only file system",
    errno.ESTALE: "stale file handle",
    errno.ENOTCONN: "storage not connected",
    errno.ETIMEDOUT: "storage timed out",
}
_ACCESS_TEXT = {
    "Permission denied": "permission denied",
    "PERMISSION_DENIED": "permission denied",
    "Input/output error": "input/output error",
    "Read-only file system": "read-only file system",
}


def access_fault(error: BaseException) -> str | None:
    """What keeps a checkpoint from being read when the fault is the storage's, not the files'
    (permissions, I/O errors): None for damage. Such a checkpoint may be intact once the
    storage is fixed, so it is never set aside."""
    for e in _chain(error):
        if getattr(e, "errno", None) in _ACCESS_ERRNOS:
            return _ACCESS_ERRNOS[e.errno]
        found = next((v for k, v in _ACCESS_TEXT.items() if k in str(e)), None)
        if found:
            return found
    return None


def _array(key: bytes | str) -> str:
    """OCDBT key of a chunk ('params.embedding/0.0') -> the array's name as the meta item writes it."""
    key = key.decode(errors="replace") if isinstance(key, bytes) else key
    return key.rsplit("/", 1)[0].replace(".", "/")


def _shown(path: pathlib.Path, step_dir) -> str:
    return str(path.relative_to(step_dir.parent)) if step_dir is not None and step_dir in path.parents else str(path)


_TS_RANGE = re.compile(r"Requested byte range \[\d+, (\d+)\) is not valid for value of size (\d+)")


def _read_fault(key: str, database: pathlib.Path, message: str, step_dir) -> str:
    where = f"{database.name} array '{_array(key)}'"
    detail = message.split(" [tensorstore_spec=")[0].rsplit(": ", 1)[-1][:200]
    named = _TS_FILE.search(message)  # a damaged index node names its own file
    found = pathlib.Path(named.group(1)) if named else _file_of(database, key.encode())
    if found is None:
        return f"{where} cannot be read ({message.split(':', 1)[0]}: {detail})"
    short = _TS_RANGE.search(message)
    fault = _file_fault(found, None) or (
        f"is truncated ({short.group(2)} of {short.group(1)} bytes)" if short else f"cannot be read ({detail})"
    )
    return f"{where}: file '{_shown(found, step_dir)}' {fault}"


def _file_fault(path: pathlib.Path, end: int | None) -> str | None:
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    return f"is truncated ({size} of {end} bytes)" if end is not None and size < end else None


def index_entries(item_dir: pathlib.Path):
    """(kind, key, file, end) of every B-tree node and every chunk kept outside it, from the item's
    OCDBT manifest; the node files are checked before they are read."""
    import tensorstore as ts
    from tensorstore import ocdbt

    base = ts.KvStore.open(f"file://{item_dir}/").result()
    versions = ocdbt.dump(base).result().get("versions", [])
    pending = [(b"", versions[-1]["root"]["location"])] if versions and "location" in versions[-1]["root"] else []
    while pending:
        key, location = pending.pop()
        kind, prefix, rel, offset, length = location.split(":")
        path = item_dir / prefix / rel
        yield kind, key, path, int(offset) + int(length)
        if kind != "btreenode" or _file_fault(path, int(offset) + int(length)):
            continue
        for entry in ocdbt.dump(base, location).result().get("entries", []):
            for ref in _strings(entry):
                if ref.startswith(("btreenode:", "value:")):
                    pending.append((entry.get("key", key), ref))


def _strings(entry: dict):
    for value in entry.values():
        if isinstance(value, dict):
            yield from _strings(value)
        elif isinstance(value, str):
            yield value


def verify_array_files(item_dir: pathlib.Path) -> None:
    """Every file the item's index points to must exist and hold the bytes it should: a missing or
    truncated file is named here, before orbax starts reading arrays in parallel."""
    if not (item_dir / "manifest.ocdbt").is_file():
        return  # not an OCDBT item: orbax's own checks apply
    step_dir = item_dir.parent
    for kind, key, path, end in index_entries(item_dir):
        fault = _file_fault(path, end)
        if fault:
            what = f"array '{_array(key)}'" if kind == "value" else "index"
            raise Damaged(f"{item_dir.name} {what}: file '{_shown(path, step_dir)}' {fault}")


def _file_of(database: pathlib.Path, key: bytes) -> pathlib.Path | None:
    """The file that holds the chunk `key` in an OCDBT database (None if unknown)."""
    try:
        return next((path for kind, k, path, _ in index_entries(database) if kind == "value" and k == key), None)
    except Exception:  # noqa: BLE001 - naming the file is a courtesy; the fault is reported anyway
        return None


# ---- orbax's background threads --------------------------------------------------------------

_ECHOES = (
    "_SignalingThread.run() raised an exception",
    "in background save thread",
    "Save Finalize thread",
    "one or more items may not be finalized",
    "Failed to write metadata",
    "Failed to update metadata",
)


def _from_orbax(error: BaseException | None) -> bool:
    for e in _chain(error) if error is not None else ():
        if "TensorStore" in str(e) or "OCDBT" in str(e):
            return True
        tb = e.__traceback__
        while tb is not None:
            if "/orbax/" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
    return False


def _loop_closed(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


class _DropEchoes(logging.Filter):
    """orbax logs a failed background save with its traceback from each thread it ran in; the
    Checkpointer reports that failure once, naming the step (absl logger). asyncio logs the
    reads orbax left behind when one array of a restore failed ('exception was never retrieved')."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if record.name == "absl":
            return not (
                record.levelno >= logging.ERROR and "/orbax/" in record.pathname and any(e in message for e in _ECHOES)
            )
        error = record.exc_info[1] if record.exc_info else None
        return not ("exception was never retrieved" in message and (_from_orbax(error) or "OCDBT" in message))


_FILTER = _DropEchoes()


def _unraisable(hook):
    def quiet(unraisable):
        code = getattr(getattr(unraisable, "object", None), "cr_code", None)
        if _loop_closed(unraisable.exc_value) or (code is not None and "/orbax/" in code.co_filename):
            return  # a read or write orbax abandoned after the first failure, or its closed loop
        hook(unraisable)

    quiet.lm_quiet = True
    return quiet


def _thread_hook(hook):
    def quiet(args):
        if _loop_closed(args.exc_value):
            return
        hook(args)

    quiet.lm_quiet = True
    return quiet


def quiet_background_threads() -> None:
    """When a save or a restore fails, orbax leaves reads and writes running on event loops it
    has closed; their callbacks raise 'Event loop is closed' and their coroutines are collected
    with the original error. The failure itself is reported once, as one line: this keeps those
    echoes off stderr. Idempotent (a test runner may have swapped the hooks in between)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if not getattr(sys.unraisablehook, "lm_quiet", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)
    if not getattr(threading.excepthook, "lm_quiet", False):
        threading.excepthook = _thread_hook(threading.excepthook)
