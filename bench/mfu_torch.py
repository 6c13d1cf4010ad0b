"""The PyTorch peer of bench/mfu.py: one shape's bf16 train step in plain PyTorch, as strong as it goes.

The decoder is lm's (RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases, the head tied or
untied as lm's config says), written the way a PyTorch user writes it at its best:

- `torch.compile` of the whole model (forward and backward through inductor);
- `F.scaled_dot_product_attention(is_causal=True)` (flash attention on a GPU), grouped-query
  attention without copying keys and values (`enable_gqa`);
- float32 params and optimizer state, the forward pass under bf16 autocast, the loss in float32
  (as lm: float32 params, matmuls in the compute dtype, logits and softmax in float32);
- AdamW with `fused=True` on CUDA (`foreach` elsewhere), clipping at 1.0, weight decay 0.1;
- the same activation checkpointing and micro-batches as lm's step: `none`; `full` (each block
  recomputed, `torch.utils.checkpoint`); `dots` (lm's dots_saveable: matmul and attention
  outputs kept, the rest recomputed, with selective checkpointing). When a setting runs out of
  device memory the next heavier one is tried, and the JSON says which one ran.

    python bench/mfu_torch.py --shape '{"vocab": 256, "d_model": 128, ...}' [--steps 5] [--warmup 2]

Prints one JSON line on stdout (tokens/s over the timed steps, one sync at their end). `--eager`
skips `torch.compile` (a quick smoke run; not a peer figure). Run it with a Python that has torch.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

REMATS = ("none", "dots", "full")  # keeps less ->


class Block(nn.Module):
    def __init__(self, s: dict):
        super().__init__()
        d, self.h, self.kv = s["d_model"], s["heads"], s["kv_heads"]
        self.hd = d // self.h
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq = nn.Linear(d, self.h * self.hd, bias=False)
        self.wk = nn.Linear(d, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(d, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(self.h * self.hd, d, bias=False)
        self.w_gate = nn.Linear(d, s["d_ff"], bias=False)
        self.w_up = nn.Linear(d, s["d_ff"], bias=False)
        self.w_down = nn.Linear(s["d_ff"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.norm1(x)
        q = rope(self.wq(y).view(b, t, self.h, self.hd), cos, sin).transpose(1, 2)
        k = rope(self.wk(y).view(b, t, self.kv, self.hd), cos, sin).transpose(1, 2)
        v = self.wv(y).view(b, t, self.kv, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, self.h * self.hd))
        y = self.norm2(x)
        return x + self.w_down(F.silu(self.w_gate(y)) * self.w_up(y))


def rope(x, cos, sin):
    """Rotary embedding over the two halves of each head ([B, T, heads, hd]; cos, sin [T, hd/2])."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


def _dots_policy():
    """Selective checkpointing that keeps matmul and attention outputs (lm's dots_saveable)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)
    if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
        keep.add(aten._scaled_dot_product_cudnn_attention.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Decoder(nn.Module):
    def __init__(self, s: dict, remat: str = "none"):
        super().__init__()
        self.remat = remat
        self.embed = nn.Embedding(s["vocab"], s["d_model"])
        self.blocks = nn.ModuleList(Block(s) for _ in range(s["layers"]))
        self.norm = nn.RMSNorm(s["d_model"], eps=1e-5)
        self.head = nn.Linear(s["d_model"], s["vocab"], bias=False)
        if s["tie"]:
            self.head.weight = self.embed.weight
        for p in self.parameters():
            nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.ones_(p)
        hd = s["d_model"] // s["heads"]
        freqs = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        angles = torch.outer(torch.arange(s["seq"], dtype=torch.float32), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, inputs, targets):
        x = self.embed(inputs)
        for block in self.blocks:
            if self.remat == "none":
                x = block(x, self.cos, self.sin)
            elif self.remat == "full":
                x = checkpoint(block, x, self.cos, self.sin, use_reentrant=False)
            else:
                x = checkpoint(block, x, self.cos, self.sin, use_reentrant=False, context_fn=_dots_policy())
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(s: dict, remat: str, steps: int, warmup: int, eager: bool, device) -> dict:
    torch.manual_seed(0)
    model = Decoder(s, remat).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **({"fused": True} if cuda else {})
    )
    forward = model if eager else torch.compile(model)
    micro = s["micro_batches"]
    rows = s["batch"] // micro
    gen = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(s["vocab"], (2, s["batch"], s["seq"]), generator=gen, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step():
        for i in range(micro):
            x, y = data[0, i * rows : (i + 1) * rows], data[1, i * rows : (i + 1) * rows]
            with autocast:
                loss = forward(x, y) / micro
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):  # the first step compiles
        loss = step()
    sync(device)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    out = {
        "tokens_per_s": s["batch"] * s["seq"] / dt,
        "ms_per_step": dt * 1e3,
        "compile_s": compile_s,
        "params": n_params,
        "remat": remat,
        "loss": float(loss.detach()) * micro,
    }
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--shape",
        required=True,
        help="JSON: vocab, d_model, layers, heads, kv_heads, d_ff, seq, batch, "
        "tie, micro_batches, remat (none|dots|full)",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="no torch.compile (smoke runs only)")
    args = p.parse_args(argv)
    s = json.loads(args.shape)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_of_memory = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    errors = []
    for remat in REMATS[REMATS.index(s["remat"]) :]:
        out = None
        try:
            out = measure(s, remat, args.steps, args.warmup, args.eager, device)
        except out_of_memory as e:
            errors.append(f"{remat}: out of memory ({str(e).splitlines()[0][:100]})")
        if out is None:  # free the failed attempt (its frames went with the exception) before the next
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        out |= {"torch": torch.__version__, "device": str(device), "eager": args.eager, "oom": errors}
        print(json.dumps(out), flush=True)
        return 0 if math.isfinite(out["loss"]) else 1
    print(f"mfu_torch: every setting ran out of memory: {errors}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
