"""
Training throughput of train_gpt2.py's step: tokens/s, model FLOPs per token (6N + attention), achieved FLOP/s,
MFU and peak memory, for each variant given, after warm-up, in one run. On CPU it first measures the machine's
bf16 and fp32 matmul peak, since there is no datasheet peak to divide by.

    python bench/train_throughput.py --preset demo --variants eager:float32 eager:bfloat16 compile:bfloat16
    python bench/train_throughput.py --preset gpt2 --micro_batch_size 16 --variants compile:bfloat16   # on a GPU
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402

PRESETS = {"demo": {k: tg.DEMO_PRESET[k] for k in ("n_layer", "n_head", "n_embd", "block_size")},
           **{name: dict(size, block_size=1024) for name, size in tg.MODEL_SIZES.items()}}


def matmul_peak(dtype, device, trials=3):
    """Best FLOP/s of square matmuls over a few sizes and trials: the practical peak of this device in this dtype
    (the best, since other load on the machine only ever lowers a reading)."""
    best = 0.0
    for _ in range(trials):
        for size in (512, 1024, 2048, 4096):
            a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
            for _ in range(2):
                a @ b
            repeats = max(3, int(2e10 / (2 * size**3)))
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            sync(device)
            best = max(best, 2 * size**3 * repeats / (time.perf_counter() - start))
    return best


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_variant(args, mode, dtype_name, device):
    torch.manual_seed(0)
    overrides = {k: getattr(args, k) for k in ("n_embd", "n_layer", "n_head") if getattr(args, k)}
    config = tg.GPTConfig(**{**PRESETS[args.preset], **overrides})
    T = args.seq_len or config.block_size
    model = tg.GPT(config).to(device)
    opt_args = argparse.Namespace(optimizer="adamw", lr=1e-4, weight_decay=0.1, muon_lr=0.02, muon_momentum=0.95)
    optimizers = tg.make_optimizers(model, opt_args, device.split(":")[0])
    dtype = getattr(torch, dtype_name)
    autocast_ctx = tg.autocast_context(device.split(":")[0], dtype)
    scaler = torch.amp.GradScaler(device.split(":")[0], enabled=dtype == torch.float16)
    train_model = model if mode == "eager" else torch.compile(model, mode=None if mode == "compile" else mode)
    B = args.micro_batch_size
    data = torch.randint(0, 50257, (B, T + 1))
    pin = device.startswith("cuda")

    def batch():  # on the device, as the loaders give it: pinned, then copied alongside the compute
        buf = (data.pin_memory() if pin else data).to(device, non_blocking=True)
        return buf[:, :-1], buf[:, 1:]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        loss = tg.train_step(train_model, optimizers, scaler, batch, args.grad_accum, B * T * args.grad_accum,
                             1.0, autocast_ctx)["loss"]
    loss.item()
    step_seconds = []  # the median step: other load on the machine only ever slows some steps down
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = tg.train_step(train_model, optimizers, scaler, batch, args.grad_accum, B * T * args.grad_accum,
                             1.0, autocast_ctx)["loss"]
        loss.item()
        sync(device)
        step_seconds.append(time.perf_counter() - start)
    seconds = sorted(step_seconds)[len(step_seconds) // 2]
    tokens = B * T * args.grad_accum
    flops_per_token = tg.flops_per_token(model, T)
    return dict(tok_s=tokens / seconds, flops_per_token=flops_per_token, flops=flops_per_token * tokens / seconds,
                mem=tg.peak_memory_gib(device), T=T, params=tg.num_params(model))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="demo", choices=list(PRESETS), help="model size")
    p.add_argument("--n_embd", type=int, help="override the width")
    p.add_argument("--n_layer", type=int, help="override the depth")
    p.add_argument("--n_head", type=int, help="override the number of heads")
    p.add_argument("--micro_batch_size", type=int, default=16, help="sequences per forward pass")
    p.add_argument("--seq_len", type=int, help="tokens per sequence (default: the context length)")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per timed step")
    p.add_argument("--variants", nargs="+", default=["eager:float32", "eager:bfloat16", "compile:bfloat16"],
                   help="MODE:DTYPE to compare, MODE eager, compile or a torch.compile mode (max-autotune)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--peak_flops", type=float, help="bf16 peak FLOP/s to divide by (GPUs known to train_gpt2.py are detected)")
    args = p.parse_args()
    device = tg.init_distributed(args.device)
    if device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")
        print(f"device: {torch.cuda.get_device_name(device)}")
        peak = {"bfloat16": args.peak_flops or tg.PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(device))}
    else:
        peak = {dt: matmul_peak(getattr(torch, dt), device) for dt in ("bfloat16", "float32")}
        print(f"device: {device}, {torch.get_num_threads()} threads | measured matmul peak: "
              f"bf16 {peak['bfloat16'] / 1e12:.3f} TFLOP/s, fp32 {peak['float32'] / 1e12:.3f} TFLOP/s")
    print("| variant | tok/s | FLOPs/token | achieved TFLOP/s | MFU (vs bf16 peak) | vs first | peak mem GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    first = None
    for variant in args.variants:
        mode, dtype_name = variant.split(":")
        r = bench_variant(args, mode, dtype_name, device)
        first = first or r["tok_s"]
        mfu = f"{r['flops'] / peak['bfloat16'] * 100:.1f}%" if peak.get("bfloat16") else "n/a"
        print(f"| {args.preset} ({r['params'] / 1e6:.1f}M) B={args.micro_batch_size} T={r['T']} {variant} | "
              f"{r['tok_s']:,.0f} | {r['flops_per_token'] / 1e6:.1f}M | {r['flops'] / 1e12:.3f} | {mfu} | "
              f"{r['tok_s'] / first:.2f}x | {r['mem']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
