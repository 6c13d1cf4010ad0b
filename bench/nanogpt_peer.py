"""Peer measurement: karpathy's nanoGPT (PyTorch, CPU, eager) training throughput.

Run with a Python that has torch installed (not the project's environment):

    /tmp/torch-venv/bin/python bench/nanogpt_peer.py --nanogpt /tmp/nanoGPT --dtype bfloat16

nanoGPT's model.py is imported from the given checkout, never copied. Prints one
line of JSON on stdout; nanoGPT's own prints go to stderr.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time


def die(msg):
    print(f"nanogpt_peer: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", required=True, help="path to a nanoGPT checkout")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=256)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    args = parse_args(argv)
    path = os.path.abspath(args.nanogpt)
    if not os.path.isdir(path):
        die(f"no such directory: {path}")
    if not os.path.isfile(os.path.join(path, "model.py")):
        die(f"no model.py in {path}: not a nanoGPT checkout")
    try:
        import torch
    except ImportError:
        die(f"torch is not installed for {sys.executable}")
    sys.path.insert(0, path)
    try:
        from model import GPT, GPTConfig
    except Exception as e:  # wrong checkout, incompatible torch, ...
        die(f"cannot import GPT/GPTConfig from {path}/model.py: {e}")

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    shape = dict(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=args.block_size,
        batch_size=args.batch_size,
        vocab_size=args.vocab_size,
    )
    cfg = GPTConfig(
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=False,
    )
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON line
        model = GPT(cfg).to("cpu")
        opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), device_type="cpu")
    model.train()
    # All parameters (tied wte/lm_head counted once, position embedding included).
    n_params = sum(p.numel() for p in model.parameters())

    if args.dtype == "bfloat16":
        ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    else:
        ctx = contextlib.nullcontext
    gen = torch.Generator().manual_seed(0)
    B, T, V = args.batch_size, args.block_size, args.vocab_size

    def step():
        x = torch.randint(V, (B, T), generator=gen)
        y = torch.randint(V, (B, T), generator=gen)
        with ctx():
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    times = []  # eager CPU is synchronous: wall time per step is exact
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step().item()
        times.append(time.perf_counter() - t0)
    dt = sum(times) / len(times)

    print(
        json.dumps(
            {
                "peer": "nanoGPT",
                "dtype": args.dtype,
                "tokens_per_s": round(B * T / dt, 1),
                "ms_per_step": round(dt * 1e3, 2),
                # mean above; median and best help when the machine is noisy
                "ms_per_step_median": round(statistics.median(times) * 1e3, 2),
                "ms_per_step_min": round(min(times) * 1e3, 2),
                "n_params": n_params,
                "shape": shape,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
