"""
The head's loss, old path against new, in one run (issue 28): the plain head (the whole (rows, 50,304) logits, then
F.cross_entropy) and train_gpt2.py's chunked linear cross-entropy (ChunkedCrossEntropy, LOSS_CHUNK rows at a time).
Each figure is taken for both paths in turns, in fresh processes, and repeated:

1. tok/s of train_gpt2.py --demo with its default flags (the median step of a short run; --demo_steps);
2. the share of a demo step's time spent in matmuls (torch.profiler, eager, one process);
3. the peak memory of one training step at GPT-2's width: 2 layers x 768, seq 1024, micro-batch 4, float32 (the
   process's peak RSS on a CPU; torch.cuda.max_memory_allocated on a GPU);
4. with --chunks: tok/s and peak memory of 1 and 2 for each LOSS_CHUNK given, the chunk-size curve;
5. on a GPU: the largest micro-batch of GPT-2 124M at seq 1024, bf16, that fits in 24 GB
   (torch.cuda.set_per_process_memory_fraction), for each path.

    python prepare_fineweb.py --demo && python bench/head_loss.py --repeats 3
    python bench/head_loss.py --chunks 256 512 1024 2048 4096 --repeats 2

The old path is swapped in by the child process (train_gpt2.ChunkedCrossEntropy replaced by the plain head), so
the trainer runs unchanged otherwise.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child's prelude: the path ("old" or "new") and LOSS_CHUNK, then train_gpt2 imported with them in place
PRELUDE = r"""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, {repo!r})
import train_gpt2 as tg
path, chunk = {path!r}, {chunk}
tg.LOSS_CHUNK = chunk


class PlainHead:  # the head before issue 28: the whole logits, then cross_entropy (sum over the targets)
    @staticmethod
    def apply(x, weight, targets, training):
        return F.cross_entropy((x @ weight.T).float(), targets, ignore_index=-1, reduction="sum")


if path == "old":
    tg.ChunkedCrossEntropy = PlainHead
"""

# 2: the share of a demo step in matmuls, and 3: the memory of a GPT-2-width step
STEP = r"""
import json, resource, time
from torch.profiler import profile, ProfilerActivity
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
what = {what!r}
if what == "profile":
    config, B, T = tg.GPTConfig(**{{k: tg.DEMO_PRESET[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}}), 8, 256
else:
    config, B, T = tg.GPTConfig(block_size=1024, n_layer=2, n_head=12, n_embd=768), 4, 1024
model = tg.GPT(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 50257, (B, T), device=device)
y = torch.randint(0, 50257, (B, T), device=device)


def step():
    _, loss = model(x, y, reduction="sum")
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(2):
    step()
if what == "profile":
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(3):
            step()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events)
    matmul = sum(getattr(e, key) for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    print(json.dumps({{"matmul_share": matmul / total}}))
else:
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    print(json.dumps({{"peak_mib": peak}}))
"""

# 5: the largest GPT-2 124M micro-batch at seq 1024 in 24 GB, bf16 (GPU only)
FIT = r"""
import json
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
model = tg.GPT(tg.GPTConfig()).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def fits(B):
    try:
        x = torch.randint(0, 50257, (B, 1024), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, x, reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        opt.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


low, high = 0, 1  # fits(low), not fits(high)
while fits(high):
    low, high = high, 2 * high
while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if fits(mid) else (low, mid)
print(json.dumps({{"largest_micro_batch": low}}))
"""


def child(code, path, chunk, args=(), env=None):
    """Run code (a script after the prelude) in a fresh process; its last stdout line as JSON, or the process."""
    source = PRELUDE.format(repo=REPO, path=path, chunk=chunk) + code
    proc = subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"error: the {path} path failed:\n{proc.stderr[-3000:]}")
    return proc


def demo_tok_s(path, chunk, steps, data_dir):
    """The median tok/s of the steps after the first 5 of a train_gpt2.py --demo run with its default flags."""
    with tempfile.TemporaryDirectory() as out:
        code = "tg.exit_on_out_of_memory(tg.main)\n"
        flags = ["--demo", "--data_dir", data_dir, "--out_dir", out, "--max_steps", str(steps), "--eval_every", "100000",
                 "--save_every", "100000", "--num_samples", "0"]
        child(code, path, chunk, flags)  # the child's sys.argv[1:]
        with open(os.path.join(out, "log.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return statistics.median(r["tok_per_s"] for r in records if "tok_per_s" in r and r["step"] >= 5)


def measure(what, path, chunk):
    return json.loads(child(STEP.format(what=what), path, chunk).stdout.splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="rounds of old, new (the median of each is reported)")
    p.add_argument("--demo_steps", type=int, default=30, help="steps of each --demo run (the first 5 are not timed)")
    p.add_argument("--data_dir", default="data/demo", help="prepare_fineweb.py --demo's shards")
    p.add_argument("--chunks", type=int, nargs="*", default=[], help="LOSS_CHUNK values for the chunk-size curve")
    args = p.parse_args()
    if not os.path.isdir(os.path.join(REPO, args.data_dir)):
        sys.exit(f"error: no {args.data_dir}: run python prepare_fineweb.py --demo first")
    import torch
    sys.path.insert(0, REPO)
    import train_gpt2 as tg
    chunk = tg.LOSS_CHUNK
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}; LOSS_CHUNK {chunk}")

    rows = {}
    for _ in range(args.repeats):
        for path in ("old", "new"):
            rows.setdefault((path, "tok/s"), []).append(demo_tok_s(path, chunk, args.demo_steps, args.data_dir))
            rows.setdefault((path, "matmul share"), []).append(measure("profile", path, chunk)["matmul_share"])
            rows.setdefault((path, "peak MiB"), []).append(measure("memory", path, chunk)["peak_mib"])
    print("\n| figure | old (plain head) | new (chunked) | new / old |\n|---|---:|---:|---:|")
    for figure in ("tok/s", "matmul share", "peak MiB"):
        old, new = (statistics.median(rows[(path, figure)]) for path in ("old", "new"))
        runs = " ".join(f"{v:.3g}" for v in rows[("new", figure)])
        print(f"| {figure} (new runs: {runs}) | {old:,.3f} | {new:,.3f} | {new / old:.2f}x |")

    if args.chunks:
        print("\n| LOSS_CHUNK | demo tok/s | GPT-2-width step peak MiB |\n|---:|---:|---:|")
        for c in args.chunks:
            tok_s = statistics.median(demo_tok_s("new", c, args.demo_steps, args.data_dir) for _ in range(args.repeats))
            peak = statistics.median(measure("memory", "new", c)["peak_mib"] for _ in range(args.repeats))
            print(f"| {c} | {tok_s:,.0f} | {peak:,.0f} |")

    if torch.cuda.is_available():
        print("\n| path | largest GPT-2 124M micro-batch at seq 1024 in 24 GB (bf16) |\n|---|---:|")
        for path in ("old", "new"):
            print(f"| {path} | {json.loads(child(FIT, path, chunk).stdout.splitlines()[-1])['largest_micro_batch']} |")


if __name__ == "__main__":
    main()
