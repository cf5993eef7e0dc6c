"""
The candidate speed-ups of issue 57 against the baseline, in one process on one GPU: GPT-2 124M, seq 1024, bf16,
compiled, micro-batch 64 and 524,288 tokens a step, with train_gpt2.py's own model, setup_training and train_step,
on random tokens (speed does not depend on what they say). For each variant: torch._dynamo.reset(), a fresh model
and AdamW (seed 0), the variant applied, warm-up steps (the first compiles), then timed steps. One JSON line a
variant, printed and appended to --out as soon as it is measured: tok/s, MFU, peak memory, the first step's and the
compilation's seconds, the last loss. The baseline runs first and again last, so that drift (clocks, heat) shows.

The variants live here, not in the trainers' flags; one that wins becomes the default in the issue that measures it:
    baseline       train_gpt2.py as it is (its forward returns only the loss given targets)
    cudnn          SDPA's cuDNN attention, forced around every step (only on compute capability 9.0, Hopper)
    bf16_residual  the residual stream in bf16: the embedding sum cast to bf16 as it enters the first block
    coord_descent  inductor's coordinate-descent tuning of the pointwise and reduction kernels
    max_autotune   torch.compile's mode max-autotune-no-cudagraphs
    winners        the single variants above that beat the first baseline by 1% or more, together (in a dry
                   run, all of them)
    all            every single variant that ran, together (unless the same as winners)
A variant that fails has a line with its error, and the rest go on. A variant that cannot run on this GPU, or
would not end before --seconds with the closing baseline after it (estimated from the first baseline's steps and
COMPILE_S below), is skipped: a JSON line says why.

    python bench/gpu_ab.py --out out/gpu/ab.jsonl     # on a GPU
    python bench/gpu_ab.py --dry_run    # a tiny model anywhere, to check every path (the CPU's flash attention
                                        # stands in for cuDNN's)
"""

import argparse
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack

import torch
import torch._dynamo
import torch._inductor.config
from torch.nn.attention import SDPBackend, sdpa_kernel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402

# the single variants, the likeliest gains for the least compile time first: a call cut short loses the last
SINGLE = ["cudnn", "bf16_residual", "coord_descent", "max_autotune"]
# A fresh compilation's seconds on a GPU, as issue 46 saw its first step on an H200 (18.7 s): the first baseline's
# own may come from inductor's cache. A compilation that tunes is estimated at this many times as long.
COMPILE_S = 20
SLOW_COMPILE = {"coord_descent": 3, "max_autotune": 8}


def apply(variants, raw_model, stack, dry_run):
    """Put the variants in place for one run; what must last for the run is entered on the stack."""
    if "cudnn" in variants:  # the CPU has no cuDNN: the dry run forces its flash attention, the same path here
        backend = SDPBackend.FLASH_ATTENTION if dry_run else SDPBackend.CUDNN_ATTENTION
        stack.enter_context(sdpa_kernel([backend]))
    if "coord_descent" in variants:
        stack.enter_context(torch._inductor.config.patch(coordinate_descent_tuning=True))
    if "bf16_residual" in variants:
        # under autocast the embedding sum is float32, and so is every residual add after it
        first_block = raw_model.transformer.h[0]
        first_block.register_forward_pre_hook(lambda block, args: (args[0].bfloat16(), *args[1:]))
    if "max_autotune" in variants:  # setup_training calls torch.compile: with this mode, for this run
        compile_fn = torch.compile
        torch.compile = functools.partial(compile_fn, mode="max-autotune-no-cudagraphs")
        stack.callback(setattr, torch, "compile", compile_fn)


def measure(name, variants, args, cuda):
    """One run of the variants: its figures."""
    B = args.micro_batch_size
    T, total = (64, 2 * B * 64) if args.dry_run else (1024, 524288)
    # the dry run's vocab is small too: the CPU's bf16 matmuls of the head would take seconds a step
    size = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512) if args.dry_run else tg.MODEL_SIZES["gpt2"]
    device = "cuda" if cuda else "cpu"
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run_dir = tempfile.mkdtemp()  # get_args's out_dir: a new run, nothing of it kept
    train_args = tg.get_args(["--device", device, "--dtype", "bfloat16", "--compile", "on" if cuda else "off",
                              "--out_dir", run_dir])
    shutil.rmtree(run_dir)
    torch.manual_seed(0)
    raw_model = tg.GPT(tg.GPTConfig(block_size=T, **size)).to(device)
    x = torch.randint(0, min(raw_model.config.vocab_size, 50257), (B, T), device=device)
    y = torch.roll(x, -1, 1)
    with ExitStack() as stack:
        apply(variants, raw_model, stack, args.dry_run)
        model, optimizers, scaler, autocast_ctx = tg.setup_training(raw_model, train_args, torch.bfloat16, device)
        times = []
        for _ in range(args.warmup_steps + args.timed_steps):
            start = time.perf_counter()
            metrics = tg.train_step(model, optimizers, scaler, lambda: (x, y), total // (B * T), total, 1.0,
                                    autocast_ctx)
            loss = metrics["loss"].item()  # a host sync, as train_gpt2.py's loop has each step
            times.append(time.perf_counter() - start)
    step_s = sum(times[args.warmup_steps:]) / args.timed_steps
    tok_per_s = total / step_s
    peak_flops = tg.PEAK_BF16_FLOPS.get(torch.cuda.get_device_name()) if cuda else None
    return dict(variant=name, applied=variants, micro_batch_size=B, seq_len=T, step_tokens=total,
                step_ms=round(1000 * step_s, 2), tok_per_s=round(tok_per_s),
                mfu=round(tg.flops_per_token(raw_model, T) * tok_per_s / peak_flops, 4) if peak_flops else None,
                peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                first_step_s=round(times[0], 1), compile_s=round(times[0] - step_s, 1), loss=loss)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro_batch_size", type=tg.positive_int, default=64)
    p.add_argument("--warmup_steps", type=tg.positive_int, default=2, help="untimed; the first compiles")
    p.add_argument("--timed_steps", type=tg.positive_int, default=4)
    p.add_argument("--seconds", type=tg.positive_int, help="skip a variant that would not end in this time (the "
                   "closing baseline's time kept); default: no limit")
    p.add_argument("--out", help="a JSON-lines file each variant's line is appended to as it is measured")
    p.add_argument("--dry_run", action="store_true",
                   help="a tiny model (vocab 512) at seq 64, micro-batch 4 unless given")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        tg.die("this needs a CUDA GPU (--dry_run runs a tiny model anywhere)")
    if args.dry_run and "--micro_batch_size" not in sys.argv:
        args.micro_batch_size = 4
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    capability = torch.cuda.get_device_capability() if cuda else None
    print(f"{name}, compute capability {capability}: torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
          f"{torch.backends.cudnn.version()}; GPT-2 {'tiny' if args.dry_run else '124M'}, micro-batch "
          f"{args.micro_batch_size}, {args.warmup_steps} warm-up and {args.timed_steps} timed steps a variant",
          flush=True)
    start = time.perf_counter()

    def record(line):
        print(json.dumps(line), flush=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(line) + "\n")

    first = measure("baseline", [], args, cuda)
    record(first)
    baseline_s = time.perf_counter() - start
    ran, winners = [], None
    for variant in SINGLE + ["winners", "all"]:
        if variant in SINGLE:
            applied = [variant]
        elif variant == "winners":  # in a dry run every one: the CPU's timings mean nothing, the paths do
            applied = winners = [r["variant"] for r in ran if r["tok_per_s"] >= 1.01 * first["tok_per_s"]
                                 or args.dry_run]
        else:
            applied = [r["variant"] for r in ran]
        compile_s = first["compile_s"] if args.dry_run else max(first["compile_s"], COMPILE_S)
        factor = max((SLOW_COMPILE.get(v, 1) for v in applied), default=1)
        estimate = baseline_s - first["compile_s"] + factor * compile_s
        left = args.seconds - (time.perf_counter() - start) - baseline_s if args.seconds else float("inf")
        skipped = None
        if variant == "cudnn" and capability != (9, 0) and not args.dry_run:
            skipped = f"cuDNN's attention is tried on compute capability 9.0 only; this GPU has {capability}"
        elif variant in ("winners", "all") and len(applied) < 2:
            skipped = f"fewer than two single variants to combine: {applied}"
        elif variant == "all" and applied == winners:
            skipped = f"the same variants as winners: {applied}"
        elif estimate > left:
            skipped = f"about {estimate:.0f} s needed, {left:.0f} s left before the closing baseline"
        if skipped:
            record(dict(variant=variant, applied=applied, skipped=skipped))
            continue
        try:
            result = measure(variant, applied, args, cuda)
        except Exception as e:  # a variant this GPU or torch cannot run (no kernel, out of memory): the rest go on
            record(dict(variant=variant, applied=applied, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            continue
        result["vs_baseline"] = round(result["tok_per_s"] / first["tok_per_s"], 4)
        record(result)
        if variant in SINGLE:
            ran.append(result)
    last = measure("baseline", [], args, cuda)
    last["vs_baseline"] = round(last["tok_per_s"] / first["tok_per_s"], 4)
    record(last)
    print(f"the A/B took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
