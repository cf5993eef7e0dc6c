"""
The peak memory of training steps on the CPU, with the forward that returns only the loss given targets (issue 57)
and with the forward before it, which returned the logits too: train_gpt2.py's own model, setup_training (AdamW,
autocast, compile) and train_step at the demo's shape (4 layers x 256, seq 256, micro-batch 8, 2,048 tokens a step,
--dtype auto), on random tokens. "before" is train_gpt2.py as the git commit --before has it, "after" this tree's.
Each runs in a process of its own, as the peak RSS of a process only grows; both run with the same code here.
Prints a JSON line for each: the RSS once the model and its batch are built, the peak RSS over the steps, and the
difference, which is what the steps add (activations, gradients, AdamW's state, the logits).

    python bench/forward_memory.py                      # eager, before = the commit before issue 57's forward
    python bench/forward_memory.py --compile on         # torch.compile: an unused output gets a zero-filled gradient
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux gives KiB


def measure(script_dir, compile_flag, steps):
    """In this process: train_gpt2.py of script_dir, `steps` training steps at the demo's shape; the figures."""
    sys.path.insert(0, script_dir)
    import torch
    import train_gpt2 as tg
    torch.manual_seed(0)
    out_dir = tempfile.mkdtemp()  # get_args's out_dir: a new run, nothing written to it
    args = tg.get_args(["--demo", "--device", "cpu", "--compile", compile_flag, "--out_dir", out_dir])
    os.rmdir(out_dir)
    dtype = tg.autocast_dtype(args.dtype, "cpu")
    raw_model = tg.GPT(tg.GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                                    n_embd=args.n_embd))
    model, optimizers, scaler, autocast_ctx = tg.setup_training(raw_model, args, dtype, "cpu")
    B, T = args.micro_batch_size, args.seq_len
    x = torch.randint(0, 50257, (B, T))
    y = torch.roll(x, -1, 1)
    built = rss_mib()
    for _ in range(steps):
        metrics = tg.train_step(model, optimizers, scaler, lambda: (x, y), args.total_batch_size // (B * T),
                                args.total_batch_size, 1.0, autocast_ctx)
    peak = rss_mib()
    return dict(dtype=str(dtype), compile=compile_flag, steps=steps, loss=metrics["loss"].item(),
                built_rss_mib=round(built), peak_rss_mib=round(peak), steps_add_mib=round(peak - built))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default="1e775f1", help="the git commit whose train_gpt2.py is 'before'")
    p.add_argument("--compile", choices=["on", "off"], default="off")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)  # a variant's process: the folder of its train_gpt2.py
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.compile, args.steps)))
        return
    with tempfile.TemporaryDirectory() as before_dir:
        source = subprocess.run(["git", "-C", REPO, "show", f"{args.before}:train_gpt2.py"], capture_output=True,
                                text=True)
        if source.returncode:
            sys.exit(f"error: --before {args.before}: {source.stderr.strip()}")
        with open(os.path.join(before_dir, "train_gpt2.py"), "w") as f:
            f.write(source.stdout)
        for name, script_dir in ((f"before ({args.before})", before_dir), ("after (this tree)", REPO)):
            proc = subprocess.run([sys.executable, __file__, "--child", script_dir, "--compile", args.compile,
                                   "--steps", str(args.steps)], capture_output=True, text=True, cwd=REPO)
            if proc.returncode:
                sys.exit(f"error: the {name} run failed:\n{proc.stderr}")
            print(json.dumps({"forward": name, **json.loads(proc.stdout.splitlines()[-1])}), flush=True)


if __name__ == "__main__":
    main()
