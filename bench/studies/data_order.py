"""
--data_order shuffled vs sequential on a train shard whose first half is one kind of text (A) and second half
another (B), with a val shard of B. Read in file order, the model sees no B until half an epoch is gone; shuffled,
it sees both from the start. Prints both val loss curves over one epoch.

    python bench/studies/data_order.py   # A: the Python stdlib's source, B: ../shared/data/tinyshakespeare_input.txt
    python bench/studies/data_order.py --text_a 'some/*.parquet' --text_b 'other/*.txt'

With --step_ms it instead runs the demo config for a few dozen steps in each order and prints the median of
the step lines' ms (the whole step: the log has no data column of its own; needs data/demo: python
prepare_fineweb.py --demo).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
from train_gpt2 import find_shards, load_shard  # noqa: E402

MODEL = ["--n_layer", "2", "--n_head", "2", "--n_embd", "64", "--block_size", "64", "--seq_len", "64",
         "--micro_batch_size", "8", "--lr", "3e-3", "--dtype", "float32", "--compile", "off", "--num_samples", "0"]


def run(args):
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def tokenize(files, out_dir):
    """All the tokens of these files, in order: prepare_fineweb.py writes them (shards of 50k) and we read them back in order."""
    run(["prepare_fineweb.py", "--input", *files, "--out_dir", out_dir, "--shard_size", "50000", "--workers", "1"])
    return np.concatenate([np.asarray(load_shard(f)) for f in find_shards(out_dir, "val") + find_shards(out_dir, "train")])


def save(path, tokens):
    np.save(path + ".tmp.npy", tokens.astype(np.uint16))
    os.replace(path + ".tmp.npy", path)


def curves(args):
    a_files = sorted(f for pattern in args.text_a for f in glob.glob(pattern))
    b_files = sorted(f for pattern in args.text_b for f in glob.glob(pattern))
    if not a_files or not b_files:
        sys.exit("error: --text_a and --text_b must each match at least one file")
    a = tokenize(a_files, os.path.join(args.work_dir, "tok_a"))
    b = tokenize(b_files, os.path.join(args.work_dir, "tok_b"))
    n = args.tokens_each
    if len(a) < n or len(b) < n + args.val_tokens:
        sys.exit(f"error: need {n:,} tokens of A and {n + args.val_tokens:,} of B, have {len(a):,} and {len(b):,}; "
                 f"lower --tokens_each or give more text")
    data_dir = os.path.join(args.work_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    save(os.path.join(data_dir, "mix_train_000001.npy"), np.concatenate([a[:n], b[:n]]))  # A, then B
    save(os.path.join(data_dir, "mix_val_000000.npy"), b[n: n + args.val_tokens])  # B the run never trains on
    steps = (2 * n - 1) // args.total_batch_size  # one epoch
    every = steps // args.evals
    results = {}
    for order in ("sequential", "shuffled"):
        out = os.path.join(args.work_dir, order)
        run(["train_gpt2.py", *MODEL, "--data_dir", data_dir, "--out_dir", out, "--data_order", order,
             "--total_batch_size", str(args.total_batch_size), "--max_steps", str(every * args.evals),
             "--warmup_steps", str(every // 2), "--eval_every", str(every), "--val_tokens", str(args.val_tokens),
             "--save_every", str(10 * steps)])
        results[order] = {r["step"]: r["val_loss"] for r in read_log(out) if "val_loss" in r}
    print(f"\none epoch = {steps} steps of {args.total_batch_size} tokens; A = {len(a_files)} files, B = {len(b_files)}")
    print("| step | fraction of the epoch | val loss (B), sequential | val loss (B), shuffled |\n|---:|---:|---:|---:|")
    for step in sorted(results["sequential"]):
        print(f"| {step} | {step / steps:.3f} | {results['sequential'][step]:.3f} | {results['shuffled'][step]:.3f} |")


def step_ms(args):
    medians = {}
    for order in ("sequential", "shuffled"):
        out = os.path.join(args.work_dir, f"step_ms_{order}")
        run(["train_gpt2.py", "--demo", "--data_order", order, "--max_steps", str(args.steps), "--out_dir", out,
             "--eval_every", str(10 * args.steps), "--val_tokens", "4096", "--num_samples", "0",
             "--save_every", str(10 * args.steps), *args.extra])
        values = sorted(r["ms"] for r in read_log(out) if "ms" in r and r["step"] >= 2)
        medians[order] = values[len(values) // 2]
    print("\n| order | median step ms |\n|---|---:|")
    for order, ms in medians.items():
        print(f"| {order} | {ms:.3f} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    stdlib = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    p.add_argument("--text_a", nargs="+", default=stdlib[:60],
                   help="files of the first half of the train shard (.txt/.py: a document per file, .jsonl, .parquet)")
    p.add_argument("--text_b", nargs="+", default=[os.path.join(REPO, "..", "shared", "data", "tinyshakespeare_input.txt")],
                   help="files of the second half, and of the val shard")
    p.add_argument("--tokens_each", type=int, default=80_000, help="train tokens of each kind")
    p.add_argument("--val_tokens", type=int, default=8192, help="val tokens (of B, never trained on)")
    p.add_argument("--total_batch_size", type=int, default=512, help="tokens per step")
    p.add_argument("--evals", type=int, default=8, help="val losses over the epoch")
    p.add_argument("--work_dir", default="out/bench-data-order", help="shards and runs go here")
    p.add_argument("--step_ms", action="store_true", help="measure the median step ms on the demo config instead")
    p.add_argument("--steps", type=int, default=40, help="--step_ms: steps of each run")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="--step_ms: more train_gpt2.py flags")
    args = p.parse_args()
    step_ms(args) if args.step_ms else curves(args)


if __name__ == "__main__":
    main()
