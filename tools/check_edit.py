"""
Run this after any edit: in about a minute on a CPU, it checks that every script the edit reaches still runs end to
end. First the shared blocks' contracts (as tools/sync_shared.py --check). Then, on a tiny GPT and offline data made
in a temp folder (the trainers' --demo presets, on shards of a few standard library modules, a chat file and a
HellaSwag file of its own), it runs each script that holds a shared block changed since the last commit, or that
was edited itself (every script when there is no such edit, or outside git), through the steps it takes part in:
train, continue, sample, HellaSwag, midtrain, continue midtraining, chat, export and plot. A step that another needs
runs too. It prints a line a script, `ok` or the step that failed, where, and the error's last line, and exits 1 if
any failed or a contract is broken.

    python tools/check_edit.py          # the scripts the edit reaches
    python tools/check_edit.py --all    # every script

Python starts once here: it imports torch and the scripts' other imports, then forks a child for each step, which
runs the script as __main__ as `python script ARGS` would (a fresh Python that imports torch costs ~5 s a step).
"""

import argparse
import glob
import importlib.util
import itertools
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback

os.environ["OMP_NUM_THREADS"] = "1"  # two steps run at once, each on a core; read by torch as it is imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ left in the repo
from sync_shared import BLOCK, SCRIPTS, contract_problems, differing_copies  # noqa: E402

# tests/conftest.py's tiny GPT: a step takes well under a second
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--seq_len", "32",
        "--micro_batch_size", "4", "--total_batch_size", "256", "--warmup_steps", "2", "--lr", "3e-3"]
ON_CPU = ["--dtype", "float32", "--device", "cpu"]
SHORT = ["--compile", "off", "--eval_every", "2", "--save_every", "2", "--num_samples", "1", "--sample_len", "4"]
# the checkpoints that later steps read (the continued runs keep them)
BASE, MID = "out/demo/ckpt_0000004.pt", "out/mid/ckpt_0000002.pt"
# name, script, its flags (the --demo presets in the temp folder, made tiny), the steps it needs, its stdin
STEPS = [
    ("prepare", "prepare_fineweb.py", ["--input", "text/*.py", "--out_dir", "data/demo", "--shard_size", "4096",
                                       "--workers", "1"], [], ""),
    ("train", "train_gpt2.py", ["--demo", *TINY, *ON_CPU, *SHORT, "--max_steps", "4", "--val_tokens", "512",
                                "--hellaswag_file", "hellaswag.jsonl"], ["prepare"], ""),
    ("continue", "train_gpt2.py", ["--resume", "--out_dir", "out/demo", "--max_steps", "6"], ["train"], ""),
    ("sample", "sample.py", ["--ckpt", BASE, *ON_CPU, "--max_new_tokens", "4"], ["train"], ""),
    ("hellaswag", "hellaswag.py", ["--ckpt", BASE, *ON_CPU, "--data_file", "hellaswag.jsonl"], ["train"], ""),
    ("midtrain", "mid_train.py", ["--demo", "--init_ckpt", BASE, *ON_CPU, *SHORT, "--micro_batch_size", "4",
                                  "--max_steps", "2"], ["train"], ""),
    ("continue midtraining", "mid_train.py", ["--resume", "--out_dir", "out/mid", "--max_steps", "3"], ["midtrain"],
     ""),
    ("chat", "sample.py", ["--ckpt", MID, "--chat", *ON_CPU, "--max_new_tokens", "4"], ["midtrain"], "Hi!\n"),
    ("export", "export_hf.py", ["--ckpt", MID, "--out_dir", "hf"], ["midtrain"], ""),
    ("plot", "plot_runs.py", ["out/demo", "out/mid", "--out", "runs.png"], ["continue", "continue midtraining"], ""),
]
OPTIONAL = {"export": "transformers", "plot": "matplotlib"}  # a step skipped, with a line, where it is missing


def edited_scripts():
    """The scripts holding a shared block that differs from the last commit's, and the scripts changed themselves;
    None outside git."""
    try:
        # the paths under ROOT, from ROOT: the repo may sit in a folder of a larger one
        changed = subprocess.run(["git", "diff", "HEAD", "--name-only", "--relative"], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    changed_blocks = set()
    for script in set(changed) & set(SCRIPTS):
        committed = subprocess.run(["git", "show", f"HEAD:./{script}"], cwd=ROOT, capture_output=True, text=True).stdout
        with open(os.path.join(ROOT, script)) as f:
            now = f.read()
        before = {m.group(1): m.group(2) for m in BLOCK.finditer(committed)}
        changed_blocks |= {m.group(1) for m in BLOCK.finditer(now) if before.get(m.group(1)) != m.group(2)}
    holders = set()
    for script in SCRIPTS:
        with open(os.path.join(ROOT, script)) as f:
            if any(m.group(1) in changed_blocks for m in BLOCK.finditer(f.read())):
                holders.add(script)
    return holders | (set(changed) & set(SCRIPTS))


def write_inputs(folder):
    """What the steps read: text to make shards of (prepare_fineweb.py --demo would take 8 s of CPU to make the
    demo's), a chat file where mid_train.py --demo reads it, and a HellaSwag file."""
    os.makedirs(os.path.join(folder, "text"))
    os.makedirs(os.path.join(folder, "data", "demo"))
    for name in ("textwrap.py", "string.py", "glob.py"):  # ~12K tokens: a val shard and two train shards
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), os.path.join(folder, "text"))
    with open(os.path.join(folder, "data", "demo", "chat.jsonl"), "w") as f:
        for a, b in itertools.product(range(10), repeat=2):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
    with open(os.path.join(folder, "hellaswag.jsonl"), "w") as f:
        for label in range(4):
            f.write(json.dumps({"ctx": "A man sits on a chair holding a guitar. He", "label": label,
                                "endings": ["plays a song.", "eats the guitar.", "flies away.", "sings loudly."]})
                    + "\n")


def start(script, argv, folder, stdin):
    """Fork a child that runs the script as __main__ in folder, its output to a file there: (its pid, the file)."""
    log = os.path.join(folder, f"step{len(glob.glob(os.path.join(folder, 'step*.log')))}.log")
    for path, text in ((log + ".in", stdin), (log, "")):
        with open(path, "w") as f:
            f.write(text)
    pid = os.fork()
    if pid:
        return pid, log
    try:
        os.setpgid(0, 0)  # its own process group: stopped with any workers it started
        for fd, path, flags in ((0, log + ".in", os.O_RDONLY), (1, log, os.O_WRONLY | os.O_APPEND),
                                (2, log, os.O_WRONLY | os.O_APPEND)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        os.chdir(folder)
        sys.argv = [os.path.join(ROOT, script), *argv]
        sys.path[0] = ROOT
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:  # as Python ends on it
        code = e.code if isinstance(e.code, int) or e.code is None else print(e.code, file=sys.stderr) or 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # not through the checker's own code, which would clean up the folder


def failure(log):
    """Where a failed step stopped (the last line of our scripts in its traceback), and its last line."""
    with open(log, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    frames = re.findall(r'File "' + re.escape(ROOT) + r'/(\w+\.py)", line (\d+)', "\n".join(lines))
    where = f" ({':'.join(frames[-1])})" if frames else ""
    return f"{where}: {lines[-1] if lines else 'no output'}"


def run_steps(steps, folder, parallel=2):
    """Run the steps, each once the steps it needs are ok, `parallel` at a time (a core each). {name: None where
    it is ok, else why not}."""
    results, running, waiting = {}, {}, list(steps)
    try:
        while waiting or running:
            for step in list(waiting):
                name, script, argv, needs, stdin = step
                failed = [n for n in needs if results.get(n)]
                if failed:
                    waiting.remove(step)
                    results[name] = f"not run: {failed[0]} failed"
                elif all(n in results for n in needs) and len(running) < parallel:
                    waiting.remove(step)
                    pid, log = start(script, argv, folder, stdin)
                    running[pid] = name, log
            pid, status = os.wait()
            name, log = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            results[name] = None if code == 0 else f"failed at {name}, exit {code}{failure(log)}"
    finally:  # Ctrl-C: the steps, in their own process groups, did not get it
        for pid in running:
            os.killpg(pid, signal.SIGKILL)
    return results


def refuse(message):
    """A bad argument: one line, exit 2, nothing done."""
    print(f"error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = refuse
    p.add_argument("--all", action="store_true", help="check every script, not only those the edit reaches")
    args = p.parse_args()
    # SIGTERM and SIGHUP (a timeout, a closed terminal) end it as Ctrl-C does: the cleanup below still runs
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: sys.exit(1))
    started = time.time()
    problems = [f"{script}: shared block '{name}' differs from {other}: run python tools/sync_shared.py"
                for script, name, other in differing_copies()] + contract_problems()
    for problem in problems:
        print(problem)
    edited = None if args.all else edited_scripts()
    if edited is None and not args.all:
        print("outside git: checking every script")
    chosen = [script for script in SCRIPTS if not edited or script in edited]
    # the steps of the chosen scripts, then those they need (a step's needs come before it in STEPS)
    steps = {step[0]: step for step in STEPS}
    wanted = {name for name, script, *_ in STEPS if script in chosen}
    for name, *_, needs, _ in reversed(STEPS):
        if name in wanted:
            wanted |= set(needs)
    skipped = {name: f"{name} skipped: {package} is not installed" for name, package in OPTIONAL.items()
               if name in wanted and importlib.util.find_spec(package) is None}
    import numpy, tiktoken, torch, torch.distributed.fsdp  # noqa: F401, E401 what the steps import, imported once
    folder = tempfile.mkdtemp(prefix="check_edit_")
    try:
        write_inputs(folder)
        os.environ.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
        results = run_steps([step for step in STEPS if step[0] in wanted and step[0] not in skipped], folder)
    finally:
        shutil.rmtree(folder)
    failed = False
    for script in SCRIPTS:
        failures = [why for name, why in results.items() if why and steps[name][1] == script]
        if script in chosen or failures:
            ran = ["ok"] if any(steps[name][1] == script for name in results) else []
            notes = [why for name, why in skipped.items() if steps[name][1] == script]
            print(f"{script}: {failures[0] if failures else '; '.join(ran + notes)}")
            failed = failed or bool(failures)
    print(f"checked in {time.time() - started:.0f} s")
    sys.exit(1 if failed or problems else 0)


if __name__ == "__main__":
    main()
