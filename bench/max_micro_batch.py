"""
The largest micro-batch of GPT-2 124M at seq 1024 that trains in 24 GiB of GPU memory (an RTX 3090 or 4090), found
on a bigger GPU: torch.cuda.set_per_process_memory_fraction caps this process at 24 GiB of the card. Each probe is
one training step of train_gpt2.py's own code (its model, AdamW, bf16 autocast, torch.compile and train_step) on
random tokens; sizes double until one does not fit, then a binary search between the last two. The batch dimension
is marked dynamic, so that one compilation serves every probe. Then train_gpt2.py itself trains 3 steps at the size
found (one less while that runs out of memory, 4 sizes at most), under the same cap, compiled for that one shape as
a real run is. The cap leaves out the CUDA context (about 0.5 GiB), which a real 24 GiB card also holds: a size that
fits with a few hundred MiB to spare may not fit there.

    python bench/max_micro_batch.py --data_dir data/fineweb              # on a GPU
    python bench/max_micro_batch.py --data_dir data/fineweb --dry_run    # CPU: a tiny model; "fits" stands for B <= 6
"""

import argparse
import gc
import os
import shutil
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=24, help="GPU memory to fit in, GiB")
    p.add_argument("--start", type=int, default=8, help="first micro-batch size to try (then doubled)")
    p.add_argument("--data_dir", help="token shards for the check with train_gpt2.py (none: no check)")
    p.add_argument("--out_dir", default=os.path.join(REPO, "out", "max-micro-batch"), help="the check's run")
    p.add_argument("--dry_run", action="store_true", help="a tiny model at seq 64 on whatever device there is")
    args = p.parse_args()
    args.out_dir = os.path.abspath(args.out_dir)  # the check runs in the repo's root
    if args.data_dir:
        args.data_dir = os.path.abspath(args.data_dir)
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("error: this needs a CUDA GPU (--dry_run runs a tiny model anywhere)")
    if args.start < 2:
        sys.exit("error: --start must be 2 or more (a dimension of size 1 cannot be marked dynamic)")
    T, device = (64, "cuda" if cuda else "cpu") if args.dry_run else (1024, "cuda")
    size = dict(n_layer=2, n_head=2, n_embd=64) if args.dry_run else tg.MODEL_SIZES["gpt2"]
    fraction = None
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        if args.gib * 2**30 > total:
            sys.exit(f"error: --gib {args.gib:g} is more than this GPU's {total / 2**30:.1f} GiB")
        fraction = args.gib * 2**30 / total
        torch.cuda.set_per_process_memory_fraction(fraction)
    # auto, as train_gpt2.py: on for CUDA, off on a CPU
    compile_flag = "on" if device == "cuda" else "off"
    train_args = tg.get_args(["--device", device, "--dtype", "bfloat16", "--compile", compile_flag])
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(block_size=T, **size)).to(device)
    model, optimizers, scaler, autocast_ctx = tg.setup_training(model, train_args, torch.bfloat16, device)

    def fits(B):
        x = y = None
        try:
            x = torch.randint(0, 50257, (B, T), device=device)
            y = torch.roll(x, -1, 1)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            tg.train_step(model, optimizers, scaler, lambda: (x, y), 1, B * T, 1.0, autocast_ctx)
            ok = B <= 6 if args.dry_run else True
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated" if cuda else ""
        except Exception as e:  # torch.OutOfMemoryError, or a RuntimeError from a library's own allocation
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and not any(  # as tg.exit_on_out_of_memory
                    text in str(e) for text in ("can't allocate memory", "not enough memory", "out of memory")):
                raise
            ok, peak = False, ""
        for opt in optimizers:  # a step cut short by the cap leaves gradients behind
            opt.zero_grad(set_to_none=True)
        x = y = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(f"micro-batch {B}: {'fits' if ok else 'does not fit'}{peak}", flush=True)
        return ok

    print(f"GPT-2 {'tiny (dry run)' if args.dry_run else '124M'}, seq {T}, bf16, compile {compile_flag}, "
          f"{'capped at %g GiB' % args.gib if cuda else 'no cap (CPU)'}; the first probe compiles", flush=True)
    fit, no_fit = 0, args.start
    while fits(no_fit):
        fit, no_fit = no_fit, 2 * no_fit
    while no_fit - fit > 1:
        mid = (fit + no_fit) // 2
        fit, no_fit = (mid, no_fit) if fits(mid) else (fit, mid)
    if fit == 0:
        sys.exit(f"error: not even micro-batch 1 fits in {args.gib:g} GiB")
    print(f"largest micro-batch: {fit} x {T} tokens", flush=True)
    if not args.data_dir:
        return

    model = optimizers = None  # this process's memory back, for the check's
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    cap = f"import torch; torch.cuda.set_per_process_memory_fraction({fraction}); " if cuda else ""
    model_flags = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", str(T)] if args.dry_run else []
    # A real run compiles for one shape and also evaluates: on an H200 it needed 0.5 GiB more than the probe, so a
    # size that fits the probe by less may not train. Step down until train_gpt2.py itself trains.
    for B in range(fit, max(fit - 4, 0), -1):
        cmd = [sys.executable, "-c", cap + "import runpy, sys; sys.argv[0] = 'train_gpt2.py'; "
               "runpy.run_path('train_gpt2.py', run_name='__main__')", *model_flags, "--data_dir", args.data_dir,
               "--out_dir", args.out_dir, "--seq_len", str(T), "--micro_batch_size", str(B), "--total_batch_size",
               str(2 * B * T), "--max_steps", "3", "--eval_every", "100", "--val_tokens", str(B * T),
               "--num_samples", "0", "--dtype", "bfloat16", "--compile", compile_flag, "--device", device]
        print(f"check: train_gpt2.py at micro-batch {B} under the same cap", flush=True)
        shutil.rmtree(args.out_dir, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=REPO)
        if proc.returncode != 2:  # 2: out of memory (or bad input, which the first try would show)
            break
    print(f"train_gpt2.py at --micro_batch_size {B}: {'trained 3 steps' if proc.returncode == 0 else 'FAILED'}")
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
