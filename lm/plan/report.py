"""`lm plan --target`: one table per step — the planner's per-device memory (lm.plan.memory) and,
compiled, the compiler's beside it, the chip's HBM and whether the step fits; the step's model
FLOPs per chip with the time they take at the chip's bf16 peak, and the compiler's cost analysis.
With --fit, a step that does not fit is searched for a setting that does (lm.plan.fit)."""

from __future__ import annotations

from lm.config import rules_table
from lm.errors import UserError
from lm.model import counts
from lm.plan.fit import overrides, search
from lm.plan.hardware import Target
from lm.plan.memory import Estimate, batch_rows, estimate, mesh_sizes
from lm.plan.pipeline_memory import pipeline_of
from lm.plan.units import human_bytes
from lm.train.registry import compiled_step


def _gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def error(estimated: int, compiled: int | None) -> str:
    return "" if not compiled else f"{(estimated - compiled) / compiled:+.1%}"


def mesh_text(mesh: dict) -> str:
    """data, fsdp and tensor always; stage and expert where they split anything."""
    return " ".join(f"{a}={n}" for a, n in mesh.items() if n > 1 or a in ("data", "fsdp", "tensor"))


def pipeline_line(config, name: str, mesh: dict) -> str | None:
    """The schedule of a pipelined step and its bubble (the share of stage-iterations that idle)."""
    pipe = pipeline_of(config, name, mesh)
    if pipe is None:
        return None
    held = f"; holds {pipe.held} chunk inputs a stage (GPipe: every iteration's)" if pipe.schedule == "1f1b" else ""
    return (
        f"  pipeline: {pipe.stages} stages ({pipe.name}), {pipe.microbatches} pipeline micro-batches per "
        f"micro-batch, {pipe.iterations} iterations: bubble {pipe.bubble:.1%} "
        f"(= (stages - 1) / (repeats x micro-batches + stages - 1)){held}"
    )


def step_table(name: str, config, target: Target, est: Estimate, compiled=None) -> str:
    mesh = mesh_sizes(config, target.chips)
    t = config.train
    head = f"{name}: mesh {mesh_text(mesh)}"
    if compiled_step(name).generation:
        head += f", {config.eval.batch_size} rows (eval.batch_size) against a KV cache"
    else:
        rows = batch_rows(config, name, mesh, dict(rules_table(config)))
        head += (
            f", remat={config.model.remat}, {rows} row(s) x {config.data.seq_len} per device per micro-batch, "
            f"{t.micro_batches} micro-batch(es)"
        )
    lines = [head] + [line for line in [pipeline_line(config, name, mesh)] if line]
    lines.append(f"  {'per device':<24}{'planner':>12}{'compiler':>12}")
    for part, value in est.parts.items():
        lines.append(f"  {part:<24}{_gib(value):>12}")
    lines.append(f"  {'':<24}{'-' * 24:>24}")
    for part, value in est.by_kind().items():
        got = getattr(compiled, part) if compiled is not None else None
        lines.append(f"  {part:<24}{_gib(value):>12}{_gib(got):>12}")
    got = compiled.total if compiled is not None else None
    lines.append(
        f"  {'total':<24}{_gib(est.total):>12}{_gib(got):>12}  {error(est.total, got)}"
        + (f"  (compiled in {compiled.compile_s:.0f} s)" if compiled is not None else "")
    )
    for part, value in est.resident.items():
        lines.append(f"  also resident: {part} {_gib(value)} (not read by this step; add it to the total)")
    lines.append(_fits(target, est.total + sum(est.resident.values()), compiled))
    if compiled is not None and compiled.flops:
        lines += _cost(name, config, target, compiled)
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
        text += "; compiler: " + (
            "does NOT fit"
            if compiled.error and compiled.total
            else "did not compile"
            if compiled.error
            else verdict(compiled.total)
        )
    return text


def step_flops(config, step: str, chips: int) -> float:
    """Model FLOPs of one step per chip (PaLM's count, lm.model.counts.flops_per_token, is 6N per
    token: three passes of 2N; the step's `passes` say how many it makes: lm.train.registry)."""
    m, t, compiled = config.model, config.data.seq_len, compiled_step(step)
    if compiled.generation:  # one token for each of eval.batch_size rows
        return 2 * compiled.passes * counts.flops_per_token(m, 1) / 6 * config.eval.batch_size / chips
    rows = compiled.update_rows(config) * compiled.rows_per_example
    return counts.flops_per_token(m, t) * compiled.passes / 3 * rows * t / chips


def _cost(name: str, config, target: Target, compiled) -> list[str]:
    flops = step_flops(config, name, target.chips)
    lines = [
        f"  model FLOPs per chip a step {flops:.3e}; the compiler's cost analysis: {compiled.flops:.3e} FLOPs, "
        f"{human_bytes(compiled.bytes_accessed or 0)} accessed (XLA counts a loop's body once: the layer and "
        "micro-batch scans make that one iteration's, not the step's)"
    ]
    if target.chip is not None:
        seconds = flops / target.chip.bf16_flops
        pipe = pipeline_of(config, name, mesh_sizes(config, target.chips))
        idle = f"; {seconds / (1 - pipe.bubble):.3f} s with the pipeline's bubble" if pipe else ""
        lines.append(
            f"  at the bf16 peak ({target.chip.bf16_flops / 1e12:.0f} TFLOP/s) a step takes at least "
            f"{seconds:.3f} s{idle} (an estimate, not a measurement)"
        )
    return lines


def plan_target(config, target: Target, steps, compile_: bool, fit: bool) -> int:
    """Prints a table per step; returns 1 when --fit found no setting for a step that does not fit, else 0."""
    from lm.plan.aot import compile_step, target_devices

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
        print(
            f"\n--fit: no setting of remat, micro-batches and fsdp x context x tensor fits {name} on {target.name} "
            f"({compiled} compile(s) tried); it needs a larger slice or a shorter sequence"
        )
        return False
    print(f"\n--fit: {name} fits with {overrides(found)}")
    print(step_table(name, found, target, est, compiled))
    return True


def _ok(target: Target, est: Estimate, compiled) -> bool:
    if compiled is not None:
        return not compiled.error
    return target.hbm_bytes is None or est.total <= target.hbm_bytes
