"""
Muon vs AdamW on FineWeb text: AdamW at three learning rates, and Muon (for the blocks' matrices, AdamW for the
rest). The same model, tokens and schedule in every run. Prints the val loss curves, and for each run the tokens
and the wall-clock it needs to reach the target: the best AdamW run's final val loss (--target to fix one).

    python bench/studies/muon_vs_adamw.py --make_from '../shared/data/fineweb/fineweb_legal_pilot_batches/*.parquet'
    python bench/studies/muon_vs_adamw.py --data_dir data/fineweb-bench --max_steps 1000    # shards made already

By default the runs go one after the other and Muon's AdamW part takes the best AdamW lr. With --parallel all
runs train at once, one thread each, so that a machine shared with other work slows them alike (then Muon's
AdamW lr is --muon_adamw_lr, as the best is not known yet). Wall-clock is the sum of the logged step times up to
the target (evals excluded); CPU seconds are each run's whole process (evals included).
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEVELS = [8.0, 7.5, 7.0, 6.5, 6.0, 5.5, 5.0, 4.5]  # fixed val losses, to see whether a lead grows or shrinks


def start(args, log_path=None, threads=None):
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    out = open(log_path, "w") if log_path else None
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def finish(proc):
    """Wait for a run; its CPU seconds (user + system), from the kernel's account of that one process."""
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(proc.args[1:3])}... exited {os.waitstatus_to_exitcode(status)}; see its log")
    return usage.ru_utime + usage.ru_stime


def read_run(out_dir):
    """Val loss by step, and the wall-clock ms of each training step, from the run's log.jsonl."""
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return ({r["step"]: r["val_loss"] for r in records if "val_loss" in r},
            {r["step"]: r["ms"] for r in records if "ms" in r})


def step_to_reach(curve, target):
    """The (fractional) step at which val loss first reaches target, interpolated between evals; None if never."""
    steps = sorted(curve)
    for prev, step in zip(steps, steps[1:]):
        if curve[step] <= target:
            frac = (curve[prev] - target) / (curve[prev] - curve[step]) if curve[prev] > target else 0.0
            return prev + frac * (step - prev)
    return None


def seconds_to(step_ms, step):
    """Training wall-clock up to a fractional step: the logged step times, the last one in part."""
    whole = int(step)
    return (sum(ms for s, ms in step_ms.items() if s < whole) + (step - whole) * step_ms.get(whole, 0.0)) / 1000


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default="data/fineweb-bench", help="token shards to train on")
    p.add_argument("--make_from", help="tokenize these .parquet/.jsonl/.txt files into --data_dir first")
    p.add_argument("--out_dir", default="out/bench-muon", help="where the runs write")
    p.add_argument("--adamw_lrs", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3], help="AdamW lrs to try")
    p.add_argument("--muon_lr", type=float, default=0.02, help="Muon's lr")
    p.add_argument("--muon_adamw_lr", type=float, help="lr of the AdamW part of the Muon run (default: best AdamW)")
    p.add_argument("--muon_weight_decay", type=float, default=0.0, help="Muon's weight decay")
    p.add_argument("--parallel", action="store_true", help="train all runs at once, one thread each")
    p.add_argument("--report", action="store_true", help="train nothing: compare the runs already in --out_dir")
    p.add_argument("--target", type=float, help="val loss to reach (default: the best AdamW run's final)")
    p.add_argument("--n_layer", type=int, default=6)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--total_batch_size", type=int, default=4096, help="tokens per step")
    p.add_argument("--max_steps", type=int, default=250, help="steps of each run")
    p.add_argument("--eval_every", type=int, default=25, help="val loss every N steps")
    p.add_argument("--val_tokens", type=int, default=32768, help="val tokens per eval")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train_gpt2.py flags for every run")
    args = p.parse_args()
    if args.parallel and args.muon_adamw_lr is None and not args.report:
        sys.exit("error: --parallel starts Muon before the best AdamW lr is known: give --muon_adamw_lr")
    if args.make_from and not args.report:
        subprocess.run([sys.executable, "prepare_fineweb.py", "--input", args.make_from, "--out_dir", args.data_dir,
                        "--shard_size", "500000"], cwd=REPO, check=True)
    common = ["train_gpt2.py", "--data_dir", args.data_dir, "--n_layer", str(args.n_layer), "--n_head",
              str(args.n_head), "--n_embd", str(args.n_embd), "--block_size", str(args.seq_len), "--seq_len",
              str(args.seq_len), "--micro_batch_size", str(min(16, args.total_batch_size // args.seq_len)),
              "--total_batch_size", str(args.total_batch_size), "--max_steps", str(args.max_steps),
              "--warmup_steps", str(max(1, args.max_steps // 10)), "--eval_every", str(args.eval_every),
              "--val_tokens", str(args.val_tokens), "--num_samples", "0", "--save_every", str(10 * args.max_steps),
              "--compile", "off", *args.extra]

    def flags(name, optimizer, lr):
        return [*common, "--optimizer", optimizer, "--lr", str(lr), "--out_dir", os.path.join(args.out_dir, name),
                *(["--muon_lr", str(args.muon_lr), "--muon_weight_decay", str(args.muon_weight_decay)]
                  if optimizer == "muon" else [])]

    os.makedirs(args.out_dir, exist_ok=True)
    runs = {f"adamw_lr{lr:g}": flags(f"adamw_lr{lr:g}", "adamw", lr) for lr in args.adamw_lrs}
    cpu_s, started = {}, time.time()
    if args.report:  # the runs are there already (a bench stopped early, say): only compare them
        runs["muon"] = None
    elif args.parallel:
        runs["muon"] = flags("muon", "muon", args.muon_adamw_lr)
        procs = {name: start(run, os.path.join(args.out_dir, f"{name}.txt"), 1) for name, run in runs.items()}
        cpu_s = {name: finish(proc) for name, proc in procs.items()}
    else:
        for name, run in runs.items():
            cpu_s[name] = finish(start(run, os.path.join(args.out_dir, f"{name}.txt")))
    curves = {name: read_run(os.path.join(args.out_dir, name)) for name in runs if runs[name]}
    last = min(max(curve) for curve, _ in curves.values())  # the last eval every run reached: max_steps when done
    best = min(args.adamw_lrs, key=lambda lr: curves[f"adamw_lr{lr:g}"][0][last])
    muon_adamw_lr = args.muon_adamw_lr or best
    if not args.parallel and not args.report:
        runs["muon"] = flags("muon", "muon", muon_adamw_lr)
        cpu_s["muon"] = finish(start(runs["muon"], os.path.join(args.out_dir, "muon.txt")))
    curves["muon"] = read_run(os.path.join(args.out_dir, "muon"))
    last = min(last, max(curves["muon"][0]))
    curves = {name: ({s: v for s, v in curve.items() if s <= last}, step_ms) for name, (curve, step_ms) in curves.items()}
    best = f"adamw_lr{best:g}"
    target = args.target or curves[best][0][last]

    tokens = args.total_batch_size
    names = list(runs)
    print(f"\n{len(runs)} runs in {time.time() - started:.0f} s, compared up to step {last}; best AdamW: {best}; "
          f"Muon's AdamW lr {muon_adamw_lr:g}")
    print("\n| step | tokens | " + " | ".join(names) + " |\n|---:|---:|" + "---:|" * len(names))
    for step in sorted(curves[best][0]):
        print(f"| {step} | {step * tokens:,} | " + " | ".join(f"{curves[n][0].get(step, float('nan')):.4f}"
                                                       for n in names) + " |")
    summary = {"compared_up_to_step": last, "target": target, "best_adamw": best, "muon_adamw_lr": muon_adamw_lr,
               "runs": {}}
    print(f"\ntarget val loss {target:.4f}\n\n| run | tokens to target | wall-clock to target | median step | "
          "CPU s (whole run) |\n|---|---:|---:|---:|---:|")
    for name in names:
        curve, step_ms = curves[name]
        step = step_to_reach(curve, target)
        median_ms = sorted(step_ms.values())[len(step_ms) // 2]
        row = {"tokens_to_target": None if step is None else step * tokens,
               "seconds_to_target": None if step is None else seconds_to(step_ms, step),
               "median_step_ms": median_ms, "cpu_s": cpu_s.get(name), "val_loss_at_last": curve[last],
               "tokens_to_level": {str(level): (lambda s: None if s is None else s * tokens)(step_to_reach(curve, level))
                                   for level in LEVELS}}
        summary["runs"][name] = row
        reached = "never | never" if step is None else f"{step * tokens:,.0f} | {row['seconds_to_target']:.0f} s"
        cpu = "-" if row["cpu_s"] is None else f"{row['cpu_s']:.0f}"
        print(f"| {name} | {reached} | {median_ms:.0f} ms | {cpu} |")
    print("\ntokens to reach each val loss:\n\n| run | " + " | ".join(f"{v}" for v in LEVELS) + " |\n|---|"
          + "---:|" * len(LEVELS))
    for name in names:
        print(f"| {name} | " + " | ".join("-" if t is None else f"{t / 1e6:.2f}M"
                                          for t in summary["runs"][name]["tokens_to_level"].values()) + " |")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
