"""Shared test helpers. Tests run the scripts as a user would (subprocesses, real flags) on shards made here from
real text: the Python standard library's own source, which every machine with Python has."""

import glob
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tools"))  # the sync tool's functions, for the tests of shared blocks
# Tests that train in this process take one thread, as the scripts' runs here do: the workers share the cores, and
# two threads each spin-wait on each other (a 150-step overfit took 69 s instead of 12).
torch.set_num_threads(1)

# a tiny GPT that trains in well under a second a step on a 2-core CPU; float32 so that runs compare exactly
TINY = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--block_size", "64", "--seq_len", "32",
        "--micro_batch_size", "4", "--total_batch_size", "256", "--warmup_steps", "2", "--lr", "3e-3",
        "--dtype", "float32", "--device", "cpu", "--num_samples", "0", "--val_tokens", "512", "--compile", "off"]


# The slowest files, slowest first. pytest-xdist's `--dist loadfile` hands the workers whole files, in the order of
# this list and then of the rest, so that no long file is left to run alone on one core at the end. (By default
# it would order the files by their number of tests, which says little of their time here.)
SLOWEST_FILES = ["test_train.py", "test_run_folder.py", "test_cuda_rehearsal.py", "test_mid_train.py",
                 "test_pipeline.py", "test_fsdp.py", "test_fork.py", "test_faults.py", "test_tools.py"]


def pytest_configure(config):
    config.option.loadscopereorder = False  # pytest-xdist's order by number of tests: off, for the one above


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return SLOWEST_FILES.index(name) if name in SLOWEST_FILES else len(SLOWEST_FILES)
    items.sort(key=rank)  # a stable sort: each file's tests keep their order


# Starting Python and importing torch and the rest of the scripts' imports costs ~5 s of CPU a process: more than
# most of the tests' tiny runs take to train. So each test worker keeps one Python that has imported them, and forks
# it for each run() (one at a time): the child takes the run's argv, environment, folder and output files, and runs
# the script as __main__, so that it ends as `python script ARGS` does (exit code, atexit, a signal; a traceback
# with runpy's frames too). Unlike fresh processes, the children share the server's hash seed: a script's numbers
# must not depend on it. Tests that signal a run, or start it under torchrun, start fresh processes.
SERVER_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STARTUP_VARIABLES = ("PYTHON", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH", "CUDA", "LD_", "TMPDIR")
FORK_SERVER = r"""
import json, os, runpy, sys
import numpy, tiktoken, torch, torch.distributed.fsdp
for request in sys.stdin:
    cmd, cwd, env, out, err = json.loads(request)
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its own process group: a timeout kills the run with any workers it started
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        # new streams on the new files: the old ones hold the server's buffers
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = cmd[1:]
        sys.path[0] = os.path.dirname(cmd[1])
        # an uncaught exception or SystemExit leaves here and ends the child as it ends a script
        runpy.run_path(cmd[1], run_name="__main__")
        sys.exit(0)
    print(pid, flush=True)
    status = os.waitpid(pid, 0)[1]
    print(os.waitstatus_to_exitcode(status), flush=True)
"""
_fork_server = None


def forked_run(cmd, env, timeout):
    global _fork_server
    if _fork_server is None or _fork_server.poll() is not None:  # first use, or the server died (killed for memory)
        _fork_server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=SERVER_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        open(out, "w").close()
        open(err, "w").close()
        _fork_server.stdin.write(json.dumps([cmd, REPO, env, out, err]) + "\n")
        _fork_server.stdin.flush()
        pid = None
        try:
            pid = int(_fork_server.stdout.readline())
            killer = threading.Timer(timeout, os.killpg, (pid, signal.SIGKILL))  # as subprocess.run's timeout kills
            killer.daemon = True
            killer.start()
            returncode = int(_fork_server.stdout.readline())
        except BaseException:  # Ctrl-C: the run, in its own process group, did not get it; the server's replies
            _fork_server.kill()  # are out of step with the requests from now on
            _fork_server = None
            if pid is not None:
                os.killpg(pid, signal.SIGKILL)
            raise
        timed_out = not killer.is_alive()
        killer.cancel()
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)


def run(script, *args, env=None, timeout=600, check=False):
    """Run one of the repo's scripts in a subprocess, as `python script ARGS` in the repo; return the
    CompletedProcess (text). Forked from the worker's pre-imported Python (above) unless env changes what Python or
    torch read as they start."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true", **(env or {})}
    cmd = [sys.executable, os.path.join(REPO, script), *map(str, args)]
    read_at_start = [key for key in {*SERVER_ENV, *full_env} if key.startswith(STARTUP_VARIABLES)]
    if any(SERVER_ENV.get(key) != full_env.get(key) for key in read_at_start):
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    else:
        proc = forked_run(cmd, full_env, timeout)
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
