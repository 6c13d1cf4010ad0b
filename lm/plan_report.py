"""`lm plan --target`: one table per step — the planner's per-device memory (lm.plan_memory) and,
compiled, the compiler's beside it, the chip's HBM and whether the step fits; FLOPs and bytes
accessed from the compiler's cost analysis with the step time they imply at the chip's peak.
With --fit, a step that does not fit is searched for a setting that does (lm.plan_fit)."""

from __future__ import annotations

from lm.hardware import Target
from lm.plan import human_bytes
from lm.config import rules_table
from lm.errors import UserError
from lm.plan_fit import overrides, search
from lm.plan_memory import Estimate, batch_rows, estimate, mesh_sizes


def _gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def error(estimated: int, compiled: int | None) -> str:
    return "" if not compiled else f"{(estimated - compiled) / compiled:+.1%}"


def step_table(name: str, config, target: Target, est: Estimate, compiled=None) -> str:
    mesh = mesh_sizes(config, target.chips)
    t = config.train
    head = f"{name}: mesh data={mesh['data']} fsdp={mesh['fsdp']} tensor={mesh['tensor']}"
    if name == "decode":
        head += f", {config.eval.batch_size} rows (eval.batch_size) against a KV cache"
    else:
        rows = batch_rows(config, name, mesh, dict(rules_table(config)))
        head += (f", remat={config.model.remat}, {rows} row(s) x {config.data.seq_len} per device per micro-batch, "
                 f"{t.micro_batches} micro-batch(es)")
    lines = [head, f"  {'per device':<24}{'planner':>12}{'compiler':>12}"]
    for part, value in est.parts.items():
        lines.append(f"  {part:<24}{_gib(value):>12}")
    lines.append(f"  {'':<24}{'-' * 24:>24}")
    for part, value in est.by_kind().items():
        got = getattr(compiled, part) if compiled is not None else None
        lines.append(f"  {part:<24}{_gib(value):>12}{_gib(got):>12}")
    got = compiled.total if compiled is not None else None
    lines.append(f"  {'total':<24}{_gib(est.total):>12}{_gib(got):>12}  {error(est.total, got)}")
    for part, value in est.resident.items():
        lines.append(f"  also resident: {part} {_gib(value)} (not read by this step; add it to the total)")
    lines.append(_fits(target, est.total + sum(est.resident.values()), compiled))
    if compiled is not None and compiled.flops:
        lines += _cost(target, compiled)
    if compiled is not None and compiled.error:
        lines.append(f"  compiler: {compiled.error}")
    return "\n".join(lines)


def _fits(target: Target, estimated: int, compiled) -> str:
    hbm = target.hbm_bytes
    if hbm is None:
        return "  (CPU devices: no memory limit to check)"
    verdict = lambda n: "fits" if n <= hbm else "does NOT fit"  # noqa: E731
    text = f"  HBM of one {target.chip.name} chip: {_gib(hbm)}; planner: {verdict(estimated)}"
    if compiled is not None:
        text += "; compiler: " + ("does NOT fit" if compiled.error and compiled.total else
                                  "did not compile" if compiled.error else verdict(compiled.total))
    return text


def _cost(target: Target, compiled) -> list[str]:
    lines = [f"  FLOPs per device {compiled.flops:.3e}, bytes accessed {human_bytes(compiled.bytes_accessed or 0)}"]
    if target.chip is not None:
        flops_s = compiled.flops / target.chip.bf16_flops
        bytes_s = (compiled.bytes_accessed or 0) / target.chip.hbm_bytes_per_s
        lines.append(f"  compiler's estimate, not a measurement: {flops_s:.3f} s at the bf16 peak "
                     f"({target.chip.bf16_flops / 1e12:.0f} TFLOP/s), {bytes_s:.3f} s at the HBM bandwidth "
                     f"({target.chip.hbm_bytes_per_s / 1e9:.0f} GB/s): at least {max(flops_s, bytes_s):.3f} s a step")
    return lines


def plan_target(config, target: Target, steps, compile_: bool, fit: bool) -> int:
    """Prints a table per step; returns 1 when --fit found no setting for a step that does not fit, else 0."""
    from lm.aot import compile_step, target_devices

    devices = target_devices(target) if compile_ else None
    worst = 0
    for name in steps:
        try:
            est = estimate(config, name, target.chips, chip=target.chip)
        except UserError as e:
            print(f"\n{name}: {e}")
            continue
        compiled = compile_step(name, config, devices) if compile_ else None
        print()
        print(step_table(name, config, target, est, compiled))
        if fit and not _ok(target, est, compiled) and not _fit(config, name, target, devices):
            worst = 1
    return worst


def _fit(config, name: str, target: Target, devices) -> bool:
    found, est, compiled = search(config, name, target, devices)
    if found is None:
        print(f"\n--fit: no setting of remat, micro-batches and fsdp x tensor fits {name} on {target.name} "
              f"({compiled} compile(s) tried); it needs a larger slice or a shorter sequence")
        return False
    print(f"\n--fit: {name} fits with {overrides(found)}")
    print(step_table(name, found, target, est, compiled))
    return True


def _ok(target: Target, est: Estimate, compiled) -> bool:
    if compiled is not None:
        return not compiled.error
    return target.hbm_bytes is None or est.total <= target.hbm_bytes
