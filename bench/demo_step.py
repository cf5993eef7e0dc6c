"""
The demo model's training step on this CPU: float32, eager or compiled, for micro-batch sizes given, each as
MICRO_BATCH:MODE; prints each variant's first step (where compiling happens) and the median of 8 timed steps, and
with --profile the torch.profiler table of two eager steps (issue 59's profile and candidates).

    python bench/demo_step.py 8:eager 4:eager 8:compiled 4:eager 8:eager --profile
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402


def bench(micro_batch_size, compiled, profile, warmup=3, steps=8):
    torch.manual_seed(0)
    config = tg.GPTConfig(**{k: tg.DEMO_PRESET[k] for k in ("n_layer", "n_head", "n_embd", "block_size")})
    model = tg.GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
    train_model = torch.compile(model) if compiled else model
    x = torch.randint(0, 50257, (micro_batch_size, config.block_size))
    y = torch.randint(0, 50257, (micro_batch_size, config.block_size))

    def step():  # the trainers' step: a summed loss, clipping, fused AdamW
        train_model(x, y, reduction="sum").backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    tokens = micro_batch_size * config.block_size
    print(f"micro-batch {micro_batch_size} {'compiled' if compiled else 'eager'}: first step {first:.1f} s, "
          f"median {median:.3f} s, {tokens / median:,.0f} tok/s", flush=True)
    if profile and not compiled:
        with torch.profiler.profile() as prof:
            for _ in range(2):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=55))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help="MICRO_BATCH:MODE, MODE eager or compiled")
    p.add_argument("--profile", action="store_true", help="the profiler table of each eager variant's first run")
    args = p.parse_args()
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    profiled = set()
    for variant in args.variants:
        micro_batch_size, _, mode = variant.partition(":")
        if not micro_batch_size.isdigit() or mode not in ("eager", "compiled"):
            p.error(f"{variant!r} is not MICRO_BATCH:MODE, MODE eager or compiled (e.g. 8:eager)")
        bench(int(micro_batch_size), mode == "compiled", args.profile and variant not in profiled)
        profiled.add(variant)


if __name__ == "__main__":
    main()
