"""Faults a long run meets at run time: out of memory, a failed write (full disk), a second run into a live out_dir,
a run killed with SIGKILL. Each ends in one `error:` line, or not at all where the fault is gone."""

import glob
import json
import os
import resource
import signal
import subprocess
import sys
import time

import torch

from conftest import REPO, TINY, read_log, run, stdlib_files


def run_limited(script, *args, limit, name=resource.RLIMIT_AS):
    """Run a script under a resource limit (set in the child only); SIGXFSZ ignored, so that a write past
    RLIMIT_FSIZE fails with EFBIG, as a write to a full disk fails with ENOSPC, instead of killing the process."""
    def limit_child():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(name, (limit, limit))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600, preexec_fn=limit_child)


def one_error_line(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), \
        f"exit {proc.returncode}, stderr:\n{proc.stderr[-3000:]}"
    return lines[0]


def test_out_of_memory_is_one_line_naming_the_micro_batch(shards, tmp_path):
    # 1.5 GB of weights, and activations of 32 x 1024 tokens 3072 wide in float32: more than the 4 GB of address
    # space within the first layer, so that little is computed before memory runs out
    args = [*TINY, "--n_embd", 3072, "--block_size", 1024, "--seq_len", 1024, "--micro_batch_size", 32,
            "--total_batch_size", 32768,
            "--data_dir", shards, "--out_dir", tmp_path / "run", "--max_steps", 2, "--val_tokens", 32768]
    line = one_error_line(run_limited("train_gpt2.py", *args, limit=4 * 2**30))
    assert "out of CPU memory" in line and "lower --micro_batch_size" in line, line


def test_failed_checkpoint_write_is_one_line_and_keeps_the_older_checkpoint(shards, tmp_path):
    out = tmp_path / "run"
    common = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 100, "--save_every", 2]
    run("train_gpt2.py", *common, "--max_steps", 2, check=True)
    # a checkpoint of this model is ~20 MB, the log a few kB: only the save at step 4 fails (EFBIG, as ENOSPC would)
    proc = run_limited("train_gpt2.py", *common, "--max_steps", 4, "--resume", limit=2**20,
                       name=resource.RLIMIT_FSIZE)
    line = one_error_line(proc)
    assert proc.returncode == 2 and "ckpt_0000004.pt" in line and "File too large" in line, line
    assert "run the same command again" in line, line
    assert glob.glob(str(out / "*.tmp")) == [] and not os.path.exists(out / "ckpt_0000004.pt")
    old = torch.load(out / "ckpt_0000002.pt", weights_only=True)
    assert old["step"] == 2
    assert [r["step"] for r in read_log(out) if "loss" in r] == [0, 1, 2, 3]  # the log went on to the failed save


def test_a_failed_first_log_write_asks_for_no_resume_when_no_checkpoint_exists(shards, tmp_path):
    """The first record fails to write (EFBIG, as ENOSPC would): no checkpoint exists, so the line says to run the
    same command again, not to --resume. And with --eval_every 0 no line says --val_tokens is more than the val
    shards hold: no eval reads them."""
    pairs = dict(zip(TINY[::2], TINY[1::2]))
    no_evals = [arg for flag, value in pairs.items() if flag not in ("--val_tokens", "--num_samples")
                for arg in (flag, value)]
    proc = run_limited("train_gpt2.py", *no_evals, "--data_dir", shards, "--out_dir", tmp_path / "run",
                       "--eval_every", 0, "--max_steps", 2, limit=1000, name=resource.RLIMIT_FSIZE)
    line = one_error_line(proc)
    assert "log.jsonl" in line and "run the same command again" in line and "--resume" not in line, line
    assert "val shards hold" not in proc.stdout, proc.stdout


def test_a_fault_in_the_loop_saves_the_steps_made_then_says_it(shards, tmp_path):
    """log.jsonl turned into a folder mid-run: the next record fails. The run saves the step it was at (no save was
    due for 10,000 steps), then says what was wrong in one line."""
    out = tmp_path / "run"
    args = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 10_000, "--save_every", 10_000,
            "--max_steps", 100_000]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, args)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(logged_steps(out)) >= 2)
        (out / "log.jsonl").unlink()
        (out / "log.jsonl").mkdir()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    line = one_error_line(subprocess.CompletedProcess(args, proc.returncode, stdout, stderr))
    assert proc.returncode == 2 and "log.jsonl (Is a directory)" in line, line
    saved = glob.glob(str(out / "ckpt_*.pt"))
    assert len(saved) == 1 and f"saved {saved[0]}" in stdout, stdout[-3000:]
    assert torch.load(saved[0], weights_only=True)["step"] >= 2


def test_failed_shard_write_is_one_line(tmp_path):
    out = tmp_path / "shards"
    proc = run_limited("prepare_fineweb.py", "--input", *stdlib_files(20), "--out_dir", out, "--shard_size", 100_000,
                       "--workers", 1, limit=150_000, name=resource.RLIMIT_FSIZE)  # a shard is 201 kB
    line = one_error_line(proc)
    assert "_val_000000.bin" in line and "File too large" in line and "run the same command again" in line
    assert glob.glob(str(out / "*.tmp")) == []


def wait_for(condition, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def logged_steps(out_dir):
    """The train steps in a live run's log.jsonl, its last line left out: the run may be writing it."""
    if not os.path.exists(out_dir / "log.jsonl"):
        return []
    with open(out_dir / "log.jsonl") as f:
        lines = f.read().split("\n")[:-1]
    return [json.loads(line)["step"] for line in lines if '"loss"' in line]


def test_a_live_out_dir_is_refused_and_a_killed_runs_is_free_at_once(shards, tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 10_000, "--save_every", 10_000]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, args), "--max_steps",
                              "100000"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(logged_steps(out)) >= 2)
        start = time.time()
        second = run("train_gpt2.py", *args, "--max_steps", 5, timeout=60)
        assert time.time() - start < 30
        line = one_error_line(second)
        assert second.returncode == 2 and f"fuser {out}/.lock" in line and "--out_dir" in line, line
        steps = logged_steps(out)
        assert steps == list(range(len(steps))) and first.poll() is None  # the first run's log: untouched, going on
    finally:
        first.kill()  # SIGKILL: no handler runs, only the kernel frees the lock
        first.wait()
    third = run("train_gpt2.py", *args, "--max_steps", 1)
    assert third.returncode == 0, third.stderr[-3000:]


def test_empty_prompt_samples_a_document_from_its_start(shards, tmp_path):
    """Every in-loop sample starts after <|endoftext|>, as each document does in the shards: an empty prompt too."""
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", tmp_path / "run", "--max_steps", 2,
               "--eval_every", 2, "--num_samples", 1, "--sample_len", 4, "--prompt", "", check=True)
    assert "---- sample 0 ----" in proc.stdout


def test_chat_on_a_base_checkpoint_is_one_stderr_line(base_ckpt):
    proc = run("sample.py", "--ckpt", base_ckpt, "--chat", "--device", "cpu")
    line = one_error_line(proc)
    assert "--chat needs a checkpoint of mid_train.py" in line


def test_a_second_export_into_one_folder_at_once_is_refused(tmp_path):
    """export_hf.py locks its temp folder while it writes: a second export into the same --out_dir (here the
    lock held as a live export holds it) is one error line, not a mix of both exports' files."""
    import fcntl
    from dataclasses import asdict
    from train_gpt2 import GPT, GPTConfig
    config = GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)
    torch.save({"model": GPT(config).state_dict(), "config": asdict(config)}, tmp_path / "ckpt.pt")
    (tmp_path / "hf.tmp").mkdir()
    live = os.open(tmp_path / "hf.tmp", os.O_RDONLY)
    fcntl.flock(live, fcntl.LOCK_EX)
    line = one_error_line(run("export_hf.py", "--ckpt", tmp_path / "ckpt.pt", "--out_dir", tmp_path / "hf"))
    os.close(live)
    assert f"another export into {tmp_path / 'hf'} is running" in line, line
