"""
Generation speed with and without the KV cache: tokens/s for --new_tokens new tokens after a short prompt, the
same model and the same greedy tokens (checked), using the generate() that sample.py and train_gpt2.py share.

    python bench/sample_speed.py --preset gpt2               # GPT-2 124M (random weights: speed is the same)
    python bench/sample_speed.py --ckpt out/demo
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2", choices=list(tg.MODEL_SIZES), help="model size (random weights)")
    p.add_argument("--ckpt", help="a checkpoint instead")
    p.add_argument("--new_tokens", type=int, default=256, help="tokens to generate")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="auto", help="weights dtype (auto: bfloat16 where supported)")
    args = p.parse_args()
    _, _, _, device = tg.init_distributed(args.device)
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    model = tg.model_from_checkpoint(tg.load_checkpoint(args.ckpt)[0]) if args.ckpt else \
        tg.GPT(tg.GPTConfig(**tg.MODEL_SIZES[args.preset]))
    model.to(device=device, dtype=tg.autocast_dtype(args.dtype, device_type)).eval()  # as sample.py: cast once
    ctx = tg.nullcontext()
    prompt = torch.tensor([tg.get_tokenizer().encode("Hello, I'm a language model,")], device=device)
    print("| model | device | new tokens | cache | tokens/s | vs no cache |\n|---|---|---:|---|---:|---:|")
    results = {}
    for use_cache in (False, True):
        list(tg.generate(model, prompt, 8, 50257, temperature=0, use_cache=use_cache, autocast_ctx=ctx))  # warm-up
        start = time.perf_counter()
        tokens = torch.cat(list(tg.generate(model, prompt, args.new_tokens, 50257, temperature=0,
                                            use_cache=use_cache, autocast_ctx=ctx)), dim=1)
        tokens.tolist()
        results[use_cache] = (tokens, args.new_tokens / (time.perf_counter() - start))
    same = torch.equal(results[True][0], results[False][0])
    name = args.ckpt or args.preset
    for use_cache in (False, True):
        print(f"| {name} | {device} | {args.new_tokens} | {'yes' if use_cache else 'no'} | {results[use_cache][1]:.1f} | "
              f"{results[use_cache][1] / results[False][1]:.2f}x |")
    print(f"same greedy tokens with and without the cache: {same}")


if __name__ == "__main__":
    main()
