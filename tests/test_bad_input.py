"""Bad input never ends in a traceback, and a damaged run dir still resumes.

A table of bad invocations of all five scripts, each run as a user would run it (the script as __main__, with real
flags, environment and files): every one must exit with code 2 and print exactly one line on stderr, starting with
`error:` and naming the problem. Most fail at parse time; the rest need only tiny files made here. Then the
recoveries: a half-written log line, stale temp files, a truncated manifest."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest

from conftest import REPO, TINY, read_log, run, stdlib_files

def case(name, script, *args, expect, env=None):
    return pytest.param(script, list(args), expect, env or {}, id=name)


OFFLINE_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "{tmp}/hf_empty"}  # nothing listens on port 9
NO_WANDB_LOGIN = {"WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": None, "HOME": "{tmp}/home"}
DATA = ["--data_dir", "{tmp}/data", "--out_dir", "{tmp}/out", *TINY]  # valid tiny shards: train_gpt2 runs get far
MID = ["--init_ckpt", "{tmp}/ckpt.pt", "--device", "cpu", "--out_dir", "{tmp}/mid"]

CASES = [
    # ---- numeric flags out of range: parse time, the message names the flag and the range
    case("train-eval_every-neg", "train_gpt2.py", "--eval_every", -1, expect="argument --eval_every"),
    case("train-save_every-neg", "train_gpt2.py", "--save_every", -1, expect="argument --save_every"),
    case("train-log_every-0", "train_gpt2.py", "--log_every", 0, expect="argument --log_every"),
    case("train-micro_batch_size-0", "train_gpt2.py", "--micro_batch_size", 0, expect="argument --micro_batch_size"),
    case("train-seq_len-neg", "train_gpt2.py", "--seq_len", -8, expect="argument --seq_len"),
    case("train-total_batch_size-0", "train_gpt2.py", "--total_batch_size", 0, expect="argument --total_batch_size"),
    case("train-lr-0", "train_gpt2.py", "--lr", 0, expect="argument --lr"),
    case("train-lr-nan", "train_gpt2.py", "--lr", "nan", expect="argument --lr"),
    case("train-lr-word", "train_gpt2.py", "--lr", "fast", expect="argument --lr"),
    case("train-max_steps-neg", "train_gpt2.py", "--max_steps", -5, expect="argument --max_steps"),
    case("train-keep_checkpoints-neg", "train_gpt2.py", "--keep_checkpoints", -1, expect="argument --keep_checkpoints"),
    case("train-min_lr_ratio-2", "train_gpt2.py", "--min_lr_ratio", 2, expect="argument --min_lr_ratio"),
    case("train-grad_clip-neg", "train_gpt2.py", "--grad_clip", -1, expect="argument --grad_clip"),
    case("train-val_tokens-0", "train_gpt2.py", "--val_tokens", 0, expect="argument --val_tokens"),
    case("train-seed-huge", "train_gpt2.py", "--seed", 2**70, expect="argument --seed"),
    case("train-n_layer-0", "train_gpt2.py", "--n_layer", 0, expect="argument --n_layer"),
    case("train-init_from-and-a-model-flag", "train_gpt2.py", *DATA, "--init_from", "gpt2",
         expect="--block_size does nothing with --init_from (OpenAI's model as it is)"),
    case("train-vocab_size-too-small", "train_gpt2.py", *DATA, "--vocab_size", 1000,
         expect="--vocab_size 1000 is smaller than the tokenizer's 50257 tokens"),
    case("mid-lr-neg", "mid_train.py", "--lr", -2e-4, expect="argument --lr"),
    case("mid-val_fraction-1.5", "mid_train.py", "--val_fraction", 1.5, expect="argument --val_fraction"),
    case("mid-eval_every-neg", "mid_train.py", "--eval_every", -1, expect="argument --eval_every"),
    case("mid-keep_checkpoints-0", "mid_train.py", "--keep_checkpoints", 0, expect="argument --keep_checkpoints"),
    case("mid-max_steps-neg", "mid_train.py", "--max_steps", -1, expect="argument --max_steps"),
    case("sample-top_p-0", "sample.py", "--ckpt", "x", "--top_p", 0, expect="argument --top_p"),
    case("sample-top_p-1.5", "sample.py", "--ckpt", "x", "--top_p", 1.5, expect="argument --top_p"),
    case("sample-top_k-neg", "sample.py", "--ckpt", "x", "--top_k", -3, expect="argument --top_k"),
    case("sample-temperature-neg", "sample.py", "--ckpt", "x", "--temperature", -0.5, expect="argument --temperature"),
    case("sample-num_samples-0", "sample.py", "--ckpt", "x", "--num_samples", 0, expect="argument --num_samples"),
    case("hellaswag-limit-neg", "hellaswag.py", "--ckpt", "x", "--limit", -2, expect="argument --limit"),
    case("hellaswag-batch_size-0", "hellaswag.py", "--ckpt", "x", "--batch_size", 0, expect="argument --batch_size"),
    case("prepare-workers-0", "prepare_fineweb.py", "--workers", 0, expect="argument --workers"),
    case("prepare-input-and-demo", "prepare_fineweb.py", "--demo", "--input", "x.txt", expect="not allowed with"),
    case("prepare-input-and-dataset", "prepare_fineweb.py", "--input", "x.txt", "--dataset", "y",
         expect="not allowed with"),
    # huge values: an error, not a MemoryError
    case("prepare-shard_size-huge", "prepare_fineweb.py", "--shard_size", 100_000_000_000_000, expect="argument --shard_size"),
    # ---- devices
    case("train-device-gpu0", "train_gpt2.py", "--device", "gpu0", expect="--device gpu0"),
    case("train-device-cuda99", "train_gpt2.py", "--device", "cuda:99", expect="--device cuda:99"),
    case("mid-device-cuda-x", "mid_train.py", *MID[:2], "--device", "cuda:x", expect="--device cuda:x"),
    case("sample-device-gpu", "sample.py", "--ckpt", "x", "--device", "gpu", expect="--device gpu"),
    case("hellaswag-device-cuda99", "hellaswag.py", "--ckpt", "x", "--device", "cuda:99", expect="--device cuda:99"),
    # ---- files and folders
    case("train-hellaswag_file-missing", "train_gpt2.py", *DATA, "--hellaswag_file", "{tmp}/nope.jsonl",
         expect="--hellaswag_file"),
    case("hellaswag-data_file-missing", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/nope.jsonl",
         expect="--data_file"),
    case("train-shard-negative-count", "train_gpt2.py", *DATA, "--data_dir", "{tmp}/data_negative",
         expect="-5"),
    case("train-out_dir-unwritable", "train_gpt2.py", *DATA, "--out_dir", "{tmp}/a_file/out", expect="--out_dir"),
    case("train-out_dir-lock-a-folder", "train_gpt2.py", *DATA, "--out_dir", "{tmp}/lock_is_a_folder",
         expect="cannot be created or written"),
    case("mid-out_dir-unwritable", "mid_train.py", *MID, "--out_dir", "{tmp}/a_file/out", "--data", "chat:{tmp}/ok.jsonl",
         expect="--out_dir"),
    case("prepare-out_dir-unwritable", "prepare_fineweb.py", "--input", "{tmp}/doc.txt", "--out_dir", "{tmp}/a_file/out",
         expect="--out_dir"),
    case("mid-jsonl-not-utf8", "mid_train.py", *MID, "--data", "chat:{tmp}/latin1.jsonl", expect="latin1.jsonl:2"),
    case("prepare-jsonl-not-utf8", "prepare_fineweb.py", "--input", "{tmp}/latin1_text.jsonl", "--out_dir", "{tmp}/p1",
         expect="latin1_text.jsonl:2"),
    case("hellaswag-not-utf8", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_latin1.jsonl",
         expect="hs_latin1.jsonl:2"),
    # ---- malformed records, each named by file:line
    case("prepare-text-null", "prepare_fineweb.py", "--input", "{tmp}/text_null.jsonl", "--out_dir", "{tmp}/p2",
         expect="text_null.jsonl:2"),
    case("prepare-text-number", "prepare_fineweb.py", "--input", "{tmp}/text_number.jsonl", "--out_dir", "{tmp}/p3",
         expect="text_number.jsonl:1"),
    case("prepare-parquet-text-null", "prepare_fineweb.py", "--input", "{tmp}/text_null.parquet", "--out_dir", "{tmp}/p4",
         expect="text_null.parquet row 1"),
    case("mid-role-not-string", "mid_train.py", *MID, "--data", "chat:{tmp}/role_list.jsonl", expect="role_list.jsonl:2"),
    case("mid-content-not-string", "mid_train.py", *MID, "--data", "chat:{tmp}/content_number.jsonl",
         expect="content_number.jsonl:1"),
    case("mid-gsm8k-answer-not-string", "mid_train.py", *MID, "--data", "gsm8k:{tmp}/gsm8k_number.jsonl",
         expect="gsm8k_number.jsonl:1"),
    case("mid-mmlu-3-choices", "mid_train.py", *MID, "--data", "mmlu:{tmp}/mmlu_3_choices.jsonl",
         expect="mmlu_3_choices.jsonl:2: not a row of mmlu"),
    case("mid-assistant-first", "mid_train.py", *MID, "--data", "chat:{tmp}/assistant_first.jsonl",
         expect="assistant_first.jsonl:2"),
    case("mid-two-user-turns", "mid_train.py", *MID, "--data", "chat:{tmp}/two_users.jsonl", expect="two_users.jsonl:1"),
    case("mid-system-late", "mid_train.py", *MID, "--data", "chat:{tmp}/system_late.jsonl", expect="system_late.jsonl:1"),
    case("hellaswag-3-endings", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_3_endings.jsonl",
         expect="hs_3_endings.jsonl:2"),
    case("hellaswag-label-5", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_label_5.jsonl",
         expect="hs_label_5.jsonl:1"),
    case("hellaswag-ctx-number", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_ctx_5.jsonl",
         expect="hs_ctx_5.jsonl:2 is not a HellaSwag example"),
    case("hellaswag-endings-one-string", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_endings_text.jsonl",
         expect="hs_endings_text.jsonl:1"),
    case("hellaswag-ending-number", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_ending_7.jsonl",
         expect="hs_ending_7.jsonl:1"),
    case("hellaswag-label-infinity", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_label_inf.jsonl",
         expect="hs_label_inf.jsonl:1"),
    case("train-hellaswag-ctx-null", "train_gpt2.py", *DATA, "--hellaswag_file", "{tmp}/hs_ctx_null.jsonl",
         expect="hs_ctx_null.jsonl:1"),
    case("train-hellaswag-bad-label", "train_gpt2.py", *DATA, "--hellaswag_file", "{tmp}/hs_label_5.jsonl",
         expect="hs_label_5.jsonl:1"),
    # ---- services: no wandb login, no hub
    case("train-wandb-no-login", "train_gpt2.py", *DATA, "--wandb_project", "p", env=NO_WANDB_LOGIN,
         expect="wandb login"),
    case("train-init_from-offline", "train_gpt2.py", "--data_dir", "{tmp}/data", "--out_dir", "{tmp}/out", "--device",
         "cpu", "--init_from", "gpt2", env=OFFLINE_HUB,
         expect="cannot be reached"),
    case("train-demo-init_from-offline", "train_gpt2.py", "--demo", "--data_dir", "{tmp}/data", "--out_dir",
         "{tmp}/out", "--device", "cpu", "--init_from", "gpt2", env=OFFLINE_HUB, expect="cannot be reached"),
    case("mid-init_from-offline", "mid_train.py", "--init_from", "gpt2", "--device", "cpu", "--out_dir", "{tmp}/mid",
         env=OFFLINE_HUB, expect="cannot be reached"),
    case("sample-hf-offline", "sample.py", "--hf", "gpt2", "--device", "cpu", env=OFFLINE_HUB, expect="cannot be reached"),
    case("hellaswag-hf-offline", "hellaswag.py", "--hf", "gpt2", "--device", "cpu", "--data_file", "{tmp}/hs_ok.jsonl",
         env=OFFLINE_HUB, expect="cannot be reached"),
    # ---- a run dir where no checkpoint is readable
    case("train-resume-none-readable", "train_gpt2.py", *DATA, "--out_dir", "{tmp}/bad_ckpts", "--resume",
         expect="no readable checkpoint at"),
    case("sample-out_dir-none-readable", "sample.py", "--ckpt", "{tmp}/bad_ckpts", expect="no readable checkpoint at"),
    # ---- found by review
    case("mid-epochs-0", "mid_train.py", *MID, "--data", "chat:{tmp}/ok.jsonl:0", expect="must be 1 or more"),
    case("mid-epochs-neg", "mid_train.py", *MID, "--data", "chat:{tmp}/ok.jsonl:-2", expect="must be 1 or more"),
    case("mid-unpadded-vocab", "mid_train.py", "--init_ckpt", "{tmp}/ckpt_unpadded.pt", "--device", "cpu", "--out_dir",
         "{tmp}/mid", "--data", "chat:{tmp}/ok.jsonl", expect="has no room for the chat tokens"),
    case("mid-data-missing", "mid_train.py", *MID, "--data", "gsm8k:{tmp}/missing.jsonl", expect="--data gsm8k:"),
    case("mid-nothing-to-learn", "mid_train.py", *MID, "--data", "chat:{tmp}/user_only.jsonl", "--val_fraction", 0.5,
         "--micro_batch_size", 1, expect="with text to learn"),
    case("mid-val_fraction-0", "mid_train.py", "--val_fraction", 0, expect="argument --val_fraction"),
    case("mid-val_fraction-1", "mid_train.py", "--val_fraction", 1, expect="argument --val_fraction"),
    case("mid-all-held-out", "mid_train.py", *MID, "--data", "chat:{tmp}/ok.jsonl", "--val_fraction", 0.9,
         expect="--val_fraction 0.9 held out"),
    # a training run's folder is no place for shards
    case("prepare-out_dir-a-run", "prepare_fineweb.py", "--input", "{tmp}/doc.txt", "--out_dir", "{tmp}/bad_ckpts",
         expect="bad_ckpts holds a training run"),
    case("prepare-out_dir-a-run-log", "prepare_fineweb.py", "--input", "{tmp}/doc.txt", "--out_dir", "{tmp}/run_log",
         expect="holds a training run"),
    case("export-out_dir-file", "export_hf.py", "--ckpt", "{tmp}/ckpt.pt", "--out_dir", "{tmp}/a_file",
         expect="is a file"),
    case("export-out_dir-empty", "export_hf.py", "--ckpt", "{tmp}/ckpt.pt", "--out_dir", "",
         expect="--out_dir '' names no folder"),
    # ---- stdout on a full disk, after the work is done: one line, the work kept
    case("prepare-stdout-full", "prepare_fineweb.py", "--input", "{tmp}/doc.txt", "--out_dir", "{tmp}/p_full",
         "--shard_size", 2, "--workers", 1, expect="cannot write to stdout (No space left on device)"),
    case("hellaswag-stdout-full", "hellaswag.py", "--ckpt", "{tmp}/ckpt.pt", "--data_file", "{tmp}/hs_ok.jsonl",
         "--device", "cpu", expect="cannot write to stdout (No space left on device)"),
    case("export-stdout-full", "export_hf.py", "--ckpt", "{tmp}/ckpt.pt", "--out_dir", "{tmp}/hf_full",
         env={"HF_HUB_OFFLINE": "1"}, expect="cannot write to stdout (No space left on device)"),
    # ---- a data folder that prepare_fineweb.py has not finished, or that lacks a shard it listed
    case("train-data_dir-prepare-unfinished", "train_gpt2.py", *DATA, "--data_dir", "{tmp}/data_unfinished",
         expect="is not finished: its manifest.json does not list a complete set of shards; run the"),
    case("train-data_dir-listed-shard-missing", "train_gpt2.py", *DATA, "--data_dir", "{tmp}/data_missing",
         expect="t_train_000002.bin is missing, truncated or damaged"),
    # ---- flags that do nothing in the mode given
    case("sample-chat-num_samples", "sample.py", "--ckpt", "x", "--chat", "--num_samples", 3,
         expect="--num_samples does nothing with --chat"),
    case("sample-greedy-top_p", "sample.py", "--ckpt", "x", "--temperature", 0, "--top_p", 0.9,
         expect="--top_p does nothing with --temperature 0"),
    case("hellaswag-data_file-split", "hellaswag.py", "--ckpt", "x", "--data_file", "{tmp}/hs_ok.jsonl",
         "--split", "train", expect="--split does nothing with --data_file"),
    case("hellaswag-cast_weights-float32", "hellaswag.py", "--ckpt", "x", "--cast_weights",
         expect="--cast_weights does nothing with --dtype float32"),
    # evals, checkpoints or OpenAI's model off, and a dry run, which reads and writes no folder
    case("train-eval_every-0-num_samples", "train_gpt2.py", "--data_dir", "{tmp}/data", "--eval_every", 0,
         "--num_samples", 2, expect="--num_samples does nothing with --eval_every 0"),
    case("train-eval_every-0-val_tokens", "train_gpt2.py", *DATA, "--eval_every", 0,
         expect="--val_tokens does nothing with --eval_every 0"),
    case("train-eval_every-0-hellaswag_file", "train_gpt2.py", "--eval_every", 0, "--hellaswag_file", "{tmp}/hs_ok.jsonl",
         expect="--hellaswag_file does nothing with --eval_every 0"),
    case("train-save_every-0-keep_checkpoints", "train_gpt2.py", *DATA, "--save_every", 0, "--keep_checkpoints", 5,
         expect="--keep_checkpoints does nothing with --save_every 0"),
    case("train-init_from-model", "train_gpt2.py", "--init_from", "gpt2", "--model", "gpt2-medium",
         expect="--model does nothing with --init_from"),
    case("train-dry_run-resume", "train_gpt2.py", "--dry_run", "--resume", expect="--resume does nothing with --dry_run"),
    case("mid-eval_every-0-num_samples", "mid_train.py", *MID, "--eval_every", 0, "--num_samples", 2,
         expect="--num_samples does nothing with --eval_every 0"),
    case("mid-val_fraction-no-source-from-files", "mid_train.py", *MID, "--data", "chat:hub",
         "simplespelling:{tmp}/doc.txt", "--val_fraction", 0.1,
         expect="--val_fraction does nothing with no --data source read from files"),
    case("mid-dry_run-resume", "mid_train.py", "--init_ckpt", "{tmp}/ckpt.pt", "--dry_run", "--resume",
         expect="--resume does nothing with --dry_run"),
    # inputs checked before the first step: nothing trained is lost to them
    case("train-prompt-special-token", "train_gpt2.py", *DATA, "--num_samples", 1, "--prompt", "<|endoftext|> hello",
         "--max_steps", 1, "--eval_every", 1, expect="--prompt '<|endoftext|> hello' holds a special token"),
    case("train-rank-not-a-number", "train_gpt2.py", *DATA, env={"RANK": "x"}, expect="torchrun's variables"),
    case("train-world_size-2-no-master_addr", "train_gpt2.py", *DATA, env={"RANK": "0", "WORLD_SIZE": "2",
         "LOCAL_RANK": "0", "MASTER_ADDR": None, "MASTER_PORT": "29500"}, expect="MASTER_ADDR=''"),
    case("sample-rank-past-world_size", "sample.py", "--ckpt", "x", env={"RANK": "1", "WORLD_SIZE": "1"},
         expect="torchrun's variables"),
    case("mid-epochs-beyond-memory", "mid_train.py", *MID, "--data", "chat:{tmp}/ok.jsonl:99999999999",
         expect="give fewer epochs"),
    case("mid-seq_len-1", "mid_train.py", *MID, "--data", "chat:{tmp}/ok.jsonl", "--seq_len", 1,
         expect="a longer --seq_len"),
    case("mid-url-cached-by-name-only", "mid_train.py", *MID, "--data", "simplespelling:http://127.0.0.1:9/w/doc.txt",
         env={"TORCH_HOME": "{tmp}/torch_home"}, expect="cannot download http://127.0.0.1:9/w/doc.txt"),
    # a run's folder: never the code's, nor the one run from; --resume needs a run to continue
    case("train-run-dotdot", "train_gpt2.py", *DATA[:2], *TINY, "--run", "..", "--max_steps", 1,
         expect="--run '..' is a name"),
    case("train-out_dir-above-the-code", "train_gpt2.py", *DATA[:2], *TINY, "--out_dir", os.path.dirname(REPO),
         "--max_steps", 1, expect=f"--out_dir {os.path.dirname(REPO)} holds the code"),
    case("mid-out_dir-repo", "mid_train.py", *MID, "--out_dir", REPO, "--data", "chat:{tmp}/ok.jsonl",
         "--max_steps", 1, expect="holds the code"),
    case("train-resume-missing-folder", "train_gpt2.py", *DATA, "--out_dir", "{tmp}/no_run", "--resume",
         expect="holds no checkpoint to continue from"),
    case("train-resume-empty-folder", "train_gpt2.py", *DATA, "--out_dir", "{tmp}/empty_run", "--resume",
         expect="holds no checkpoint to continue from"),
    case("train-hellaswag_limit-no-file", "train_gpt2.py", "--hellaswag_limit", 10,
         expect="--hellaswag_limit does nothing with no --hellaswag_file"),
    case("train-max_steps-and-max_tokens", "train_gpt2.py", "--max_steps", 5, "--max_tokens", 1000,
         expect="--max_steps and --max_tokens both size the run: give one"),
    case("mid-max_steps-and-max_tokens", "mid_train.py", *MID, "--max_tokens", 1000, "--max_steps", 5,
         expect="--max_steps and --max_tokens both size the run: give one"),
]


def write_shard(path, tokens, count=None):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, len(tokens) if count is None else count
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes())


def jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def make_files(tmp):
    """The small files the cases read: shards, a tiny checkpoint, and a bad file for every kind of bad record."""
    import torch
    from train_gpt2 import GPT, GPTConfig

    tokens = np.random.default_rng(0).integers(0, 50257, 20_000)
    for name, count in (("data", None), ("data_negative", -5), ("data_unfinished", None),
                        ("data_missing", None)):
        os.makedirs(f"{tmp}/{name}")
        write_shard(f"{tmp}/{name}/t_val_000000.bin", tokens)
        write_shard(f"{tmp}/{name}/t_train_000001.bin", tokens, count)
    # the manifest of a prepare_fineweb.py run stopped after two shards; and a finished one's, a shard gone
    shards = [{"file": f"t_{split}_{i:06d}.bin", "tokens": len(tokens), "end_doc": i + 1, "end_offset": 0}
              for i, split in enumerate(["val", "train", "train"])]
    json.dump({"shards": shards[:2], "complete": False}, open(f"{tmp}/data_unfinished/manifest.json", "w"))
    json.dump({"shards": shards, "complete": True}, open(f"{tmp}/data_missing/manifest.json", "w"))
    config = GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)
    torch.save({"model": GPT(config).state_dict(), "config": asdict(config)}, f"{tmp}/ckpt.pt")
    config.vocab_size = 50257  # GPT-2's own vocab, without the padding that holds the chat tokens
    torch.save({"model": GPT(config).state_dict(), "config": asdict(config)}, f"{tmp}/ckpt_unpadded.pt")
    os.makedirs(f"{tmp}/bad_ckpts/ckpt_0000002.pt")  # a folder named like a checkpoint
    os.makedirs(f"{tmp}/run_log")
    open(f"{tmp}/run_log/log.jsonl", "w").close()
    open(f"{tmp}/bad_ckpts/ckpt_0000001.pt", "wb").close()  # an empty file
    open(f"{tmp}/a_file", "w").close()
    os.makedirs(f"{tmp}/lock_is_a_folder/.lock")
    os.makedirs(f"{tmp}/home")
    os.makedirs(f"{tmp}/empty_run")
    os.makedirs(f"{tmp}/torch_home/hub")
    with open(f"{tmp}/torch_home/hub/doc.txt", "w") as f:  # where another URL's doc.txt was cached by its name
        f.write("apple\n")
    with open(f"{tmp}/doc.txt", "w") as f:
        f.write("some text\n")
    hi = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    jsonl(f"{tmp}/ok.jsonl", [{"messages": hi}] * 4)
    jsonl(f"{tmp}/user_only.jsonl", [{"messages": hi[:1]}] * 4)
    with open(f"{tmp}/latin1.jsonl", "wb") as f:
        f.write(json.dumps({"messages": hi}).encode() + b"\n" + json.dumps({"messages": hi}).encode()[:-5] + b"caf\xe9\"}]}\n")
    with open(f"{tmp}/latin1_text.jsonl", "wb") as f:
        f.write(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with open(f"{tmp}/latin1.txt", "wb") as f:
        f.write(b"caf\xe9 au lait")
    jsonl(f"{tmp}/text_null.jsonl", [{"text": "fine"}, {"text": None}])
    jsonl(f"{tmp}/text_number.jsonl", [{"text": 42}])
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["fine", None]}), f"{tmp}/text_null.parquet")
    jsonl(f"{tmp}/role_list.jsonl", [{"messages": hi}, {"messages": [{"role": ["user"], "content": "hi"}]}])
    jsonl(f"{tmp}/content_number.jsonl", [[{"role": "user", "content": 7}]])
    jsonl(f"{tmp}/gsm8k_number.jsonl", [{"question": "1+1?", "answer": 2}])
    jsonl(f"{tmp}/mmlu_3_choices.jsonl", [{"question": "1+1?", "choices": list("1234"), "answer": 1},
                                          {"question": "1+2?", "choices": list("123"), "answer": 2}])
    jsonl(f"{tmp}/assistant_first.jsonl", [{"messages": hi}, {"messages": hi[::-1]}])
    jsonl(f"{tmp}/two_users.jsonl", [[hi[0], hi[0], hi[1]]])
    jsonl(f"{tmp}/system_late.jsonl", [[*hi, {"role": "system", "content": "be brief"}]])
    example = {"ctx": "A man sits", "endings": ["a", "b", "c", "d"], "label": 1}
    jsonl(f"{tmp}/hs_ok.jsonl", [example])
    jsonl(f"{tmp}/hs_3_endings.jsonl", [example, {**example, "endings": ["a", "b", "c"]}])
    jsonl(f"{tmp}/hs_label_5.jsonl", [{**example, "label": 5}])
    jsonl(f"{tmp}/hs_ctx_5.jsonl", [example, {**example, "ctx": 5}])
    jsonl(f"{tmp}/hs_ctx_null.jsonl", [{**example, "ctx": None}])
    jsonl(f"{tmp}/hs_endings_text.jsonl", [{**example, "endings": "abcd"}])
    jsonl(f"{tmp}/hs_ending_7.jsonl", [{**example, "endings": ["a", "b", 7, "d"]}])
    jsonl(f"{tmp}/hs_label_inf.jsonl", [{**example, "label": float("inf")}])
    with open(f"{tmp}/hs_latin1.jsonl", "wb") as f:
        f.write(json.dumps(example).encode() + b"\n" + json.dumps(example).encode().replace(b"sits", b"s\xe9ts") + b"\n")


# Starting Python and importing torch and the scripts' other imports costs ~5 s of CPU a process, most of what a
# parse-time case costs. So one process imports them once and forks a child per case (two at a time); the child runs
# the script as __main__ with the case's argv, environment, working folder and stdin, as `python script.py ARGS`
# would, and exits as it does.
RUNNER = r"""
import json, os, runpy, sys, time, traceback
import numpy, tiktoken, torch, torch.distributed.fsdp
cases, running, results = json.load(sys.stdin), {}, {}
def start(name, script, argv, env, workdir):
    pid = os.fork()
    if pid:
        running[pid] = (name, time.time())
        return
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group, so that a case that hangs is killed with all its workers
        stdout = "/dev/full" if name.endswith("stdout-full") else f"{workdir}/{name}.out"  # a full disk under stdout
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT),
                                (2, f"{workdir}/{name}.err", os.O_WRONLY | os.O_CREAT)):
            os.dup2(os.open(path, flags), fd)
        sys.stdin = open(0, closefd=False)
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *argv]
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
while cases or running:
    if cases and len(running) < 2:
        start(*cases.pop(0))
        continue
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid == 0:
        for pid, (name, t0) in running.items():
            if time.time() - t0 > 120:
                os.killpg(pid, 9)
        time.sleep(0.02)
        continue
    name, t0 = running.pop(pid)
    results[name] = (os.waitstatus_to_exitcode(status), time.time() - t0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case run once: {id: (exit code, stderr, seconds)}."""
    tmp = str(tmp_path_factory.mktemp("bad_input"))
    make_files(tmp)
    base_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # the hub cases test the scripts' own probe
        base_env.pop(key, None)
    cases = []
    for c in CASES:
        script, args, _, env = c.values
        case_env = {**base_env, **{k: v.format(tmp=tmp) for k, v in env.items() if v is not None}}
        for key in (k for k, v in env.items() if v is None):
            case_env.pop(key, None)
        own = {f"{tmp}/out": f"{tmp}/out_{c.id}", f"{tmp}/mid": f"{tmp}/mid_{c.id}"}  # cases run at once, and an
        args = [own.get(a, a) for a in (str(a).format(tmp=tmp) for a in args)]  # out_dir in use is refused
        cases.append((c.id, os.path.join(REPO, script), args, case_env, tmp))
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(cases), capture_output=True, text=True,
                          env={**base_env}, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: (code, open(f"{tmp}/{name}.err").read(), seconds)
            for name, (code, seconds) in json.loads(proc.stdout).items()}


def test_enough_cases_cover_every_script():
    scripts = [c.values[0] for c in CASES]
    assert len(CASES) >= 40 and len(set(scripts)) == 6 and min(map(scripts.count, set(scripts) - {"export_hf.py"})) >= 5


@pytest.mark.parametrize("script,args,expect,env", CASES)
def test_bad_invocation_is_one_line_error(script, args, expect, env, results, request):
    code, stderr, seconds = results[request.node.callspec.id]
    lines = stderr.strip().splitlines()
    assert code == 2, (code, stderr[-3000:])
    assert "Traceback" not in stderr and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: ") and expect in lines[0], lines[0]
    assert seconds < 60, f"took {seconds:.0f} s to fail"


# -----------------------------------------------------------------------------
# recovery of a damaged out_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny run of 4 steps with checkpoints at steps 2 and 4, on random-token shards."""
    tmp = tmp_path_factory.mktemp("recovery")
    tokens = np.random.default_rng(0).integers(0, 50257, 20_000)
    os.makedirs(tmp / "data")
    write_shard(str(tmp / "data" / "t_val_000000.bin"), tokens)
    write_shard(str(tmp / "data" / "t_train_000001.bin"), tokens[::-1])
    run("train_gpt2.py", *TINY, "--data_dir", tmp / "data", "--out_dir", tmp / "run", "--max_steps", 4,
        "--save_every", 2, "--eval_every", 2, check=True)
    assert sorted(os.listdir(tmp / "run")) == [".lock", "ckpt_0000002.pt", "ckpt_0000004.pt", "log.jsonl",
                                               "summary.json"]
    return tmp


def resume(run_dir, out_dir):
    return run("train_gpt2.py", *TINY, "--data_dir", run_dir / "data", "--out_dir", out_dir, "--max_steps", 4,
               "--save_every", 2, "--eval_every", 2, "--resume")


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_resume_goes_on_from_the_newest_readable_checkpoint_and_moves_a_damaged_one_aside(run_dir, tmp_path, damage):
    """Checkpoints are written whole: a damaged newest one is damage from outside. Under torchrun --max_restarts
    nobody is there to move it, so the run moves it aside (never deletes it) and goes on from the one before,
    saying both in one line."""
    out = tmp_path / "run"
    shutil.copytree(run_dir / "run", out)
    newest = out / "ckpt_0000004.pt"
    if damage == "truncated":
        data = newest.read_bytes()
        newest.write_bytes(data[: len(data) // 2])
    else:
        newest.write_bytes(b"")
    damaged_bytes = newest.read_bytes()
    proc = resume(run_dir, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "moved it aside" in line]
    assert len(said) == 1 and f"{newest}.damaged" in said[0] and str(out / "ckpt_0000002.pt") in said[0], said
    assert (out / "ckpt_0000004.pt.damaged").read_bytes() == damaged_bytes
    assert [r["step"] for r in read_log(out) if "loss" in r] == [0, 1, 2, 3]  # steps 2 and 3 made again
    assert torch_load_step(newest) == 4  # saved anew


def torch_load_step(path):
    import torch
    return torch.load(path, weights_only=True)["step"]


def test_resume_drops_a_half_written_log_line_and_stale_temp_files(run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir / "run", out)
    (out / "ckpt_0000004.pt").unlink()  # killed while saving at step 4: a temp file, and a log line cut short
    (out / "ckpt_0000004.pt.tmp").write_bytes(b"PK\x03\x04 half a checkpoint")
    (out / "log.jsonl.tmp").write_text('{"step": 1}\n')
    (out / "hf.tmp").mkdir()  # export_hf.py --out_dir run/hf, killed: not a save's; left to export_hf.py
    (out / "hf.tmp" / "config.json").write_text("{}")
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 5.1, "lr"')
    proc = resume(run_dir, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    removed = [line for line in proc.stdout.splitlines() if line.startswith("removed ")]
    assert len(removed) == 2 and any("ckpt_0000004.pt.tmp" in line for line in removed), proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [".lock", "ckpt_0000002.pt", "ckpt_0000004.pt", "hf.tmp",
                                                     "log.jsonl", "summary.json"]
    records = read_log(out)  # every line whole again
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 2, 4]


def test_prepare_continues_after_a_truncated_manifest(tmp_path):
    files = stdlib_files(8)
    args = ["--input", *files, "--out_dir", tmp_path / "shards", "--shard_size", 8_000, "--workers", 1]
    run("prepare_fineweb.py", *args, check=True)
    shards = {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.bin")}
    manifest = (tmp_path / "shards" / "manifest.json").read_text()
    assert len(shards) >= 3
    (tmp_path / "shards" / "manifest.json").write_text(manifest[: len(manifest) // 2])
    (tmp_path / "shards" / "shards_train_000002.bin.tmp").write_bytes(b"\0" * 100)  # a killed shard write
    proc = run("prepare_fineweb.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "manifest.json is unreadable" in proc.stderr and "Traceback" not in proc.stderr
    assert "shards_train_000002.bin.tmp, the temp file of a killed save" in proc.stdout
    assert {p.name: p.read_bytes() for p in (tmp_path / "shards").glob("*.bin")} == shards
    assert json.loads((tmp_path / "shards" / "manifest.json").read_text())["complete"] is True
    assert not list((tmp_path / "shards").glob("*.tmp"))


def test_prepare_refuses_a_text_file_that_is_not_utf8(tmp_path):
    """Like a .jsonl line: an error naming the file, not text read with its bytes guessed."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait, ".encode("latin-1") * 2000)
    proc = run("prepare_fineweb.py", "--input", *stdlib_files(2), bad, "--out_dir", tmp_path / "shards",
               "--shard_size", 5_000, "--workers", 1)
    line = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in line and line.startswith("error:"), proc.stderr[-3000:]
    assert str(bad) in line and "UnicodeDecodeError" in line, line


def test_another_programs_checkpoint_is_one_error_line_in_every_script(tmp_path):
    """nanoGPT's ckpt.pt has `model` and `config` keys too, its config being its training flags: every script that
    loads a checkpoint refuses it in one line (it was a TypeError in GPTConfig), and so does a run into an out_dir
    that holds one under our checkpoints' name (it was a KeyError)."""
    import torch
    from train_gpt2 import GPT, GPTConfig
    config = GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32)
    model_args = dict(n_layer=1, n_head=2, n_embd=32, block_size=64, bias=False, vocab_size=50304, dropout=0.0)
    nanogpt = {"model": GPT(config).state_dict(), "optimizer": {}, "model_args": model_args, "iter_num": 100,
               "best_val_loss": 3.2, "config": {"out_dir": "out", "eval_interval": 2000, "batch_size": 12,
                                                "learning_rate": 6e-4, **model_args}}
    torch.save(nanogpt, tmp_path / "ckpt.pt")
    os.makedirs(tmp_path / "run")
    shutil.copy(tmp_path / "ckpt.pt", tmp_path / "run" / "ckpt_0000100.pt")
    jsonl(tmp_path / "hs.jsonl", [{"ctx": "A man sits", "endings": ["a", "b", "c", "d"], "label": 1}])
    ckpt = str(tmp_path / "ckpt.pt")
    for script, *args in [("sample.py", "--ckpt", ckpt),
                          ("hellaswag.py", "--ckpt", ckpt, "--data_file", tmp_path / "hs.jsonl"),
                          ("export_hf.py", "--ckpt", ckpt, "--out_dir", tmp_path / "hf"),
                          ("mid_train.py", "--init_ckpt", ckpt, "--out_dir", tmp_path / "mid", "--device", "cpu"),
                          ("train_gpt2.py", "--out_dir", tmp_path / "run", "--device", "cpu")]:
        proc = run(script, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (script, proc.stderr[-3000:])
        assert lines[0].startswith("error: no readable checkpoint at"), lines[0]
        assert "not a train_gpt2.py/mid_train.py checkpoint" in lines[0] and "unexpected keyword argument" in lines[0]
