"""Peer measurement: Hugging Face transformers `generate` (its own KV cache), greedy, on CPU (or a GPU: --device cuda).

Run with a Python that has torch and transformers installed (not the project's environment):

    /tmp/hf-venv/bin/python bench/hf_generate_peer.py --batch 16 --new-tokens 256 [shape flags]

Builds a LlamaForCausalLM with random weights of the given shape and prints one line of JSON:
tokens/s of new tokens (batch x new tokens / wall time of generate), best and median of --repeats.
"""

import argparse
import json
import os
import statistics
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    for name, default in [
        ("vocab", 2048),
        ("d-model", 384),
        ("layers", 6),
        ("heads", 6),
        ("kv-heads", 2),
        ("d-ff", 1024),
    ]:
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU host")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and compute")
    args = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(os.cpu_count())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_ff,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt_len + args.new_tokens,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).eval().to(args.device, getattr(torch, args.dtype))
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len)).to(args.device)
    mask = torch.ones_like(ids)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    kw = dict(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, use_cache=True, pad_token_id=0
    )
    times = []
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, **(kw | dict(max_new_tokens=4, min_new_tokens=4)))  # warm up
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kw)
            sync()
            times.append(time.perf_counter() - start)
    assert out.shape[1] == args.prompt_len + args.new_tokens, out.shape
    tokens = args.batch * args.new_tokens
    print(
        json.dumps(
            {
                "tokens_per_s": tokens / min(times),
                "tokens_per_s_median": tokens / statistics.median(times),
                "params": sum(x.numel() for x in model.parameters()),
                "torch": torch.__version__,
                "device": args.device,
            }
        )
    )


if __name__ == "__main__":
    main()
