"""Shared test helpers. Tests run the scripts as a user would (subprocesses, real flags) on shards made here from
real text: the Python standard library's own source, which every machine with Python has."""

import glob
import json
import os
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# a tiny GPT that trains in well under a second a step on a 2-core CPU; float32 so that runs compare exactly
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--seq_len", "32",
        "--micro_batch_size", "4", "--total_batch_size", "256", "--warmup_steps", "2", "--lr", "3e-3",
        "--dtype", "float32", "--device", "cpu", "--num_samples", "0", "--val_tokens", "512", "--compile", "off"]


def run(script, *args, env=None, timeout=600, check=False):
    """Run one of the repo's scripts in a subprocess; return the CompletedProcess (text)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    proc = subprocess.run([sys.executable, os.path.join(REPO, script), *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def torchrun(script, *args, nproc=2, timeout=600, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, script), *map(str, args)]
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hang: SIGTERM makes torchrun end its ranks (SIGKILL after 30 s)
            popen.terminate()
            stdout, stderr = popen.communicate()
            raise AssertionError(f"torchrun hung: stopped after {timeout} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def read_log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def train_losses(out_dir):
    return {r["step"]: r["loss"] for r in read_log(out_dir) if "loss" in r}


def val_losses(out_dir):
    return {r["step"]: r["val_loss"] for r in read_log(out_dir) if "val_loss" in r}


def stdlib_files(count, start=0):
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return files[start: start + count]


@pytest.fixture(scope="session")
def shards(tmp_path_factory):
    """Token shards of real text (60 stdlib modules, ~600k tokens), made by prepare_fineweb.py."""
    out = tmp_path_factory.mktemp("shards")
    run("prepare_fineweb.py", "--input", *stdlib_files(60), "--out_dir", out, "--shard_size", 100_000,
        "--workers", 2, check=True)
    return str(out)


@pytest.fixture(scope="session")
def base_ckpt(shards, tmp_path_factory):
    """A tiny base model trained for 30 steps by train_gpt2.py: its out_dir."""
    out = tmp_path_factory.mktemp("base")
    run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 30, "--eval_every", 30,
        check=True)
    return str(out)
