"""
AdamW vs Muon at the demo scale on real text: the same model, tokens and schedule, only --optimizer differs.
Prints both val loss curves and how many tokens each needs to reach AdamW's final val loss.

    python bench/muon_vs_adamw.py --data_dir data/fineweb-bench     # shards of real text (see --make_from)
    python bench/muon_vs_adamw.py --make_from '../shared/data/fineweb/fineweb_legal_pilot_batches/*.parquet'
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args):
    subprocess.run([sys.executable, *args], cwd=REPO, check=True)


def val_curve(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return {r["step"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}


def tokens_to_reach(curve, target, tokens_per_step):
    """Tokens at the first eval whose val loss is at or below target, interpolated from the eval before it."""
    steps = sorted(curve)
    for prev, step in zip(steps, steps[1:]):
        if curve[step] <= target:
            frac = (curve[prev] - target) / (curve[prev] - curve[step]) if curve[prev] > target else 0.0
            return (prev + frac * (step - prev)) * tokens_per_step
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default="data/fineweb-bench", help="token shards to train on")
    p.add_argument("--make_from", help="tokenize these .parquet/.jsonl/.txt files into --data_dir first")
    p.add_argument("--out_dir", default="out/bench-muon", help="where the two runs write")
    p.add_argument("--max_steps", type=int, default=150, help="steps of each run")
    p.add_argument("--eval_every", type=int, default=15, help="val loss every N steps")
    p.add_argument("--total_batch_size", type=int, default=4096, help="tokens per step (the demo preset's)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_gpt2.py flags for both runs")
    args = p.parse_args()
    if args.make_from:
        run(["prepare_fineweb.py", "--input", args.make_from, "--out_dir", args.data_dir, "--shard_size", "500000"])
    common = ["train_gpt2.py", "--demo", "--data_dir", args.data_dir, "--max_steps", str(args.max_steps),
              "--warmup_steps", str(args.max_steps // 10), "--eval_every", str(args.eval_every), "--num_samples", "0",
              "--save_every", str(10 * args.max_steps), "--total_batch_size", str(args.total_batch_size), *args.extra]
    curves = {}
    for optimizer in ("adamw", "muon"):
        out = os.path.join(args.out_dir, optimizer)
        run([*common, "--optimizer", optimizer, "--out_dir", out])
        curves[optimizer] = val_curve(out)
    tokens_per_step = args.total_batch_size
    target = curves["adamw"][args.max_steps]
    print("\n| step | tokens | AdamW val loss | Muon val loss |\n|---:|---:|---:|---:|")
    for step in sorted(curves["adamw"]):
        print(f"| {step} | {step * tokens_per_step:,} | {curves['adamw'][step]:.4f} | {curves['muon'][step]:.4f} |")
    for optimizer in ("adamw", "muon"):
        tokens = tokens_to_reach(curves[optimizer], target, tokens_per_step)
        print(f"{optimizer}: reaches AdamW's final val loss {target:.4f} after "
              f"{'never' if tokens is None else f'{tokens:,.0f} tokens'}")


if __name__ == "__main__":
    main()
