"""
Training speed and memory of train_gpt2.py's step, on this machine: tok/s, MFU, peak memory, the first step's and
the compilation's seconds, for the baseline and each variant given, one after another in one process. The model,
setup_training (AdamW, autocast, torch.compile) and train_step are train_gpt2.py's own; the tokens are random
(speed does not depend on what they say). For each run: torch._dynamo.reset(), a fresh model and AdamW (seed 0), the
variant put in place, warm-up steps (the first compiles), then timed steps. The baseline is train_gpt2.py as a user
runs it here (--dtype auto, --compile auto: bf16 and compiled on a GPU); it runs first and, after any variant, again
last, so that drift (clocks, heat, other load) shows. One JSON line a run, printed and appended to
OUT_DIR/speed.jsonl as soon as it is measured.

Variants (the changes live here, not in the trainers' flags; one that wins becomes the trainers' default):
    float32        matmuls in float32 (no autocast)
    eager          no torch.compile
    compiled       torch.compile on a CPU too (auto compiles on CUDA only)
    cudnn          SDPA's cuDNN attention, forced around every step (compute capability 9.0, Hopper, only)
    bf16_residual  the residual stream in bf16: the embedding sum cast to bf16 as it enters the first block
    coord_descent  inductor's coordinate-descent tuning of the pointwise and reduction kernels
    max_autotune   torch.compile's mode max-autotune-no-cudagraphs
    winners        the single variants that beat the first baseline by 1% or more, together (in a dry run, all)
    all            every single variant that ran, together (unless the same as winners)
Default: on a GPU the candidate speed-ups (cudnn bf16_residual coord_descent max_autotune winners all); on a CPU,
float32 and compiled. `--variants` with no name runs the baseline alone. A variant that fails has a line with its
error and the rest go on; one that cannot run on this GPU, or would not end inside --time_limit, is skipped with a
line saying why.

--profile: after its timed steps, each run (not the closing baseline) runs steps under torch.profiler, and prints
where the time goes by kind of kernel (matmuls, attention, the loss, Triton's fused kernels, the optimizer, fills
and memsets, copies), the top kernels, the share of the wall time the GPU was busy, and the TFLOP/s the matmul
kernels achieve; writes OUT_DIR/profile_B{B}[_VARIANT].json (with torch, CUDA and cuDNN versions and nvidia-smi's
clocks) and a gzipped Chrome trace (open it in https://ui.perfetto.dev).

--fit_gib GIB: instead, the largest micro-batch that trains in GIB of GPU memory (24: an RTX 3090 or 4090), found on
a bigger GPU: torch.cuda.set_per_process_memory_fraction caps this process. Each probe is one training step with the
batch dimension marked dynamic (one compilation serves every probe); sizes double until one does not fit, then a
binary search. With --data_dir, train_gpt2.py itself then trains 3 steps at the size found under the same cap (one
less while that runs out of memory). The cap leaves out the CUDA context (about 0.5 GiB), which a real card holds.

    python bench/train_speed.py                 # on a GPU: GPT-2 124M, seq 1024, 524,288 tokens a step, B=64
    python bench/train_speed.py --variants --profile                      # the baseline alone, profiled
    python bench/train_speed.py --variants cudnn --profile                # cuDNN's attention against the baseline
    python bench/train_speed.py --model demo --micro_batch_size 8         # the demo's step on a CPU
    python bench/train_speed.py --fit_gib 24 --data_dir data/fineweb      # what fits in 24 GiB
    python bench/train_speed.py --dry_run       # a tiny model (vocab 512) anywhere, to check every path
"""

import argparse
import functools
import gc
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack

import torch
import torch._dynamo
import torch._inductor.config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402

# the GPU candidates, the likeliest gains for the least compile time first: a run cut short loses the last
CANDIDATES = ["cudnn", "bf16_residual", "coord_descent", "max_autotune"]
SINGLE = ["float32", "eager", "compiled"] + CANDIDATES
COMBINED = ["winners", "all"]
# A fresh compilation's seconds on a GPU (GPT-2 124M's first step on an H200 took 18.7 s): the first baseline's own
# may come from inductor's cache. A compilation that tunes is estimated at this many times as long.
COMPILE_S = 20
SLOW_COMPILE = {"coord_descent": 3, "max_autotune": 8}
# The kind of a kernel, by the first pattern found in its lower-cased name, in this order: the loss's fused
# kernels are Triton's too, and cuBLAS names its kernels after the architecture (sm90_xmma_gemm..., nvjet_...).
KINDS = [
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("loss (softmax, cross-entropy)", ("log_softmax", "nll_loss", "cross_entropy")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer and gradient clipping", ("adam", "multi_tensor", "foreach")),
    ("fused elementwise and norms (Triton)", ("triton",)),
    ("fills and memsets", ("memset", "fill")),  # a zero-filled gradient, zeroed buffers
    ("copies", ("memcpy", "copy")),
    ("communication", ("nccl", "allreduce")),
]


def kind_of(name):
    name = name.lower()
    for kind, patterns in KINDS:
        if any(pattern in name for pattern in patterns):
            return kind
    return "other"


def gpu_clocks():
    """nvidia-smi's view of the GPU now (clocks in MHz, power, temperature), or why there is none."""
    if not torch.cuda.is_available():
        return {"error": "no CUDA GPU"}
    fields = "clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,temperature.gpu,driver_version"
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i",
                               str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout).strip()}
    return dict(zip(fields.split(","), (v.strip() for v in proc.stdout.splitlines()[0].split(","))))


def matmul_peak(dtype, trials=3):
    """The best FLOP/s of square matmuls on the CPU over a few sizes and trials: the practical peak to divide by,
    as a CPU has no datasheet figure (the best, since other load on the machine only ever lowers a reading)."""
    best = 0.0
    for _ in range(trials):
        for size in (512, 1024, 2048, 4096):
            a, b = (torch.randn(size, size, dtype=dtype) for _ in range(2))
            a @ b
            repeats = max(3, int(2e10 / (2 * size**3)))
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best


def shape(args, cuda):
    """The model's size, seq length and tokens a step."""
    if args.dry_run:  # the vocab small too: the CPU's bf16 matmuls of the head would take seconds a step
        return dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512), 64, args.total_batch_size or 2 * args.B * 64
    if args.model == "demo":
        size = {k: tg.DEMO_PRESET[k] for k in ("n_layer", "n_head", "n_embd")}
        return size, tg.DEMO_PRESET["seq_len"], args.total_batch_size or args.B * tg.DEMO_PRESET["seq_len"]
    return dict(tg.MODEL_SIZES[args.model]), 1024, args.total_batch_size or 524288


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


def measure(name, variants, args, cuda, peak_flops, profiled):
    """One run of the variants: its figures."""
    B = args.B
    size, T, total = shape(args, cuda)
    device = "cuda" if cuda else "cpu"
    dtype = torch.float32 if "float32" in variants else torch.bfloat16 if cuda or args.dry_run \
        else tg.autocast_dtype("auto", "cpu")
    compiled = "eager" not in variants and (cuda or "compiled" in variants or "max_autotune" in variants)
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    run_dir = tempfile.mkdtemp()  # get_args's out_dir: a new run, nothing of it kept
    train_args = tg.get_args(["--device", device, "--dtype", str(dtype).removeprefix("torch."),
                              "--compile", "on" if compiled else "off", "--out_dir", run_dir])
    shutil.rmtree(run_dir)
    torch.manual_seed(0)
    raw_model = tg.GPT(tg.GPTConfig(block_size=T, **size)).to(device)
    x = torch.randint(0, min(raw_model.config.vocab_size, 50257), (B, T), device=device)
    y = torch.roll(x, -1, 1)
    clocks = dict(before=gpu_clocks()) if profiled else None

    def steps(n):
        """n training steps, each ending in a host sync as train_gpt2.py's loop has (it reads the loss)."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            metrics = tg.train_step(model, optimizers, scaler, lambda: (x, y), total // (B * T), total, 1.0,
                                    autocast_ctx)
            loss = metrics["loss"].item()
            times.append(time.perf_counter() - start)
        return times, loss

    with ExitStack() as stack:
        apply(variants, raw_model, stack, args.dry_run)
        model, optimizers, scaler, autocast_ctx = tg.setup_training(raw_model, train_args, dtype, device)
        times, loss = steps(args.warmup_steps + args.timed_steps)
        if profiled:
            clocks["after_timed_steps"] = gpu_clocks()
            # the GPU's kernels (the CPU's ops also carry the time of the kernels they launch); a dry run, the CPU's
            kernels = cuda and not args.dry_run
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernels else [])
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                steps(args.profiled_steps)
                wall = time.perf_counter() - start
    step_s = sum(times[args.warmup_steps:]) / args.timed_steps
    tok_per_s = total / step_s
    flops_per_token = tg.flops_per_token(raw_model, T)
    result = dict(variant=name, applied=variants, dtype=str(dtype), compiled=compiled, micro_batch_size=B,
                  seq_len=T, step_tokens=total, step_ms=round(1000 * step_s, 2), tok_per_s=round(tok_per_s),
                  mfu=round(flops_per_token * tok_per_s / peak_flops, 4) if peak_flops else None,
                  # on a CPU the process's peak RSS, which only grows: a later run's includes the earlier ones'
                  peak_mem_gib=round(tg.peak_memory_gib(device), 2), first_step_s=round(times[0], 1),
                  compile_s=round(times[0] - step_s, 1), loss=loss)
    if profiled:
        # every matmul kernel of a step is a linear layer's: 2 FLOPs a weight a token forward, 4 backward
        linear_flops = 6 * sum(m.weight.numel() for m in raw_model.modules() if isinstance(m, torch.nn.Linear)) * total
        report_profile(prof, kernels, wall, linear_flops, peak_flops, clocks, result, args)
    return result


def report_profile(prof, kernels, wall, linear_flops, peak_flops, clocks, result, args):
    """Where the profiled steps' time went: printed, and written as JSON and a gzipped Chrome trace."""
    n = args.profiled_steps
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == kernels]
    busy_of = (lambda e: e.self_device_time_total) if kernels else (lambda e: e.self_cpu_time_total)
    busy = sum(busy_of(e) for e in events) / 1e6  # seconds; streams that overlap would count twice
    by_kind = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0) + busy_of(e) / 1e6
    print(f"\nprofiled {result['variant']}: {n} steps, {wall:.3f} s of wall time, the "
          f"{'GPU' if kernels else 'CPU'} busy {busy:.3f} s ({100 * busy / wall:.1f}%)")
    print(f"{'kind':40} {'ms a step':>10} {'share':>7}")
    for kind, secs in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"{kind:40} {1000 * secs / n:10.1f} {100 * secs / busy:6.1f}%")
    matmul_s = by_kind.get("matmul", 0) / n
    matmul_tflops = linear_flops / matmul_s / 1e12 if matmul_s else None
    fill_s = by_kind.get("fills and memsets", 0) / n
    print(f"matmul kernels: {1000 * matmul_s:.1f} ms a step for the linear layers' {linear_flops / 1e12:.1f} TFLOP, "
          f"{matmul_tflops or 0:.0f} TFLOP/s achieved" + (f" ({100e12 * matmul_tflops / peak_flops:.0f}% of the "
          f"peak)" if peak_flops and matmul_tflops else "") + f"; fills and memsets: {1000 * fill_s:.1f} ms a step")
    print(f"the GPU's clocks before the warm-up: {clocks['before']}; after the timed steps: "
          f"{clocks['after_timed_steps']}")
    print("the kernels that took the most time:")
    top = sorted(events, key=busy_of, reverse=True)[:25]
    for e in top:
        print(f"{1000 * busy_of(e) / 1e6 / n:9.2f} ms a step  {e.count // n:5d}x  {kind_of(e.key)[:12]:12}  "
              f"{e.key[:110]}")
    os.makedirs(args.out_dir, exist_ok=True)
    run_name = f"B{result['micro_batch_size']}" + ("" if result["variant"] == "baseline" else f"_{result['variant']}")
    trace = os.path.join(args.out_dir, f"trace_{run_name}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as out:
        shutil.copyfileobj(f, out)
    os.remove(trace)
    versions = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    figures = dict(result, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   profiled_wall_s=wall, busy_s=busy, versions=versions, gpu_clocks=clocks,
                   matmul_tflops=matmul_tflops, fills_and_memsets_ms_a_step=1000 * fill_s,
                   ms_a_step_by_kind={k: 1000 * v / n for k, v in by_kind.items()},
                   top_kernels=[dict(name=e.key, ms_a_step=busy_of(e) / 1e3 / n, calls_a_step=e.count / n)
                                for e in top])
    path = os.path.join(args.out_dir, f"profile_{run_name}.json")
    with open(path, "w") as f:
        json.dump(figures, f, indent=1)
    print(f"trace: {trace}.gz; figures: {path}\n", flush=True)


def compare(args, cuda, peak_flops):
    """The baseline, each variant, the baseline again: a JSON line each."""
    os.makedirs(args.out_dir, exist_ok=True)
    capability = torch.cuda.get_device_capability() if cuda else None
    start = time.perf_counter()

    def record(line):
        print(json.dumps(line), flush=True)
        with open(os.path.join(args.out_dir, "speed.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")

    first = measure("baseline", [], args, cuda, peak_flops, args.profile)
    record(first)
    baseline_s = time.perf_counter() - start
    ran, winners = [], None
    for variant in args.variants:
        if variant in SINGLE:
            applied = [variant]
        elif variant == "winners":  # in a dry run every one: the CPU's timings mean nothing, the paths do
            applied = winners = [r["variant"] for r in ran if r["tok_per_s"] >= 1.01 * first["tok_per_s"]
                                 or args.dry_run]
        else:
            applied = [r["variant"] for r in ran]
        compile_s = first["compile_s"] if args.dry_run or not cuda else max(first["compile_s"], COMPILE_S)
        factor = max((SLOW_COMPILE.get(v, 1) for v in applied), default=1)
        estimate = baseline_s - first["compile_s"] + factor * compile_s
        left = args.time_limit - (time.perf_counter() - start) - baseline_s if args.time_limit else float("inf")
        skipped = None
        if variant == "cudnn" and capability != (9, 0) and not args.dry_run:
            skipped = f"cuDNN's attention is tried on compute capability 9.0 only; this device has {capability}"
        elif variant in COMBINED and len(applied) < 2:
            skipped = f"fewer than two single variants to combine: {applied}"
        elif variant == "all" and applied == winners:
            skipped = f"the same variants as winners: {applied}"
        elif estimate > left:
            skipped = f"about {estimate:.0f} s needed, {left:.0f} s left before the closing baseline"
        if skipped:
            record(dict(variant=variant, applied=applied, skipped=skipped))
            continue
        try:
            result = measure(variant, applied, args, cuda, peak_flops, args.profile)
        except Exception as e:  # a variant this GPU or torch cannot run (no kernel, out of memory): the rest go on
            record(dict(variant=variant, applied=applied, error=f"{type(e).__name__}: {str(e).splitlines()[0]}"))
            continue
        result["vs_baseline"] = round(result["tok_per_s"] / first["tok_per_s"], 4)
        record(result)
        if variant in SINGLE:
            ran.append(result)
    if args.variants:
        last = measure("baseline", [], args, cuda, peak_flops, False)
        last["vs_baseline"] = round(last["tok_per_s"] / first["tok_per_s"], 4)
        record(last)
    print(f"the comparison took {time.perf_counter() - start:.0f} s; its lines are in "
          f"{os.path.join(args.out_dir, 'speed.jsonl')}")


def largest_micro_batch(args, cuda):
    """The largest micro-batch that trains in --fit_gib of GPU memory; with --data_dir, checked by train_gpt2.py."""
    if args.B < 2:
        tg.die("--micro_batch_size (the first size probed) must be 2 or more with --fit_gib (a dimension of size 1 "
               "cannot be marked dynamic)")
    size, T, _ = shape(args, cuda)
    size.pop("vocab_size", None)  # the probes use GPT-2's vocab, as train_gpt2.py's check does
    device = "cuda" if cuda else "cpu"
    fraction = None
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        if args.fit_gib * 2**30 > total:
            tg.die(f"--fit_gib {args.fit_gib:g} is more than this GPU's {total / 2**30:.1f} GiB")
        fraction = args.fit_gib * 2**30 / total
        torch.cuda.set_per_process_memory_fraction(fraction)
    compile_flag = "on" if cuda else "off"  # auto, as train_gpt2.py
    run_dir = tempfile.mkdtemp()
    train_args = tg.get_args(["--device", device, "--dtype", "bfloat16", "--compile", compile_flag,
                              "--out_dir", run_dir])
    shutil.rmtree(run_dir)
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
            ok = B <= 6 if args.dry_run else True  # a dry run: "fits" stands for B <= 6
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB allocated" if cuda else ""
        except Exception as e:  # torch.OutOfMemoryError, or a RuntimeError from a library's own allocation
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and not any(
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

    print(f"{'tiny (dry run)' if args.dry_run else args.model}, seq {T}, bf16, compile {compile_flag}, "
          f"{'capped at %g GiB' % args.fit_gib if cuda else 'no cap (CPU)'}; the first probe compiles", flush=True)
    fit, no_fit = 0, args.B
    while fits(no_fit):
        fit, no_fit = no_fit, 2 * no_fit
    while no_fit - fit > 1:
        mid = (fit + no_fit) // 2
        fit, no_fit = (mid, no_fit) if fits(mid) else (fit, mid)
    if fit == 0:
        tg.die(f"not even micro-batch {args.B} fits in {args.fit_gib:g} GiB: try a smaller --micro_batch_size")
    print(f"largest micro-batch: {fit} x {T} tokens", flush=True)
    if not args.data_dir:
        return 0

    model = optimizers = None  # this process's memory back, for the check's
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    out_dir = os.path.join(os.path.abspath(args.out_dir), "fit-run")
    cap = f"import torch; torch.cuda.set_per_process_memory_fraction({fraction}); " if cuda else ""
    model_flags = [f"--{k}={v}" for k, v in size.items()] + ["--block_size", str(T)]
    # A real run compiles for one shape and also evaluates: on an H200 it needed 0.5 GiB more than the probe, so a
    # size that fits the probe by less may not train. Step down until train_gpt2.py itself trains.
    for B in range(fit, max(fit - 4, 0), -1):
        cmd = [sys.executable, "-c", cap + "import runpy, sys; sys.argv[0] = 'train_gpt2.py'; "
               "runpy.run_path('train_gpt2.py', run_name='__main__')", *model_flags,
               "--data_dir", os.path.abspath(args.data_dir), "--out_dir", out_dir, "--seq_len", str(T),
               "--micro_batch_size", str(B), "--total_batch_size", str(2 * B * T), "--max_steps", "3",
               "--eval_every", "100", "--val_tokens", str(B * T), "--num_samples", "0", "--dtype", "bfloat16",
               "--compile", compile_flag, "--device", device]
        print(f"check: train_gpt2.py at micro-batch {B} under the same cap", flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)
        proc = subprocess.run(cmd, cwd=REPO)
        if proc.returncode != 2:  # 2: out of memory (or bad input, which the first try would show)
            break
    print(f"train_gpt2.py at --micro_batch_size {B}: {'trained 3 steps' if proc.returncode == 0 else 'FAILED'}")
    return proc.returncode


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["demo", *tg.MODEL_SIZES], help="the model: default gpt2 (124M, seq 1024) "
                   "on a GPU, demo (train_gpt2.py --demo's, seq 256) on a CPU")
    p.add_argument("--micro_batch_size", dest="B", type=tg.positive_int,
                   help="default 64 for GPT-2's sizes, 4 for the demo (with --fit_gib: the first size probed, 8)")
    p.add_argument("--total_batch_size", type=tg.positive_int,
                   help="tokens a step: default 524,288 for GPT-2's sizes, one micro-batch for the demo")
    p.add_argument("--variants", nargs="*", choices=SINGLE + COMBINED, metavar="VARIANT",
                   help="run after the baseline (see above); none: the baseline alone")
    p.add_argument("--warmup_steps", type=tg.positive_int, default=2, help="untimed; the first compiles")
    p.add_argument("--timed_steps", type=tg.positive_int, default=4)
    p.add_argument("--profile", action="store_true", help="profile each run after its timed steps (see above)")
    p.add_argument("--profiled_steps", type=tg.positive_int, default=2)
    p.add_argument("--fit_gib", type=float, help="find the largest micro-batch that trains in this much GPU memory")
    p.add_argument("--data_dir", help="with --fit_gib: token shards for train_gpt2.py's check at the size found")
    p.add_argument("--time_limit", type=tg.positive_int, help="seconds: skip a variant that would not end in time "
                   "(the closing baseline's time kept); default: no limit")
    p.add_argument("--peak_flops", type=float, help="bf16 peak FLOP/s for MFU: default the table's for known GPUs, "
                   "the bf16 matmul peak measured here on a CPU")
    p.add_argument("--out_dir", default=os.path.join(REPO, "out", "train-speed"),
                   help="speed.jsonl, the profiles and traces, the --fit_gib check's run")
    p.add_argument("--dry_run", action="store_true", help="a tiny model (vocab 512) at seq 64, micro-batch 4")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if args.fit_gib is not None and not cuda and not args.dry_run:
        tg.die("--fit_gib needs a CUDA GPU (--dry_run runs a tiny model anywhere)")
    args.model = args.model or ("gpt2" if cuda else "demo")
    gpt2_size = args.model != "demo" and not args.dry_run
    args.B = args.B or (8 if args.fit_gib else 64 if gpt2_size else 4)
    if args.variants is None:
        args.variants = CANDIDATES + COMBINED if cuda or args.dry_run else ["float32", "compiled"]
    _, T, total = shape(args, cuda)
    if args.fit_gib is None and total % (args.B * T):
        tg.die(f"{total:,} tokens a step is not a whole number of micro-batches of {args.B} x {T}: give "
               f"--total_batch_size")
    name = torch.cuda.get_device_name() if cuda else "CPU" + (" (dry run)" if args.dry_run else "")
    print(f"{name}: torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.get_num_threads()} CPU threads", flush=True)
    if args.fit_gib is not None:
        sys.exit(largest_micro_batch(args, cuda))
    peak_flops = args.peak_flops or (tg.PEAK_BF16_FLOPS.get(name) if cuda else None)
    if not cuda and not args.dry_run and not peak_flops:
        peak_flops = matmul_peak(torch.bfloat16)
        print(f"the CPU's bf16 matmul peak, measured: {peak_flops / 1e12:.3f} TFLOP/s (MFU is against it)")
    print(f"{'tiny' if args.dry_run else args.model}, seq {T}, micro-batch {args.B}, {total:,} tokens a step; "
          f"{args.warmup_steps} warm-up and {args.timed_steps} timed steps a run; variants: "
          f"{' '.join(args.variants) or 'none'}", flush=True)
    compare(args, cuda, peak_flops)


if __name__ == "__main__":
    main()
