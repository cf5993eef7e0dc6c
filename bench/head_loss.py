"""
The head's loss, the plain head against the chunked one (issues 28 and 37): the plain head (the whole (rows, 50,304)
logits, then F.cross_entropy) and train_gpt2.py's chunked linear cross-entropy (ChunkedCrossEntropy, LOSS_CHUNK
rows at a time). With --also eager_body, the chunked head with its chunk's body not compiled in a compiled model;
with --also torch, torch's own F.linear_cross_entropy with LOSS_CHUNK-row chunks (torch 2.13); with --baseline
COMMIT, that commit's train_gpt2.py as it is (its own chunked head). Every figure is taken in a fresh process, the
heads in turns, and repeated (--repeats; medians):

1. tok/s of train_gpt2.py --demo with its default flags (float32, eager; the median step after the first 5);
2. one training step (forward and backward) of a model at GPT-2's width (--n_layer x 768, seq 1024, bf16 autocast),
   eager and compiled, at each of --shapes (rows a step x LOSS_CHUNK; the second default has 64 chunks): the
   process's peak memory (peak RSS on a CPU; torch.cuda.max_memory_allocated on a GPU), Inductor's own estimate where
   compiled (the largest of its graphs', from the lines TORCH_LOGS=torch._inductor.memory shows), the compile time
   (step 0's time minus the median of the later steps') and tok/s (of the later steps);
3. with --chunks: demo tok/s and the eager GPT-2-width step's peak memory for each LOSS_CHUNK given;
4. on a GPU: the largest micro-batch of GPT-2 124M at seq 1024, bf16, eager, that fits in 24 GB, for each head;
5. with --trainer: train_gpt2.py itself through its own flags, a 1-layer model at GPT-2's width whose step is
   64 x 1,024 rows (64 chunks), bf16, 3 steps: eager, compiled, and compiled at micro-batch 1 (64 micro-steps of one
   chunk): the process's peak RSS, Inductor's estimate and each step's wall and CPU seconds (the process's and its
   finished children's: on a shared machine CPU time moves far less than wall time). Inductor compiles in the
   process here (TORCHINDUCTOR_COMPILE_THREADS=1), so that the compile's CPU time is counted; the data is made from
   the Python standard library's source, as the tests make theirs.

    python prepare_fineweb.py --demo && python bench/head_loss.py --repeats 3 --baseline 03189ae
    python bench/head_loss.py --chunks 256 512 1024 2048 4096 --repeats 2
    python bench/head_loss.py --n_layer 12 --shapes 65536:1024 8192:1024 --repeats 1   # a GPU: GPT-2 124M
    python bench/head_loss.py --repeats 2 --shapes --demo_steps 0 --trainer --baseline 03189ae

The plain head is swapped in by the child process (train_gpt2.ChunkedCrossEntropy replaced), so the model runs
unchanged otherwise. Each child has a fresh Inductor cache, so that every compile time is a first compile's.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child's prelude: train_gpt2 imported from the folder given (this tree's, or a baseline commit's), LOSS_CHUNK set,
# the head swapped for the plain or torch's, and Inductor's peak-memory estimates collected
PRELUDE = r"""
import logging, sys, torch, torch.nn.functional as F
sys.path.insert(0, {folder!r})
import train_gpt2 as tg
tg.LOSS_CHUNK = {chunk}
estimates = []  # Inductor's peak-memory estimates in bytes, a list a graph: in program order, then its reorderings


class InductorEstimates(logging.Handler):  # the lines TORCH_LOGS=torch._inductor.memory prints
    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Baseline peak memory"):
            estimates.append([])
        if "peak memory:" in message:
            estimates[-1].append(int(message.rsplit(":", 1)[1]))


def inductor_mib():  # the largest graph's, in the order Inductor keeps (the best of its reorderings)
    return max(min(graph) for graph in estimates) / 2**20 if estimates else float("nan")


logging.getLogger("torch._inductor.memory").setLevel(logging.INFO)
logging.getLogger("torch._inductor.memory").addHandler(InductorEstimates())


class PlainHead:  # the head before issue 28: the whole logits, then cross_entropy (summed over the targets)
    @staticmethod
    def apply(x, weight, targets, *flags):
        return F.cross_entropy((x @ weight.T).float(), targets, ignore_index=-1, reduction="sum")


if {head!r} == "plain":
    tg.ChunkedCrossEntropy = PlainHead
if {head!r} == "eager_body":  # the chunked head with its chunk's body left uncompiled in a compiled model
    tg.compile_once = lambda fn, **kwargs: fn


class TorchHead:  # torch's own chunked linear cross-entropy (torch 2.13), its matmuls in autocast's dtype
    @staticmethod
    def apply(x, weight, targets, *flags):
        if torch.is_autocast_enabled(x.device.type):
            x, weight = (t.to(torch.get_autocast_dtype(x.device.type)) for t in (x, weight))
        options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=tg.LOSS_CHUNK, allow_retain_graph=True)
        return F.linear_cross_entropy(x, weight, targets, ignore_index=-1, reduction="sum", options=options).float()


if {head!r} == "torch":
    tg.ChunkedCrossEntropy = TorchHead
"""

# 2: one training step of a GPT-2-width model, eager or compiled
STEP = r"""
import json, resource, statistics, time
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
model = tg.GPT(tg.GPTConfig(n_layer={n_layer}, n_head=12, n_embd=768)).to(device)
forward = torch.compile(model) if {compiled} else model
x = torch.randint(0, 50257, ({rows} // 1024, 1024), device=device)
seconds = []
for step in range({steps}):
    start = time.perf_counter()
    with torch.autocast(device, dtype=torch.bfloat16):
        _, loss = forward(x, x, reduction="sum")
    loss.backward()
    model.zero_grad(set_to_none=True)
    loss.item()  # waits for the GPU
    seconds.append(time.perf_counter() - start)
later = statistics.median(seconds[1:])
peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"peak_mib": peak / 2**20, "inductor_mib": inductor_mib(), "compile_s": seconds[0] - later,
                  "tok_s": x.numel() / later}}))
"""

# 4: the largest GPT-2 124M micro-batch at seq 1024 in 24 GB, bf16 (GPU only)
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


# 5: train_gpt2.py's own steps, timed around its train_step
TRAINER = r"""
import json, resource, time


def cpu_seconds():
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


steps, train_step = [], tg.train_step


def timed_train_step(*args):
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = train_step(*args)
    steps.append({"wall_s": time.perf_counter() - wall, "cpu_s": cpu_seconds() - cpu})
    return result


tg.train_step = timed_train_step
tg.exit_on_out_of_memory(tg.main)
print(json.dumps({"peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, "steps": steps,
                  "inductor_mib": inductor_mib()}))
"""


def child(code, head, chunk, folders, args=(), env=None):
    """Run code (a script after the prelude) in a fresh process with a fresh Inductor cache; its last stdout line."""
    source = PRELUDE.format(folder=folders[head], chunk=chunk, head=head) + code
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run([sys.executable, "-c", source, *args], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, **(env or {})})
    if proc.returncode != 0:
        sys.exit(f"error: the {head} head failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()[-1]


def demo_tok_s(head, chunk, folders, steps, data_dir):
    """The median tok/s of the steps after the first 5 of a train_gpt2.py --demo run with its default flags."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--demo", "--data_dir", os.path.abspath(data_dir), "--out_dir", out, "--max_steps", str(steps),
                 "--eval_every", "100000", "--save_every", "100000", "--num_samples", "0"]
        child("tg.exit_on_out_of_memory(tg.main)\n", head, chunk, folders, flags)  # flags: the child's sys.argv[1:]
        with open(os.path.join(out, "log.jsonl")) as f:
            records = [json.loads(line) for line in f]
    return statistics.median(r["tok_per_s"] for r in records if "tok_per_s" in r and r["step"] >= 5)


def trainer_figures(head, folders, data_dir, micro_batch, compiled):
    """Peak MiB, Inductor's estimate in MiB, (wall, CPU) seconds of step 0, and the medians of steps 1 and 2, of a
    train_gpt2.py run."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--data_dir", data_dir, "--out_dir", out, "--n_layer", "1", "--seq_len", "1024", "--micro_batch_size",
                 str(micro_batch), "--total_batch_size", "65536", "--max_steps", "3", "--warmup_steps", "1",
                 "--eval_every", "100000", "--val_tokens", "1024", "--num_samples", "0", "--dtype", "bfloat16",
                 "--device", "cpu", "--compile", "on" if compiled else "off"]
        run = json.loads(child(TRAINER, head, 1024, folders, flags, {"TORCHINDUCTOR_COMPILE_THREADS": "1"}))
    first, later = run["steps"][0], run["steps"][1:]
    return (run["peak_mib"], run["inductor_mib"], first["wall_s"], first["cpu_s"],
            statistics.median(s["wall_s"] for s in later), statistics.median(s["cpu_s"] for s in later))


def step_figures(head, chunk, folders, n_layer, rows, compiled, steps):
    code = STEP.format(n_layer=n_layer, rows=rows, compiled=compiled, steps=steps)
    return json.loads(child(code, head, chunk, folders))


def median_row(runs):
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="rounds of the heads in turns (medians are reported)")
    p.add_argument("--demo_steps", type=int, default=30, help="steps of a --demo run, the first 5 untimed (0: none)")
    p.add_argument("--data_dir", default="data/demo", help="prepare_fineweb.py --demo's shards")
    p.add_argument("--also", nargs="*", default=[], choices=["eager_body", "torch"], help="more heads (figure 2)")
    p.add_argument("--baseline", help="a commit whose train_gpt2.py (its chunked head) runs too, as another head")
    p.add_argument("--n_layer", type=int, default=1, help="layers of the GPT-2-width model of figure 2")
    p.add_argument("--shapes", nargs="*", default=["4096:1024", "4096:64"],
                   help="ROWS:LOSS_CHUNK for figure 2 (rows a step, a multiple of seq 1024)")
    p.add_argument("--steps", type=int, default=4, help="steps of each figure-2 run (step 0 compiles)")
    p.add_argument("--chunks", type=int, nargs="*", default=[], help="LOSS_CHUNK values for the chunk-size curve")
    p.add_argument("--trainer", action="store_true", help="train_gpt2.py's own 64 x 1,024-row steps (figure 5)")
    args = p.parse_args()
    if not os.path.isdir(os.path.join(REPO, args.data_dir)):
        sys.exit(f"error: no {args.data_dir}: run python prepare_fineweb.py --demo first")
    import torch
    sys.path.insert(0, REPO)
    import train_gpt2 as tg
    chunk = tg.LOSS_CHUNK
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}; LOSS_CHUNK {chunk}")
    folders = {"plain": REPO, "chunked": REPO, "eager_body": REPO, "torch": REPO}
    heads = ["plain", "chunked", *args.also]
    baseline_dir = tempfile.TemporaryDirectory()
    if args.baseline:  # that commit's trainer, as it is, in a folder of its own
        source = subprocess.run(["git", "show", f"{args.baseline}:train_gpt2.py"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout
        with open(os.path.join(baseline_dir.name, "train_gpt2.py"), "w") as f:
            f.write(source)
        folders["baseline"] = baseline_dir.name
        heads.append("baseline")

    demo_heads = [head for head in heads if head not in args.also]
    tok_s = {head: [] for head in demo_heads}
    for _ in range(args.repeats if args.demo_steps else 0):
        for head in demo_heads:
            tok_s[head].append(demo_tok_s(head, chunk, folders, args.demo_steps, args.data_dir))
    if args.demo_steps:
        print("\n| head | demo tok/s, median (runs) | / plain |\n|---|---:|---:|")
    for head in demo_heads if args.demo_steps else []:
        print(f"| {head} | {statistics.median(tok_s[head]):,.0f} ({', '.join(f'{v:,.0f}' for v in tok_s[head])}) | "
              f"{statistics.median(tok_s[head]) / statistics.median(tok_s['plain']):.2f}x |")

    if args.shapes:
        print("\n| rows x LOSS_CHUNK | head | mode | peak MiB | Inductor's estimate MiB | compile s | tok/s |"
              "\n|---|---|---|---:|---:|---:|---:|")
    plain = {}  # the plain head's figures by (rows, compiled): it has no chunks, so one LOSS_CHUNK is measured
    for shape in args.shapes:
        rows, shape_chunk = map(int, shape.split(":"))
        runs = {}
        for _ in range(args.repeats):
            for head in heads:
                for compiled in (False, True):
                    if (head == "plain" and (rows, compiled) in plain) or (head == "eager_body" and not compiled):
                        continue
                    figures = step_figures(head, shape_chunk, folders, args.n_layer, rows, compiled, args.steps)
                    runs.setdefault((head, compiled), []).append(figures)
        for compiled in (False, True):
            runs[("plain", compiled)] = plain.setdefault((rows, compiled), runs.get(("plain", compiled)))
        for (head, compiled), head_runs in sorted(runs.items(), key=lambda item: heads.index(item[0][0])):
            row = median_row(head_runs)
            mode = "compiled" if compiled else "eager"
            inductor = f"{row['inductor_mib']:,.0f}" if compiled else ""
            print(f"| {rows:,} x {shape_chunk} | {head} | {mode} | {row['peak_mib']:,.0f} | {inductor} | "
                  f"{row['compile_s']:.1f} | {row['tok_s']:,.0f} |")

    if args.chunks:
        print("\n| LOSS_CHUNK | demo tok/s | eager GPT-2-width step peak MiB (4,096 rows) |\n|---:|---:|---:|")
        for c in args.chunks:
            tok = statistics.median(demo_tok_s("chunked", c, folders, args.demo_steps, args.data_dir)
                                    for _ in range(args.repeats))
            peak = statistics.median(step_figures("chunked", c, folders, args.n_layer, 4096, False, 2)["peak_mib"]
                                     for _ in range(args.repeats))
            print(f"| {c} | {tok:,.0f} | {peak:,.0f} |")

    if args.trainer:
        with tempfile.TemporaryDirectory() as data:  # shards of 100,000 tokens: a step reads 65,537
            sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:40]
            subprocess.run([sys.executable, os.path.join(REPO, "prepare_fineweb.py"), "--input", *sources, "--out_dir",
                            data, "--shard_size", "100000"], check=True, capture_output=True)
            runs = {}
            for _ in range(args.repeats):
                for head in [head for head in heads if head in ("chunked", "baseline")]:  # plain: 26 GB of logits
                    for micro_batch, compiled in ((64, False), (64, True), (1, True)):
                        figures = trainer_figures(head, folders, data, micro_batch, compiled)
                        runs.setdefault((head, micro_batch, compiled), []).append(figures)
        print("\n| head | mode | micro-batch | peak MiB | Inductor's estimate MiB | wall s: step 0, later, step 0 - "
              "later | CPU s: step 0, later, step 0 - later |\n|---|---|---:|---:|---:|---|---|")
        for (head, micro_batch, compiled), head_runs in runs.items():
            for peak, inductor, wall_0, cpu_0, wall, cpu in head_runs:  # each run: the compile overhead is noisy
                mode = "compiled" if compiled else "eager"
                inductor = f"{inductor:,.0f}" if compiled else ""
                print(f"| {head} | {mode} | {micro_batch} | {peak:,.0f} | {inductor} | {wall_0:.0f}, {wall:.0f}, "
                      f"**{wall_0 - wall:.0f}** | {cpu_0:.0f}, {cpu:.0f}, **{cpu_0 - cpu:.0f}** |")

    if torch.cuda.is_available():
        print("\n| head | largest GPT-2 124M micro-batch at seq 1024 in 24 GB (bf16, eager) |\n|---|---:|")
        for head in heads:
            print(f"| {head} | {json.loads(child(FIT, head, chunk, folders))['largest_micro_batch']} |")


if __name__ == "__main__":
    main()
