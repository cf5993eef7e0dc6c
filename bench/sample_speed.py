"""
Generation speed: tokens/s for --new_tokens new tokens after a short prompt, using sample.py's generate(), with
the model loaded as sample.py loads it (float32 weights; --cast_weights casts them to --dtype instead).

    python bench/sample_speed.py --preset gpt2               # KV cache vs none (GPT-2 124M, random weights)
    python bench/sample_speed.py --ckpt out/demo
    python bench/sample_speed.py --preset gpt2 --threads_table   # CPU decode: default threads vs 1, idle and loaded

The cache table checks that both give the same greedy tokens. The threads table decodes with the cache at the
default thread count and at 1 thread, first as the machine is, then with a busy-loop process that the bench starts
itself (one core's worth of other work, as another job on a shared machine).
"""

import argparse
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sample  # noqa: E402
import train_gpt2 as tg  # noqa: E402


def decode(model, prompt, new_tokens, use_cache, ctx):
    """(tokens, tokens/s) of greedy generation after a short warm-up."""
    list(sample.generate(model, prompt, 8, 50257, temperature=0, use_cache=use_cache, autocast_ctx=ctx))
    start = time.perf_counter()
    tokens = torch.cat(list(sample.generate(model, prompt, new_tokens, 50257, temperature=0, use_cache=use_cache,
                                            autocast_ctx=ctx)), dim=1)
    tokens.tolist()
    return tokens, new_tokens / (time.perf_counter() - start)


def cache_table(model, prompt, args, name, device, ctx):
    print("| model | device | new tokens | cache | tokens/s | vs no cache |\n|---|---|---:|---|---:|---:|")
    results = {use_cache: decode(model, prompt, args.new_tokens, use_cache, ctx) for use_cache in (False, True)}
    for use_cache in (False, True):
        print(f"| {name} | {device} | {args.new_tokens} | {'yes' if use_cache else 'no'} | {results[use_cache][1]:.1f} | "
              f"{results[use_cache][1] / results[False][1]:.2f}x |")
    print(f"same greedy tokens with and without the cache: {torch.equal(results[True][0], results[False][0])}")


def threads_table(model, prompt, args, name, ctx):
    default = torch.get_num_threads()
    print(f"{os.cpu_count()} cores; default threads: {default} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    print("| model | load | threads | tokens/s | vs default threads |\n|---|---|---:|---:|---:|")
    for load in ("as is", "+1 busy process"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load != "as is" else None
        try:
            speeds = {}
            for threads in dict.fromkeys((default, 1)):
                torch.set_num_threads(threads)
                speeds[threads] = decode(model, prompt, args.new_tokens, True, ctx)[1]
                print(f"| {name} | {load} | {threads} | {speeds[threads]:.1f} | {speeds[threads] / speeds[default]:.2f}x |",
                      flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    torch.set_num_threads(default)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2", choices=list(tg.MODEL_SIZES), help="model size (random weights)")
    p.add_argument("--ckpt", help="a checkpoint instead")
    p.add_argument("--new_tokens", type=int, default=256, help="tokens to generate")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", help="matmul dtype under autocast, as sample.py's --dtype")
    p.add_argument("--cast_weights", action="store_true", help="cast the weights to --dtype (sample.py keeps float32)")
    p.add_argument("--threads_table", action="store_true", help="CPU decode speed at the default threads vs 1, "
                   "as the machine is and with one busy process")
    args = p.parse_args()
    device = tg.init_distributed(args.device)
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    model = tg.model_from_checkpoint(tg.load_checkpoint(args.ckpt)[0]) if args.ckpt else \
        tg.GPT(tg.GPTConfig(**tg.MODEL_SIZES[args.preset]))
    dtype = tg.autocast_dtype(args.dtype, device_type)
    model.to(device=device, dtype=dtype if args.cast_weights else torch.float32).eval()  # as sample.py
    ctx = tg.nullcontext() if args.cast_weights else tg.autocast_context(device_type, dtype)
    prompt = torch.tensor([tg.get_tokenizer().encode("Hello, I'm a language model,")], device=device)
    name = f"{args.ckpt or args.preset} {str(dtype)[6:]}{' weights' if args.cast_weights else ''}"
    if args.threads_table:
        threads_table(model, prompt, args, name, ctx)
    else:
        cache_table(model, prompt, args, name, device, ctx)


if __name__ == "__main__":
    main()
