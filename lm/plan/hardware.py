"""Vendor figures of the accelerators a run may target: memory, bf16 matmul peak, memory bandwidth,
and how a Cloud TPU slice name (v5p-64) maps to chips and a topology. jax-free.

The peaks are the vendors' dense bf16 figures per chip (per GPU); MFU against them is what a
user compares with published runs. They are not measurements: `lm.train.perf.measure_matmul_peak`
measures the CPU.
"""

from __future__ import annotations

import dataclasses

from lm.errors import UserError

MiB, GiB = 2**20, 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # the slice prefix (v5p) or the GPU's name
    hbm_bytes: int  # per chip
    bf16_flops: float  # dense bf16 FLOP/s per chip
    hbm_bytes_per_s: float
    cores_per_chip_in_name: int = 1  # v4 and v5p slice names count TensorCores (2 per chip), v5e and v6e chips
    dims: int = 2  # topology rank (2D torus for v5e/v6e, 3D for v4/v5p)
    device_kinds: tuple = ()  # jax's device_kind strings of this chip
    vmem_bytes: int = 0  # on-chip vector memory where the TPU compiler may keep small temporaries


TPUS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1228e9, 2, 3, ("TPU v4",), 32 * MiB),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 1, 2, ("TPU v5 lite", "TPU v5e"), 128 * MiB),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, 2, 3, ("TPU v5", "TPU v5p"), 128 * MiB),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1640e9, 1, 2, ("TPU v6 lite", "TPU v6e"), 128 * MiB),
}
GPUS = {
    "A100": Chip(
        "A100",
        80 * GiB,
        312e12,
        2039e9,
        device_kinds=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-SXM4-40GB"),
    ),
    "H100": Chip("H100", 80 * GiB, 989e12, 3350e9, device_kinds=("NVIDIA H100 80GB HBM3", "NVIDIA H100")),
    "H100 PCIe": Chip("H100 PCIe", 80 * GiB, 756e12, 2000e9, device_kinds=("NVIDIA H100 PCIe",)),
    "H200": Chip("H200", 141 * GiB, 989e12, 4800e9, device_kinds=("NVIDIA H200",)),
    "B200": Chip("B200", 180 * GiB, 2250e12, 8000e9, device_kinds=("NVIDIA B200",)),
}


def chip_of_kind(device_kind: str) -> Chip | None:
    """The chip whose jax `device_kind` is this (exact first, then the longest name it starts with)."""
    chips = [*TPUS.values(), *GPUS.values()]
    for chip in chips:
        if device_kind in chip.device_kinds:
            return chip
    matches = [(len(k), c) for c in chips for k in c.device_kinds if device_kind.startswith(k)]
    return max(matches, key=lambda m: m[0])[1] if matches else None


@dataclasses.dataclass(frozen=True)
class Target:
    """A compile target: `tpu` (a slice: chip, chips, topology) or `cpu` (N simulated devices)."""

    platform: str
    name: str  # as the user wrote it: v5p-64, cpu:8
    chips: int
    chip: Chip | None = None
    topology: str = ""  # jax's topology name, e.g. v5p:2x4x4

    @property
    def hbm_bytes(self) -> int | None:
        return self.chip.hbm_bytes if self.chip else None


# The slice shapes Cloud TPU offers for a chip count (first one listed is the one used).
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
    1024: "8x8x16",
    2048: "8x16x16",
    4096: "16x16x16",
}


def parse_target(text: str) -> Target:
    """`cpu:N`, or a Cloud TPU slice name `<v4|v5e|v5p|v6e>-<N>` (N as in the slice's name: TensorCores
    for v4/v5p, chips for v5e/v6e)."""
    if text.startswith("cpu:"):
        n = text[4:]
        if not n.isdigit() or int(n) < 1:
            raise UserError(f"--target {text}: expected cpu:N with N >= 1 simulated devices")
        return Target("cpu", text, int(n))
    prefix, _, count = text.partition("-")
    chip = TPUS.get(prefix)
    if chip is None or not count.isdigit():
        raise UserError(f"--target {text}: expected cpu:N or a TPU slice <{'|'.join(TPUS)}>-<N> (e.g. v5p-64, v5e-16)")
    n = int(count)
    chips, rest = divmod(n, chip.cores_per_chip_in_name)
    shapes = _SHAPES_3D if chip.dims == 3 else _SHAPES_2D
    if rest or chips not in shapes:
        sizes = ", ".join(f"{prefix}-{c * chip.cores_per_chip_in_name}" for c in shapes)
        raise UserError(f"--target {text}: no {prefix} slice of that size; sizes: {sizes}")
    return Target("tpu", text, chips, chip, f"{prefix}:{shapes[chips]}")


GOOGLE_PCI_VENDOR = "0x1ae0"


def has_tpu(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """Whether this machine has TPU chips (Google's PCI vendor id), as jax itself decides."""
    import glob

    for vendor in glob.glob(f"{pci_root}/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def quiet_absent_tpu(environ) -> None:
    """With libtpu installed (lm[tpu]) but no TPU here, jax still starts the TPU runtime, which looks
    for its VM's metadata and prints a screen of warnings on every command: say there is none.
    Call before jax starts a backend; the user's own settings win."""
    if environ.get("JAX_PLATFORMS") or has_tpu():
        return
    environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    environ.setdefault("TPU_ACCELERATOR_TYPE", "v5e-1")  # any known type; there are no chips to match it
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
