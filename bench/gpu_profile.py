"""
Where the GPU's time goes in a training step of GPT-2 124M (issue 46: 43.8% MFU on an H200, the target 55%). The
model, AdamW, bf16 autocast, torch.compile and train_step are train_gpt2.py's own, at seq 1024 and 524,288 tokens a
step, on random tokens (speed does not depend on what they say). After the warm-up, some steps are timed plainly
(tok/s and MFU, as train_gpt2.py computes them), then some under torch.profiler. Prints the kernels that take the
most GPU time, the share of each kind (matmuls, attention, the loss, Triton's fused elementwise and norm kernels,
the optimizer, fills and memsets, copies), how much of the wall time the GPU was idle, and the TFLOP/s the matmul
kernels achieve (the linear layers' 6 FLOPs a weight a token over the matmul kernels' time); writes the profile as
a gzipped Chrome trace (open it in https://ui.perfetto.dev) and the figures as JSON, with the torch, CUDA and cuDNN
versions and the GPU's clocks (nvidia-smi's, before the warm-up and after the timed steps).

    python bench/gpu_profile.py --out_dir out/gpu/profile                     # on a GPU: micro-batch 64
    python bench/gpu_profile.py --out_dir out/gpu/profile --micro_batch_size 32
    python bench/gpu_profile.py --out_dir out/gpu/profile --attention cudnn   # SDPA's cuDNN backend forced
    python bench/gpu_profile.py --dry_run      # a tiny model, to check the paths (the CPU's ops, not kernels)
"""

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402

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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro_batch_size", type=tg.positive_int, default=64)
    p.add_argument("--warmup_steps", type=tg.positive_int, default=4, help="untimed: compilation, the allocator's warm-up")
    p.add_argument("--timed_steps", type=tg.positive_int, default=4, help="timed without the profiler")
    p.add_argument("--profiled_steps", type=tg.positive_int, default=2)
    p.add_argument("--attention", choices=["auto", "cudnn", "flash"], default="auto",
                   help="SDPA's backend: auto is torch's own choice (train_gpt2.py's); cudnn or flash forces one")
    p.add_argument("--out_dir", default=os.path.join(REPO, "out", "gpu-profile"), help="trace and figures")
    p.add_argument("--dry_run", action="store_true", help="a tiny model (vocab 512) at seq 64; the CPU's ops profiled")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        sys.exit("error: this needs a CUDA GPU (--dry_run runs a tiny model anywhere)")
    device = "cuda" if cuda else "cpu"
    B = args.micro_batch_size
    T, total = (64, 2 * B * 64) if args.dry_run else (1024, 524288)
    if total % (B * T):
        sys.exit(f"error: 524,288 tokens a step is not a whole number of micro-batches of {B} x {T}")
    # the dry run's vocab is small too: the CPU's bf16 matmuls of the head would take seconds a step
    size = dict(n_layer=2, n_head=2, n_embd=64, vocab_size=512) if args.dry_run else tg.MODEL_SIZES["gpt2"]
    compile_flag = "on" if cuda else "off"  # train_gpt2.py's auto
    run_dir = tempfile.mkdtemp()  # get_args's out_dir: a new run, nothing of it kept
    train_args = tg.get_args(["--device", device, "--dtype", "bfloat16", "--compile", compile_flag,
                              "--out_dir", run_dir])
    shutil.rmtree(run_dir)
    torch.manual_seed(0)
    raw_model = tg.GPT(tg.GPTConfig(block_size=T, **size)).to(device)
    model, optimizers, scaler, autocast_ctx = tg.setup_training(raw_model, train_args, torch.bfloat16, device)
    flops_per_token = tg.flops_per_token(raw_model, T)
    # every matmul kernel of a step is a linear layer's: 2 FLOPs a weight a token forward, 4 backward
    linear_flops = 6 * sum(m.weight.numel() for m in raw_model.modules() if isinstance(m, torch.nn.Linear)) * total
    peak_flops = tg.PEAK_BF16_FLOPS.get(torch.cuda.get_device_name()) if cuda else None
    x = torch.randint(0, min(raw_model.config.vocab_size, 50257), (B, T), device=device)
    y = torch.roll(x, -1, 1)
    grad_accum_steps = total // (B * T)

    def steps(n):
        """n training steps; their seconds. Each ends in a host sync, as train_gpt2.py's steps do (it reads the
        loss), so that the GPU's idle time between steps is the loop's."""
        start = time.perf_counter()
        for _ in range(n):
            metrics = tg.train_step(model, optimizers, scaler, lambda: (x, y), grad_accum_steps, total, 1.0,
                                    autocast_ctx)
            metrics["loss"].item()  # a host sync
        return time.perf_counter() - start

    # The GPU's kernels (the CPU's ops also carry the time of the kernels they launch); a dry run, the CPU's ops.
    kernels = cuda and not args.dry_run
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if kernels else [])
    backend = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[args.attention]
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    versions = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    clocks = dict(before=gpu_clocks())
    print(f"torch {versions['torch']}, CUDA {versions['cuda']}, cuDNN {versions['cudnn']}; the GPU's clocks: "
          f"{clocks['before']}", flush=True)
    print(f"{name}: GPT-2 {'tiny' if args.dry_run else '124M'}, seq {T}, micro-batch {B} x {grad_accum_steps} "
          f"micro-steps, bf16, compile {compile_flag}, attention {args.attention}; warm-up (compiles)", flush=True)
    # around every step: torch.compile settles the attention backend when it traces the first
    with sdpa_kernel([backend]) if backend else nullcontext():
        steps(args.warmup_steps)
        seconds = steps(args.timed_steps)
        clocks["after_timed_steps"] = gpu_clocks()
        with profile(activities=activities) as prof:
            wall = steps(args.profiled_steps)
    tok_per_s = args.timed_steps * total / seconds
    mfu = flops_per_token * tok_per_s / peak_flops if peak_flops else None
    print(f"timed: {1000 * seconds / args.timed_steps:.1f} ms a step, {tok_per_s:,.0f} tok/s"
          + (f", MFU {100 * mfu:.1f}%" if mfu else ""), flush=True)

    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == kernels]
    busy_of = (lambda e: e.self_device_time_total) if kernels else (lambda e: e.self_cpu_time_total)
    busy = sum(busy_of(e) for e in events) / 1e6  # seconds; streams that overlap would count twice
    by_kind = {}
    for e in events:
        by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0) + busy_of(e) / 1e6
    print(f"\nprofiled: {args.profiled_steps} steps, {wall:.3f} s of wall time, the {'GPU' if kernels else 'CPU'} "
          f"busy {busy:.3f} s ({100 * busy / wall:.1f}%)")
    print(f"{'kind':40} {'ms a step':>10} {'share':>7}")
    for kind, secs in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"{kind:40} {1000 * secs / args.profiled_steps:10.1f} {100 * secs / busy:6.1f}%")
    matmul_s = by_kind.get("matmul", 0) / args.profiled_steps
    matmul_tflops = linear_flops / matmul_s / 1e12 if matmul_s else None
    fill_s = by_kind.get("fills and memsets", 0) / args.profiled_steps
    print(f"matmul kernels: {1000 * matmul_s:.1f} ms a step for the linear layers' {linear_flops / 1e12:.1f} TFLOP, "
          f"{matmul_tflops or 0:.0f} TFLOP/s achieved" + (f" ({100e12 * matmul_tflops / peak_flops:.0f}% of the "
          f"peak)" if peak_flops and matmul_tflops else "") + f"; fills and memsets: {1000 * fill_s:.1f} ms a step")
    print(f"the GPU's clocks after the timed steps: {clocks['after_timed_steps']}")
    print("\nthe kernels that took the most time:")
    top = sorted(events, key=busy_of, reverse=True)[:25]
    for e in top:
        print(f"{1000 * busy_of(e) / 1e6 / args.profiled_steps:9.2f} ms a step  {e.count // args.profiled_steps:5d}x  "
              f"{kind_of(e.key)[:12]:12}  {e.key[:110]}")

    os.makedirs(args.out_dir, exist_ok=True)
    run_name = f"B{B}" + ("" if args.attention == "auto" else f"_{args.attention}")
    trace = os.path.join(args.out_dir, f"trace_{run_name}.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as out:
        shutil.copyfileobj(f, out)
    os.remove(trace)
    figures = dict(device=name, micro_batch_size=B, seq_len=T, attention=args.attention,
                   step_ms=1000 * seconds / args.timed_steps, tok_per_s=tok_per_s, mfu=mfu,
                   profiled_wall_s=wall, busy_s=busy, versions=versions, gpu_clocks=clocks,
                   matmul_tflops=matmul_tflops, fills_and_memsets_ms_a_step=1000 * fill_s,
                   ms_a_step_by_kind={k: 1000 * v / args.profiled_steps for k, v in by_kind.items()},
                   top_kernels=[dict(name=e.key, ms_a_step=busy_of(e) / 1e3 / args.profiled_steps,
                                     calls_a_step=e.count / args.profiled_steps) for e in top])
    with open(os.path.join(args.out_dir, f"profile_{run_name}.json"), "w") as f:
        json.dump(figures, f, indent=1)
    print(f"\ntrace: {trace}.gz; figures: {os.path.join(args.out_dir, f'profile_{run_name}.json')}")


if __name__ == "__main__":
    main()
