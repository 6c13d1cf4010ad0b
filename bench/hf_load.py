"""Loading a Hugging Face checkpoint: wall time and peak host memory of `lm` against transformers.

Writes (once, cached under --dir) a random bf16 Llama checkpoint with transformers, sharded with
an index, then measures in a fresh subprocess each (so each peak RSS is its own):

  lm        lm.store.hf.reader.load_hf + build_model + Built.place on one CPU device, mesh (1,1,1)
  lm-mesh   the same on 4 simulated CPU devices, mesh (1,4,1) (data=1, fsdp=4, tensor=1)
  hf        transformers AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16); it maps
            the files copy-on-write and reads nothing, so it has two rows: "hf lazy" when it
            returns, "hf touched" after reading every weight once (a byte checksum)

and the baseline of a child that only imports what the loader imports (jax + lm, on 1 or 4
devices; torch + transformers) and loads nothing, so that a loader's own memory reads as
RSS - baseline. Every lm child blocks until its arrays are materialised, then checks two tensors
element by element against the safetensors files (read here with their own header parsing) and
a byte checksum of every params leaf against every tensor in the files. Rounds are interleaved
(base, lm, base, lm-mesh, base, hf, ...). Peak RSS is the kernel's high-water mark (VmHWM,
equal to ru_maxrss) taken right after loading, before the checks; the target is
peak RSS <= 1.25x the checkpoint's size on disk, judged on RSS - baseline.

    PYTHONPATH=. python bench/hf_load.py --quick        # ~124M params, ~240 MiB, ~1.5 min
    PYTHONPATH=. python bench/hf_load.py                # ~1.1B params, ~2 GiB, ~6 min on 2 cores
    PYTHONPATH=. python bench/hf_load.py --rounds 0 --trace   # where the lm loader's memory goes
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30
TARGET = 1.25  # peak RSS <= TARGET x checkpoint size on disk
MESH_DEVICES = 4
SIZES = {  # LlamaConfig keys; shard: save_pretrained's max_shard_size
    "full": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        shard="1GB",
    ),
    "quick": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        vocab_size=32000,
        shard="100MB",
    ),
}
LOADERS = {"lm": ("base-lm", 1), "lm-mesh": ("base-lm-mesh", MESH_DEVICES), "hf": ("base-hf", 1)}  # baseline, devices
BASELINES = {"base-lm": 1, "base-lm-mesh": MESH_DEVICES, "base-hf": 1}


# ---------------------------------------------------------------------------------------------
# Memory readings (Linux /proc)


def status() -> dict:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes."""
    text = pathlib.Path("/proc/self/status").read_text()
    return {
        k: int(re.search(rf"^{k}:\s+(\d+) kB", text, re.M).group(1)) * 1024
        for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    }


def reset_hwm() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0), so a step's own peak can be read."""
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Samples VmRSS every `period` s; keeps the largest sample per phase (set with `mark`)."""

    def __init__(self, period: float = 0.002):
        super().__init__(daemon=True)
        self.period, self.phase, self.peaks, self.order = period, "start", {}, ["start"]
        self.running = True

    def mark(self, phase: str) -> None:
        self.phase = phase
        self.order.append(phase)
        self._sample()

    def _sample(self) -> None:
        rss = status()["VmRSS"]
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def run(self) -> None:
        while self.running:
            self._sample()
            time.sleep(self.period)

    def stop(self) -> dict:
        self.running = False
        self._sample()
        return {p: self.peaks[p] for p in dict.fromkeys(self.order) if p in self.peaks}


# ---------------------------------------------------------------------------------------------
# The safetensors files, read independently of lm.store.safetensors_files


def file_tensors(ckpt: pathlib.Path) -> dict:
    """name -> (path, dtype name, shape, byte offset) for every tensor of every shard."""
    out = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (path, info["dtype"], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
    return out


def raw_tensor(entry):
    """A bf16 tensor's bit patterns as uint16, read with np.fromfile."""
    import numpy as np

    path, dtype, shape, offset = entry
    assert dtype == "BF16", dtype
    return np.fromfile(path, np.uint16, count=int(np.prod(shape)), offset=offset).reshape(shape)


def file_checksum(ckpt: pathlib.Path) -> tuple[int, int]:
    """(sum of all tensors' bytes as uint64 mod 2**64, byte count): the same whatever the layout."""
    import numpy as np

    total, count = 0, 0
    for path, _, shape, offset in file_tensors(ckpt).values():
        size = int(np.prod(shape)) * 2
        with open(path, "rb") as f:
            f.seek(offset)
            for start in range(0, size, 64 * 2**20):
                chunk = np.frombuffer(f.read(min(64 * 2**20, size - start)), np.uint8)
                total = (total + int(chunk.sum(dtype=np.uint64))) % 2**64
                count += chunk.size
    return total, count


def disk_bytes(ckpt: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


# ---------------------------------------------------------------------------------------------
# The checkpoint


def make_checkpoint(size: str, root: pathlib.Path) -> pathlib.Path:
    """The cached checkpoint for `size`, written by a child (torch stays out of this process)."""
    ckpt = root / f"llama-{size}"
    stamp = json.dumps(SIZES[size], sort_keys=True)
    if (ckpt / "bench-done").is_file() and (ckpt / "bench-done").read_text() == stamp:
        return ckpt
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"writing the {size} checkpoint to {ckpt} (once) ...", flush=True)
    t = time.perf_counter()
    subprocess.run(
        [sys.executable, __file__, "--child", "create", "--size", size, "--ckpt", str(ckpt)],
        check=True,
        env=child_env(1),
    )
    (ckpt / "bench-done").write_text(stamp)
    print(f"  written in {time.perf_counter() - t:.0f} s", flush=True)
    return ckpt


def create(size: str, ckpt: pathlib.Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    shape = dict(SIZES[size])
    shard = shape.pop("shard")
    torch.manual_seed(0)
    config = LlamaConfig(
        **shape, max_position_embeddings=2048, tie_word_embeddings=False, initializer_range=0.02, dtype="bfloat16"
    )
    # Built directly in bf16 (no float32 copy); transformers' init draws N(0, 0.02) weights.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms are ones after init: make them random too, so checks see them
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size=shard)
    words = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        tmp
    )
    tmp.rename(ckpt)


# ---------------------------------------------------------------------------------------------
# Children: each prints one line 'RESULT {json}'


def import_lm():
    import jax

    import lm.model.build  # noqa: F401
    import lm.store.hf.reader  # noqa: F401

    return jax


def child_base(kind: str) -> dict:
    if kind == "base-hf":
        import torch  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
        from transformers import AutoModelForCausalLM  # noqa: F401
    else:
        jax = import_lm()
        assert len(jax.devices()) == BASELINES[kind]
    return {}


def leaf_at(params, path: str):
    for part in path.split("/"):
        params = params[part]
    return params


def check_lm(params, ckpt: pathlib.Path, n_layers: int) -> dict:
    """Two tensors element by element, then a byte checksum over all leaves against the files."""
    import jax
    import numpy as np

    files = file_tensors(ckpt)
    last = n_layers - 1
    checks = {  # leaf path -> (HF tensor, layer or None, transform to our layout)
        "embedding": ("model.embed_tokens.weight", None, lambda x: x),
        "blocks/mlp/w_down": (f"model.layers.{last}.mlp.down_proj.weight", last, lambda x: x.T),
    }
    compared = 0
    for path, (name, layer, to_ours) in checks.items():
        want = to_ours(raw_tensor(files[name]))
        arr = leaf_at(params, path)
        assert isinstance(arr, jax.Array) and arr.is_fully_addressable, type(arr)
        for shard in arr.addressable_shards:
            got = np.asarray(shard.data).view(np.uint16)
            index = shard.index
            if layer is not None:
                start = index[0].indices(arr.shape[0])[0]
                if not (start <= layer < start + got.shape[0]):
                    continue
                got, index = got[layer - start], index[1:]
            if not np.array_equal(got, want[index]):
                raise SystemExit(f"{path}: shard {shard.index} differs from {name} in the files")
            compared += got.size
    total, count = 0, 0
    for leaf in jax.tree.leaves(params):
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                data = np.asarray(shard.data).reshape(-1).view(np.uint8)
                total = (total + int(data.sum(dtype=np.uint64))) % 2**64
                count += data.size
    want_sum = file_checksum(ckpt)
    if (total, count) != want_sum:
        raise SystemExit(f"params checksum {(total, count)} != files' {want_sum}")
    return {"checked_elements": compared, "checksum_bytes": count}


def child_lm(ckpt: pathlib.Path, devices: int, sampler: Sampler, trace: bool) -> dict:
    jax = import_lm()
    from lm.config import rules_table
    from lm.model.build import build_model
    from lm.store.hf.reader import load_hf

    assert len(jax.devices()) == devices, jax.devices()
    out = {"after_import": status()["VmRSS"]}
    t0 = time.perf_counter()
    sampler.mark("load_hf")
    loaded = load_hf(ckpt)
    config = loaded.config
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, devices, 1
    sampler.mark("build_model")
    built = build_model(config, rules=rules_table(config))
    sampler.mark("place")
    if trace:
        params, out["trace"] = place_traced(built, loaded.params)
    else:
        params = built.place(loaded.params)
    sampler.mark("block")
    jax.block_until_ready(params)
    out["wall_s"] = time.perf_counter() - t0
    out["load"] = status()
    sampler.mark("check")
    out.update(check_lm(params, ckpt, config.model.n_layers))
    out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    out["disk_bytes"] = disk_bytes(ckpt)
    out["end"] = status()  # params still alive
    return out


def child_hf(ckpt: pathlib.Path, sampler: Sampler) -> dict:
    """from_pretrained, then a read of every weight (transformers 5 maps the safetensors files
    copy-on-write and reads nothing until a weight is touched), then the same checks as lm's."""
    import numpy as np
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM

    out = {"after_import": status()["VmRSS"]}
    t0 = time.perf_counter()
    sampler.mark("from_pretrained")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    out["wall_s"] = time.perf_counter() - t0
    out["load"] = status()
    out["mapped_files"] = sum(".safetensors" in line for line in open("/proc/self/maps"))
    sampler.mark("touch")
    sd = model.state_dict()
    total, count, seen = 0, 0, set()
    for t in sd.values():  # the byte checksum reads every weight in place, allocating nothing large
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        data = t.contiguous().view(torch.uint8).numpy().reshape(-1)
        total = (total + int(data.sum(dtype=np.uint64))) % 2**64
        count += data.size
    out["touch_wall_s"] = time.perf_counter() - t0
    out["touched"] = status()
    sampler.mark("check")
    files = file_tensors(ckpt)
    name = f"model.layers.{model.config.num_hidden_layers - 1}.mlp.down_proj.weight"
    for n in ("model.embed_tokens.weight", name):
        if not np.array_equal(sd[n].view(torch.int16).numpy().view(np.uint16), raw_tensor(files[n])):
            raise SystemExit(f"transformers: {n} differs from the files")
    if (total, count) != file_checksum(ckpt):
        raise SystemExit("transformers: params checksum differs from the files'")
    out["checksum_bytes"] = count
    out["param_bytes"] = count
    out["end"] = status()  # model still alive
    return out


def place_traced(built, lazy: dict):
    """Built.place cut up: first the placement of the largest stacked leaf and of the largest
    other leaf step by step, then every leaf in Built.place's order (the tree's), each with its
    own peak (VmHWM reset before each step)."""
    import jax

    from lm.sharding import placed_dtype

    flat = jax.tree_util.tree_flatten_with_path(lazy)[0]
    shardings = dict(jax.tree_util.tree_flatten_with_path(built.param_shardings)[0])
    name_of = lambda path: "/".join(str(getattr(k, "key", k)) for k in path)
    rows: list = []
    for stacked in (True, False):
        path, x = max((kv for kv in flat if kv[1].stacked == stacked), key=lambda kv: kv[1].nbytes)
        rows += split_steps(name_of(path), x, shardings[path], placed_dtype(x.dtype))
    placed = []
    for path, x in flat:
        name = name_of(path)
        tree: dict = {}
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = x
        one = measure(rows, f"place {name}", lambda: jax.block_until_ready(built.place(tree)))
        rows[-1]["nbytes"] = x.nbytes
        placed.append(leaf_at(one, name))
    return jax.tree.unflatten(jax.tree.structure(lazy), placed), rows


def measure(rows: list, label: str, fn):
    """fn(), recording RSS before, its peak (VmHWM reset first) and RSS after."""
    before = status()["VmRSS"]
    reset_hwm()
    value = fn()
    s = status()
    rows.append(
        dict(
            step=label,
            nbytes=sum(getattr(v, "nbytes", 0) for v in (value if isinstance(value, list) else [value])),
            before=before,
            peak=s["VmHWM"],
            after=s["VmRSS"],
        )
    )
    return value


def split_steps(name, x, sharding, dtype) -> list[dict]:
    """The largest leaf's placement in its steps, as lm.store.hf.reader.LazyTensor and
    lm.sharding.place_leaf take them, each with its own peak and what it leaves behind."""
    import gc

    import jax
    import numpy as np

    from lm.store.hf.families.common import layout_view

    rows: list = []
    indices = list(sharding.addressable_devices_indices_map(tuple(x.shape)).values())
    index = indices[0] + (slice(None),) * (x.ndim - len(indices[0]))
    per_layer = x.shape[1:] if x.stacked else x.shape
    one = x.names[-1]
    gc.collect()
    raw = measure(rows, f"{name}: TensorFiles.read of one HF tensor ({one})", lambda: x.files.read(one))
    part = index[1:] if x.stacked else index
    measure(
        rows,
        f"{name}: device 0's part of its layout view, copied",
        lambda: layout_view(x.kind, raw, per_layer)[part].copy(),
    )
    raw = None  # free the host copy before the next measure
    gc.collect()
    shards = measure(
        rows,
        f"{name}: x[index] for all {len(indices)} devices (the callbacks' arrays)",
        lambda: [np.asarray(x[i]).astype(dtype, copy=False) for i in indices],
    )
    arr = measure(
        rows,
        f"{name}: make_array_from_callback over those arrays",
        lambda: jax.block_until_ready(
            jax.make_array_from_callback(tuple(x.shape), sharding, lambda i: shards[indices.index(i)])
        ),
    )
    aligned = [int(s.ctypes.data % 64) for s in shards]
    alias = [np.asarray(s.data).ctypes.data == shards[k].ctypes.data for k, s in enumerate(arr.addressable_shards)]
    refs = [sys.getrefcount(s) - 2 for s in shards]  # minus the list's and getrefcount's own
    rows[-1]["note"] = (
        f"numpy data address mod 64: {aligned}; device buffer aliases the numpy array: {alias}; "
        f"other references to each numpy array still held: {refs}"
    )
    shards = None
    measure(rows, f"{name}: del the numpy arrays", lambda: None)
    rows[-1]["note"] = "their memory stays until jax's deferred release runs (Python's gc callback)"
    measure(rows, f"{name}: gc.collect()", gc.collect)
    del arr
    gc.collect()
    return rows


def child(args) -> None:
    sampler = Sampler()
    sampler.start()
    sampler.mark("import")
    ckpt = pathlib.Path(args.ckpt)
    if args.child == "create":
        create(args.size, ckpt)
        return
    if args.child in BASELINES:
        out = child_base(args.child)
    elif args.child == "hf":
        out = child_hf(ckpt, sampler)
    else:
        out = child_lm(ckpt, LOADERS[args.child][1], sampler, args.trace)
    out["phases"] = sampler.stop()
    out.setdefault("end", status())
    out["ru_maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.setdefault("load", out["end"])
    print("RESULT " + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent


def child_env(devices: int) -> dict:
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def run_child(kind: str, ckpt: pathlib.Path, trace: bool = False) -> dict:
    devices = BASELINES.get(kind) or LOADERS[kind][1]
    cmd = [sys.executable, __file__, "--child", kind, "--ckpt", str(ckpt)] + (["--trace"] if trace else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=child_env(devices), cwd=REPO)
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if p.returncode or not lines:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"child '{kind}' failed (exit {p.returncode})")
    out = json.loads(lines[-1][7:])
    out["process_s"] = time.perf_counter() - t
    return out


def gib(n: float) -> str:
    return f"{n / GIB:.2f}"


ROWS = [  # label, child kind, baseline kind, wall key, status key, judged against the target
    ("lm (1,1,1)", "lm", "base-lm", "wall_s", "load", True),
    (f"lm (1,{MESH_DEVICES},1)", "lm-mesh", "base-lm-mesh", "wall_s", "load", True),
    ("hf lazy", "hf", "base-hf", "wall_s", "load", False),
    ("hf touched", "hf", "base-hf", "touch_wall_s", "touched", False),
]


def report(ckpt: pathlib.Path, runs: dict) -> None:
    disk = disk_bytes(ckpt)
    shards = len(list(ckpt.glob("*.safetensors")))
    any_run = next(v[0] for k, v in runs.items() if k in LOADERS)
    rounds = max(len(v) for v in runs.values())
    print(
        f"\ncheckpoint: {ckpt}: {any_run['param_bytes'] / 2e9:.3f}B params, bf16, {shards} safetensors shards "
        f"+ index, {gib(disk)} GiB on disk (read from the page cache); {rounds} interleaved round(s)"
    )
    head = (
        f"{'loader':<13}{'wall s':>8}{'peak RSS':>10}{'baseline':>10}{'RSS-base':>10}"
        f"{'RSS/ckpt':>10}{'(RSS-base)/ckpt':>17}  target"
    )
    print(head)
    print("-" * (len(head) + 24))
    for label, kind, base_kind, wall_key, status_key, judged in ROWS:
        if kind not in runs:
            continue
        wall = statistics.median(r[wall_key] for r in runs[kind])
        peak = max(r[status_key]["VmHWM"] for r in runs[kind])
        base = statistics.median(r["end"]["VmHWM"] for r in runs[base_kind])
        own, total = (peak - base) / disk, peak / disk
        verdict = ""
        if judged:
            verdict = f"{'PASS' if own <= TARGET else 'FAIL'} (on total RSS: {'PASS' if total <= TARGET else 'FAIL'})"
        print(
            f"{label:<13}{wall:>8.2f}{gib(peak):>10}{gib(base):>10}{gib(peak - base):>10}"
            f"{total:>9.2f}x{own:>16.2f}x  {verdict}"
        )
    print(
        f"target: peak RSS <= {TARGET}x checkpoint size ({gib(TARGET * disk)} GiB), judged on RSS - baseline "
        "(the loader's own memory; the import baseline does not grow with the model); the verdict on total "
        "RSS in ()"
    )
    print(
        "GiB. wall: load call to arrays ready, imports excluded, median over rounds. peak RSS: VmHWM (= ru_maxrss) "
        "right after loading, max over rounds. baseline: median peak of a child that only imports the "
        "loader's modules (jax + lm on as many devices; torch + transformers). hf lazy: from_pretrained returns "
        "with the weights mapped copy-on-write from the files, unread; hf touched: after reading every weight "
        "once (a byte checksum), the pages then count in RSS as file-backed"
    )
    for kind in LOADERS:
        if kind not in runs:
            continue
        last = runs[kind][-1]
        phases = ", ".join(f"{p} {gib(v)}" for p, v in last["phases"].items() if p != "start")
        end = last["end"]
        print(
            f"  {kind}: max sampled VmRSS per phase (last round): {phases}; after the checks, model alive: "
            f"RssAnon {gib(end['RssAnon'])}, RssFile {gib(end['RssFile'])}, ru_maxrss {gib(last['ru_maxrss'])}"
        )


def report_trace(kind: str, out: dict) -> None:
    print(
        f"\n{kind}: Built.place cut up (GiB; peak: VmHWM reset before each step; params alone "
        f"{gib(out['param_bytes'])}, checkpoint on disk {gib(out['disk_bytes'])})"
    )
    print(f"  {'step':<100}{'size':>7}{'before':>8}{'peak':>7}{'after':>7}{'peak-before':>12}")
    for r in out["trace"]:
        print(
            f"  {r['step']:<100}{gib(r['nbytes']):>7}{gib(r['before']):>8}{gib(r['peak']):>7}{gib(r['after']):>7}"
            f"{gib(r['peak'] - r['before']):>12}"
        )
        if r.get("note"):
            print(f"      {r['note']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a ~124M-parameter model (~240 MiB) instead of ~1.1B (~2 GiB)")
    ap.add_argument("--dir", default="/tmp/lm-hf-bench", help="where checkpoints are written once and reused")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="interleaved rounds of every loader (default 2; 0 with --trace: the trace alone)",
    )
    ap.add_argument("--loaders", default="lm,lm-mesh,hf", help="comma-separated subset of: lm, lm-mesh, hf")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="after the rounds, one more lm and lm-mesh child each placing leaf by leaf with each "
        "leaf's and each step's own peak RSS",
    )
    ap.add_argument("--json", help="write every child's raw result here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--size", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if not pathlib.Path("/proc/self/status").is_file():
        raise SystemExit("hf_load.py reads /proc/self/status: Linux only")
    size = "quick" if args.quick else "full"
    ckpt = make_checkpoint(size, pathlib.Path(args.dir))
    kinds = [k.strip() for k in args.loaders.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in LOADERS]
    if unknown:
        raise SystemExit(f"--loaders: unknown {unknown}; choose from {list(LOADERS)}")
    runs: dict = {}
    for r in range(args.rounds):
        for kind in kinds:
            for k in (LOADERS[kind][0], kind):
                out = run_child(k, ckpt)
                runs.setdefault(k, []).append(out)
                wall = f"{out['wall_s']:.2f} s, " if "wall_s" in out else ""
                touched = f", touched {gib(out['touched']['VmHWM'])} GiB" if "touched" in out else ""
                print(
                    f"round {r + 1} {k:<13} {wall}peak {gib(out['load']['VmHWM'])} GiB{touched} "
                    f"(process {out['process_s']:.1f} s)",
                    flush=True,
                )
    if runs:
        report(ckpt, runs)
    if args.trace:
        for kind in (k for k in kinds if k.startswith("lm")):
            out = run_child(kind, ckpt, trace=True)
            runs.setdefault(kind + "-trace", []).append(out)
            report_trace(kind, out)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
