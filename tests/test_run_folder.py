"""A run folder's life (issues 47 and 49): an out_dir holds one run, and the same command continues it; what a run
logs (val bits per byte, interval means, its flags and environment, a summary); the mistakes users make with run
folders end in the right outcome, with nothing deleted or overwritten."""

import glob
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, TINY, read_log, run, torchrun


def checkpoints(out_dir):
    return sorted(os.path.basename(path) for path in glob.glob(os.path.join(glob.escape(str(out_dir)), "ckpt_*.pt")))


def test_the_same_command_continues_the_run_and_a_changed_model_is_one_line(shards, tmp_path):
    out = tmp_path / "rr"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 3, "--save_every", 3]
    run("train_gpt2.py", *command, "--max_steps", 6, check=True)
    log_before = (out / "log.jsonl").read_bytes()
    # typed again: the run is complete, and nothing changes
    again = run("train_gpt2.py", *command, "--max_steps", 6, check=True)
    assert "is complete" in again.stdout
    assert (out / "log.jsonl").read_bytes() == log_before
    # with more steps: it goes on from step 6, and the log keeps every record; the summary's peak memory is the
    # larger of the launches' (the first one's, as if on a bigger machine)
    checkpoint = torch.load(out / "ckpt_0000006.pt", weights_only=True)
    torch.save({**checkpoint, "peak_mem_gib": 99.0}, out / "ckpt_0000006.pt")
    more = run("train_gpt2.py", *command, "--max_steps", 9, check=True)
    assert "holds a run: continuing it" in more.stdout and "at step 6" in more.stdout
    steps = [r["step"] for r in read_log(out) if "loss" in r]
    assert steps == list(range(9)), steps
    assert json.load(open(out / "summary.json"))["peak_mem_gib"] == 99.0
    assert checkpoints(out) == ["ckpt_0000003.pt", "ckpt_0000006.pt", "ckpt_0000009.pt"]
    # another model, or fewer steps than the run has: one line, and the folder as it was
    log_before = (out / "log.jsonl").read_bytes()
    changes = ((["--n_layer", 3, "--max_steps", 12], "--n_layer 3"), (["--max_steps", 4], "below the step"),
               (["--data_dir", tmp_path, "--max_steps", 12], "--data_dir"))
    for flags, words in changes:
        proc = run("train_gpt2.py", *command, *flags)
        assert proc.returncode == 2 and words in proc.stderr and "another --out_dir" in proc.stderr, proc.stderr
        # checked before said: a refused run says nothing of going on
        assert "continuing it" not in proc.stdout and "flags changed" not in proc.stdout, proc.stdout
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert (out / "log.jsonl").read_bytes() == log_before
        assert checkpoints(out) == ["ckpt_0000003.pt", "ckpt_0000006.pt", "ckpt_0000009.pt"]
    # refused once the data is read: still nothing said of going on
    proc = run("train_gpt2.py", *command, "--total_batch_size", 512, "--max_steps", 12)
    assert proc.returncode == 2 and "data position" in proc.stderr and "continuing it" not in proc.stdout, proc.stdout


def test_a_token_budget_trains_that_many_tokens_and_a_continued_run_goes_on_to_it(shards, tmp_path):
    out = tmp_path / "run"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 2, "--save_every", 2]
    run("train_gpt2.py", *command, "--max_tokens", 1024, check=True)
    assert json.load(open(out / "summary.json"))["tokens"] == 1024  # 4 steps of 256
    more = run("train_gpt2.py", *command, "--max_tokens", 1536, check=True)
    assert "max_tokens 1024 -> 1536" in more.stdout and json.load(open(out / "summary.json"))["tokens"] == 1536
    assert [r["step"] for r in read_log(out) if "loss" in r] == list(range(6))


def test_val_bits_per_byte_equals_an_independent_computation(shards, tmp_path):
    import train_gpt2 as tg
    out = tmp_path / "bpb"
    run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 4, "--eval_every", 4,
        check=True)
    logged = [r for r in read_log(out) if "val_bpb" in r][-1]
    checkpoint = torch.load(out / "ckpt_0000004.pt", weights_only=True)
    model = tg.GPT(tg.GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    # the eval's tokens: the first 512 + 1 of the val shard, in rows of the 32-token sequences
    val_file = sorted(glob.glob(os.path.join(shards, "*val*")))[0]
    tokens = torch.from_numpy(np.array(tg.load_shard(val_file)[: 512 + 1], dtype=np.int64))
    targets = tokens[1:]
    with torch.no_grad():
        logits = model(tokens[:-1].view(16, 32))
    nats = F.cross_entropy(logits.view(-1, logits.size(-1)), targets, reduction="none")
    # GPT-2's byte-level BPE: a token's bytes are its piece of the text; <|endoftext|> is no text
    enc = tg.get_tokenizer()
    text = targets != tg.EOT_TOKEN
    num_bytes = sum(len(enc.decode_bytes([t])) for t in targets[text].tolist())
    bpb = nats[text].sum().item() / (math.log(2) * num_bytes)
    assert abs(logged["val_bpb"] - bpb) < 1e-5 * bpb, (logged["val_bpb"], bpb)
    assert abs(logged["val_loss"] - nats.mean().item()) < 1e-5
    # the summary keeps the best of the run's evals
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_val_bpb"] == min(r["val_bpb"] for r in read_log(out) if "val_bpb" in r)
    assert summary["tokens"] == 4 * 256 and summary["train_seconds"] > 0 and summary["flops"] > 0
    # the val record says the tokens and FLOPs so far, and a step record the training time and the data's epoch
    assert logged["tokens"] == 4 * 256 and logged["flops"] == summary["flops"]
    steps = [r for r in read_log(out) if "loss" in r]
    assert [r["epoch"] for r in steps] == [0] * 4 and 0 < steps[0]["train_seconds"] < steps[-1]["train_seconds"]


def test_interval_means_equal_the_means_of_the_steps_on_one_and_two_processes(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--max_steps", 7, "--eval_every", 100, "--save_every", 100]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "every", check=True)
    each = {r["step"]: r for r in read_log(tmp_path / "every") if "loss" in r}
    third = run("train_gpt2.py", *flags, "--out_dir", tmp_path / "third", "--log_every", 3, check=True)
    assert "step     3/7 | loss" in third.stdout and " | eta_s " in third.stdout
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp", "--log_every", 3)
    for name, tolerance in (("third", 1e-6), ("ddp", 1e-4)):
        records = [r for r in read_log(tmp_path / name) if "loss" in r]
        assert [r["step"] for r in records] == [0, 3, 6]
        for record, steps in zip(records, ([0], [1, 2, 3], [4, 5, 6])):
            for key in ("loss", "grad_norm"):
                mean = sum(each[s][key] for s in steps) / len(steps)
                assert abs(record[key] - mean) < tolerance * abs(mean), (name, key, record, mean)
            assert abs(record["last_loss"] - each[steps[-1]]["loss"]) < tolerance * each[steps[-1]]["loss"]
            last_grad_norm = each[steps[-1]]["grad_norm"]
            assert abs(record["last_grad_norm"] - last_grad_norm) < tolerance * last_grad_norm
            # where the step's time goes: its parts, which add up to at most the step's time (the slowest rank's)
            parts = [record[f"{part}_ms"] for part in ("data", "forward_backward", "optimizer", "sync")]
            assert min(parts) >= 0 and record["forward_backward_ms"] > 0 and sum(parts) <= record["ms"], record
            assert record["tokens"] == each[steps[-1]]["tokens"] == (steps[-1] + 1) * 256


def test_flags_and_environment_are_logged_and_no_secret_is(shards, tmp_path):
    out = tmp_path / "secret"
    secrets = {"WANDB_API_KEY": "sekrit-wandb-1", "HF_TOKEN": "sekrit-hf-2", "NCCL_SECRET": "sekrit-3"}
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 2,
               "--eval_every", 2, "--wandb_project", "p", env={**secrets, "NCCL_DEBUG": "WARN"}, check=True)
    first = read_log(out)[0]
    assert first["flags"]["max_steps"] == 2 and first["environment"]["torch"] == torch.__version__
    assert first["environment"]["variables"]["NCCL_DEBUG"] == "WARN"
    # the code it ran: in the record, and in wandb (save_code)
    assert len(first["code"]["sha256"]["train_gpt2.py"]) == 64
    assert glob.glob(f"{out}/wandb/offline-run-*/files/code/train_gpt2.py")
    assert all("time" in r for r in read_log(out))
    for where in (proc.stdout, proc.stderr, (out / "log.jsonl").read_text(), (out / "summary.json").read_text(),
                  *(open(f, errors="replace").read() for f in glob.glob(f"{out}/wandb/**/*.json*", recursive=True))):
        assert "sekrit" not in where


def test_ctrl_c_after_stdout_is_gone_still_saves(shards, tmp_path):
    """`python train_gpt2.py ... 2>&1 | tee log`, then Ctrl-C: the shell's SIGINT ends tee too."""
    out = tmp_path / "tee"
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, TINY), "--data_dir", shards,
           "--out_dir", str(out), "--max_steps", 100000, "--eval_every", 100000, "--save_every", 100000]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:  # tee reads until the run is training
        if line.startswith(b"step     2/"):
            break
    proc.stdout.close()  # tee ends
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    saved = checkpoints(out)
    assert len(saved) == 1 and saved[0] != "ckpt_0000000.pt", saved
    assert any("loss" in r for r in read_log(out))


def test_ctrl_c_before_the_loop_is_one_line(shards, tmp_path):
    out = tmp_path / "early"
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, TINY), "--data_dir", shards,
           "--out_dir", str(out), "--max_steps", "100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not (out / ".lock").exists():  # the flags are read: the set-up has begun
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in stderr, stderr
    assert "stopped by signal" in stdout


def test_an_out_dir_named_like_a_pattern_keeps_and_continues(shards, tmp_path):
    out = tmp_path / "sweep[lr=1e-3]?"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--save_every", 1, "--keep_checkpoints", 2]
    run("train_gpt2.py", *command, "--max_steps", 4, check=True)
    assert checkpoints(out) == ["ckpt_0000003.pt", "ckpt_0000004.pt"]
    proc = run("train_gpt2.py", *command, "--max_steps", 5, "--resume", check=True)
    assert "at step 4" in proc.stdout and checkpoints(out) == ["ckpt_0000004.pt", "ckpt_0000005.pt"]


def test_a_folder_of_the_other_script_or_its_own_start_is_refused(base_ckpt, tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                                                     {"role": "assistant", "content": f"It is {2 * i}."}]}) + "\n"
                            for i in range(40)))
    mid = tmp_path / "mid"
    mid_flags = ["--data", f"chat:{chat}", "--device", "cpu", "--dtype", "float32", "--compile", "off",
                 "--micro_batch_size", 4, "--num_samples", 0, "--val_fraction", 0.1]
    first = run("mid_train.py", "--init_ckpt", base_ckpt, "--out_dir", mid, *mid_flags, "--max_steps", 2, check=True)
    # 4 rows of 64 tokens, where the base run's micro-batch was 4 of 32: what fit there may not here
    assert "a micro-batch of 4 x 64 tokens is larger than the base run's (4 x 32)" in first.stdout, first.stdout
    base_files = sorted(os.listdir(base_ckpt))
    for script, flags in (("mid_train.py", ["--init_ckpt", base_ckpt, "--out_dir", base_ckpt, *mid_flags]),
                          ("mid_train.py", ["--init_ckpt", mid, "--out_dir", mid, *mid_flags]),
                          ("train_gpt2.py", [*TINY, "--data_dir", base_ckpt, "--out_dir", mid])):
        proc = run(script, *flags)
        assert proc.returncode == 2 and "another --out_dir" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(os.listdir(base_ckpt)) == base_files and checkpoints(mid) == ["ckpt_0000002.pt"]
    # continued with half the micro-batch (the out-of-memory line's advice): the tokens per step stay
    proc = run("mid_train.py", "--init_ckpt", base_ckpt, "--out_dir", mid, *mid_flags, "--micro_batch_size", 2,
               "--max_steps", 3, check=True)
    tokens = [r["tokens"] for r in read_log(mid) if "loss" in r]
    assert tokens[1] - tokens[0] == tokens[2] - tokens[1] == 4 * 64, tokens
    # each launch's flags record says the seq_len it trained at (the model's context when not given)
    assert [r["flags"]["seq_len"] for r in read_log(mid) if "flags" in r] == [64, 64]


def test_a_dry_run_writes_nothing_and_flags_that_do_nothing_are_refused(shards, tmp_path):
    out = tmp_path / "dry"
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 2, "--eval_every", 2,
               "--dry_run", check=True)
    assert not out.exists() and "summary: best_val_loss" in proc.stdout
    assert "--dry_run reads and writes no out_dir: --out_dir go unused" in proc.stdout
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--muon_lr", 5)
    assert proc.returncode == 2 and proc.stderr == "error: --muon_lr does nothing with --optimizer adamw; drop it\n"
    # evals and checkpoints off
    off = tmp_path / "off"
    no_evals = TINY[: TINY.index("--num_samples")] + ["--compile", "off"]  # no eval flags: they would be refused
    run("train_gpt2.py", *no_evals, "--data_dir", shards, "--out_dir", off, "--max_steps", 2, "--eval_every", 0,
        "--save_every", 0, check=True)
    assert not checkpoints(off) and not any("val_loss" in r for r in read_log(off))
    assert json.loads((off / "summary.json").read_text())["best_val_loss"] is None


def test_a_run_goes_on_in_float16_from_a_float32_checkpoint(shards, tmp_path):
    """Moving a run to a GPU without bf16 (a V100, a T4): float16's grad scaler has no state to restore."""
    out = tmp_path / "fp16"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 2]
    run("train_gpt2.py", *command, "--max_steps", 2, check=True)
    proc = run("train_gpt2.py", *command, "--max_steps", 4, "--dtype", "float16", check=True)
    assert "at step 2" in proc.stdout and checkpoints(out)[-1] == "ckpt_0000004.pt"


def test_hellaswag_in_the_loop_stops_at_a_stop_signal():
    """The trainers ask should_stop (a collective) every 16 batches: a preempted job saves within seconds."""
    import train_gpt2 as tg
    torch.manual_seed(0)
    model = tg.GPT(tg.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=32))
    examples = [(f"A man takes {i} eggs and", ["cracks them.", "flies.", "sings.", "paints."], i % 4) for i in range(300)]
    asked = []

    def should_stop():
        asked.append(len(asked))
        return len(asked) == 2
    assert tg.evaluate_hellaswag(model, examples, tg.get_tokenizer(), "cpu", 8, should_stop=should_stop) is None
    assert len(asked) == 2  # after 32 of the 38 batches


def test_a_conversation_left_with_nothing_to_learn_is_left_out_with_a_line(base_ckpt, tmp_path):
    """A conversation cropped to a prompt alone (a long user turn) has no target: it is left out, and said, so that
    no row, and no step, has nothing to learn (a step would log a loss of 0 and still move the weights through the
    optimizer's momentum and decay)."""
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i in range(30):
            question = "Tell me about this. " * (40 if i % 2 else 1)
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": f"It is {i}."}]}) + "\n")
    proc = run("mid_train.py", "--init_ckpt", base_ckpt, "--out_dir", tmp_path / "mid", "--data", f"chat:{chat}",
               "--device", "cpu", "--dtype", "float32", "--compile", "off", "--micro_batch_size", 1,
               "--num_samples", 0, "--val_fraction", 0.2, "--max_steps", 12, check=True)
    assert "train: chat:" in proc.stdout and "15 conversations cropped to 65 tokens, 15 left out with no text to " \
        "learn" in proc.stdout, proc.stdout
    assert "train: chat:" in proc.stdout and ", 12 conversations x1" in proc.stdout  # 3 of the 15 held out for val
    assert all(r["loss"] > 0 for r in read_log(tmp_path / "mid") if "loss" in r)
    # a row of 64 tokens a step
    assert all(r["tokens"] == (r["step"] + 1) * 64 for r in read_log(tmp_path / "mid") if "loss" in r)


def test_val_rows_with_no_text_to_learn_are_one_line(base_ckpt, tmp_path):
    """Empty replies leave only special tokens to learn (no bytes of text): such conversations are left
    out, and with none left one error line says so, not a ZeroDivisionError in the val bits per byte."""
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i in range(30):
            f.write(json.dumps([{"role": "user", "content": f"Say nothing {i}."}, {"role": "assistant", "content": ""}])
                    + "\n")
    proc = run("mid_train.py", "--init_ckpt", base_ckpt, "--out_dir", tmp_path / "mid", "--data", f"chat:{chat}",
               "--device", "cpu", "--dtype", "float32", "--compile", "off", "--micro_batch_size", 2,
               "--num_samples", 0, "--val_fraction", 0.2, "--max_steps", 2)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "0 train rows and 0 val rows of conversations with text to " \
        "learn" in lines[0], proc.stderr


def test_a_new_run_into_a_folder_with_a_log_but_no_checkpoint_keeps_that_log(shards, tmp_path):
    """A run that saved no checkpoint (--save_every 0, or killed before its first save) leaves only its
    log and summary; a new run into that folder keeps them whole beside its own, and says so."""
    out = tmp_path / "nosave"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 2, "--eval_every", 2]
    run("train_gpt2.py", *command, "--save_every", 0, check=True)
    log, summary = (out / "log.jsonl").read_bytes(), (out / "summary.json").read_bytes()
    proc = run("train_gpt2.py", *command, check=True)
    assert "held a run that saved no checkpoint" in proc.stdout and "this run starts anew" in proc.stdout
    kept_logs, kept_summaries = glob.glob(str(out / "log.*-*.jsonl")), glob.glob(str(out / "summary.*-*.json"))
    assert len(kept_logs) == len(kept_summaries) == 1, os.listdir(out)
    assert open(kept_logs[0], "rb").read() == log and open(kept_summaries[0], "rb").read() == summary
    assert [r["step"] for r in read_log(out) if "loss" in r] == [0, 1]  # the new run's own log


def test_a_continued_run_logs_the_val_loss_of_the_step_it_goes_on_from(shards, tmp_path):
    """The final eval of a run (step 5, off the --eval_every 4 grid) is in the log after the run goes on,
    with the value the first run logged."""
    out = tmp_path / "offgrid"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 4, "--save_every", 100]
    run("train_gpt2.py", *command, "--max_steps", 5, check=True)
    first = {r["step"]: r["val_loss"] for r in read_log(out) if "val_loss" in r}
    run("train_gpt2.py", *command, "--max_steps", 8, check=True)
    after = {r["step"]: r["val_loss"] for r in read_log(out) if "val_loss" in r}
    assert sorted(after) == [0, 4, 5, 8], after
    assert after[5] == first[5]


def test_an_optimizer_state_that_does_not_fit_is_one_line(shards, tmp_path):
    """A fork unties the head (a new weight, the same number of parameter groups) and continues a run of
    the tied model: one error line, not torch's traceback from the optimizer's state."""
    out = tmp_path / "untied"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 100, "--save_every", 2]
    run("train_gpt2.py", *command, "--max_steps", 2, check=True)
    source = open(os.path.join(REPO, "train_gpt2.py")).read()
    tie = "        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings\n"
    assert tie in source
    fork = tmp_path / "train_gpt2.py"
    fork.write_text(source.replace(tie, ""))
    proc = subprocess.run([sys.executable, str(fork), *map(str, command), "--max_steps", "4"], capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "optimizer" in lines[0], proc.stderr[-3000:]
    assert checkpoints(out) == ["ckpt_0000002.pt"]


def test_when_stdout_fails_the_run_goes_on_and_says_so_on_stderr(shards, tmp_path):
    """Stdout's reader goes away (a closed pipe); the run finishes, and stderr says why it went quiet."""
    out = tmp_path / "quiet"
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, TINY), "--data_dir", shards,
           "--out_dir", str(out), "--max_steps", 6, "--eval_every", 6]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, stderr
    assert stderr.count("stdout failed") == 1 and "the run goes on" in stderr, stderr
    assert (out / "summary.json").exists()


def test_a_dry_run_leaves_nothing_behind_on_any_exit(shards, tmp_path):
    """A dry run reads and writes no folder: stopped by a signal it says it keeps nothing, and neither a
    stop nor an error leaves a folder behind, in the working folder or the temporary one (where only the libraries'
    caches go)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)}
    cmd = [sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, TINY), "--data_dir", shards, "--dry_run",
           "--max_steps", 100000, "--eval_every", 100000]
    proc = subprocess.Popen(list(map(str, cmd)), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    for line in proc.stdout:
        if line.startswith("step     2/"):
            break
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "nothing saved (--save_every 0 or --dry_run)" in stdout and "continues the run" not in stdout
    failed = subprocess.run([*map(str, cmd[:2]), *map(str, TINY), "--data_dir", tmp_path / "none", "--dry_run"],
                            cwd=tmp_path, capture_output=True, text=True, env=env)
    assert failed.returncode == 2
    assert sorted(os.listdir(tmp_path)) == ["tmp"]
    assert set(os.listdir(scratch)) <= {"data-gym-cache", "torchinductor_root"}, os.listdir(scratch)  # tiktoken's, torch's


def test_the_step_time_is_the_slowest_ranks_with_rank_0s_work_between_steps(shards, tmp_path):
    """Rank 0 alone writes the log between steps (here a slow disk: 2 s a record, in a copy of the
    script); the other rank waits for it in the next step, so the step's time, tok/s and MFU must count it."""
    source = open(os.path.join(REPO, "train_gpt2.py")).read()
    anchor = '        record = {**record, "time": round(time.time(), 3)}  # wall-clock seconds since 1970\n'
    assert anchor in source
    fork = tmp_path / "train_gpt2.py"
    fork.write_text(source.replace(anchor, anchor + "        time.sleep(2 if master_process else 0)\n"))
    torchrun(str(fork), *TINY, "--data_dir", shards, "--out_dir", tmp_path / "run", "--max_steps", 4,
             "--eval_every", 100, "--save_every", 100)
    steps = [r for r in read_log(tmp_path / "run") if "loss" in r]
    assert len(steps) == 4 and all(r["ms"] > 1900 for r in steps[1:]), [r["ms"] for r in steps]


def test_a_dry_run_into_a_folder_of_checkpoints_prunes_none(shards, tmp_path):
    """A dry run given a run's --out_dir reads and writes nothing there: its last step prunes no checkpoint."""
    out = tmp_path / "run"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 100]
    run("train_gpt2.py", *command, "--max_steps", 3, "--save_every", 1, "--keep_checkpoints", 3, check=True)
    before = checkpoints(out)
    run("train_gpt2.py", *command, "--max_steps", 6, "--keep_checkpoints", 1, "--dry_run", check=True)
    assert checkpoints(out) == before == ["ckpt_0000001.pt", "ckpt_0000002.pt", "ckpt_0000003.pt"]


def test_a_stop_in_the_last_evals_goes_on_to_the_summary(shards, tmp_path):
    """SIGTERM during the last step's val eval saves that step; the same command then makes the last evals and the
    summary, rather than calling the run complete without them."""
    out = tmp_path / "run"
    flags = [*TINY, "--data_dir", shards, "--out_dir", out, "--val_tokens", 24960, "--max_steps", 3, "--eval_every", 3]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, flags)], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the last train step; its val eval (195 batches, some seconds) comes next
        if line.startswith("step     2/3"):
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "stopped by signal at step 3" in stdout, stderr[-2000:]
    assert not (out / "summary.json").exists() and checkpoints(out)[-1] == "ckpt_0000003.pt"
    again = run("train_gpt2.py", *flags, check=True)
    assert "is complete" not in again.stdout and "summary: best_val_loss" in again.stdout
    assert (out / "summary.json").exists() and 3 in {r["step"] for r in read_log(out) if "val_loss" in r}
    assert "is complete" in run("train_gpt2.py", *flags, check=True).stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_run_records_its_code_and_a_run_continued_by_other_code_says_so(shards, tmp_path):
    """A fork in a git repo, edited since its commit: the first record holds the commit, that the tree changed and
    each script's sha256, and the run folder the diff. Continued by the script edited again, the run says in one
    line which file changed, and goes on."""
    repo = tmp_path / "fork"
    os.makedirs(repo)
    for script in ("train_gpt2.py", "sample.py"):
        shutil.copy(os.path.join(REPO, script), repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "fork"]):
        subprocess.run([*git, *command], cwd=repo, check=True, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    with open(repo / "train_gpt2.py", "a") as f:
        f.write("# an edit since the commit\n")
    out = tmp_path / "run"
    command = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 2, "--save_every", 2]
    run(repo / "train_gpt2.py", *command, "--max_steps", 2, check=True)
    code = read_log(out)[0]["code"]
    hashes = {name: hashlib.sha256((repo / name).read_bytes()).hexdigest() for name in ("train_gpt2.py", "sample.py")}
    assert code["commit"] == commit and code["dirty"] is True and code["sha256"] == hashes, code
    assert code["diff"] == "code_0.diff" and "+# an edit since the commit" in (out / "code_0.diff").read_text()
    with open(repo / "train_gpt2.py", "a") as f:
        f.write("# another edit\n")
    proc = run(repo / "train_gpt2.py", *command, "--max_steps", 4, check=True)
    lines = [line for line in proc.stdout.splitlines() if "code differs" in line]
    assert lines == ["resume: the code differs from the checkpoint's (train_gpt2.py changed); the run goes on "
                     "with this code"], proc.stdout
    assert [r["step"] for r in read_log(out) if "loss" in r] == [0, 1, 2, 3]
    assert "+# another edit" in (out / "code_2.diff").read_text()
