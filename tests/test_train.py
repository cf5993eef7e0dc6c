import glob
import inspect
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import REPO, TINY, read_log, run, stdlib_files, torchrun, train_losses, val_losses
from train_gpt2 import GPT, MODEL_SIZES, GPTConfig, get_tokenizer, load_hf_state_dict, num_params


def test_gpt2_124m_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL_SIZES["gpt2"]))
    assert num_params(model) == 124_475_904


def test_logits_equal_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    ours = GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=64)).eval()
    load_hf_state_dict(ours, hf.state_dict())
    idx = torch.randint(0, 50257, (2, 100))
    with torch.no_grad():
        expected = hf(idx).logits
        got = ours(idx)
    assert (got[..., :50257] - expected).abs().max().item() < 1e-4


def test_tokenizer_is_gpt2_and_offline():
    enc = get_tokenizer()
    assert enc.n_vocab == 50257
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def test_single_batch_overfits(shards, tmp_path):
    # --overfit_batch: the first step's batch (128 tokens), over and over, as a user checks an edited model
    flags = [*TINY, "--total_batch_size", 128, "--lr", 1e-2, "--weight_decay", 0, "--max_steps", 100]
    flags = [flag for flag in flags if flag not in ("--val_tokens", "512", "--num_samples", "0")]
    run("train_gpt2.py", *flags, "--data_dir", shards, "--out_dir", tmp_path, "--overfit_batch", "--eval_every", 0,
        check=True)
    assert train_losses(tmp_path)[99] < 0.2


def test_a_warm_up_past_the_last_step_shrinks_with_the_run_or_is_said(capsys):
    from train_gpt2 import get_args
    # the preset's 20 warm-up steps, past the 10 steps given: the same share of them, said in a line
    assert get_args(["--demo", "--max_steps", "10", "--dry_run"]).warmup_steps == 1
    assert "--demo's 20 warm-up steps are not below --max_steps 10: --warmup_steps 1" in capsys.readouterr().out
    # one given is kept (a smoke run), and a line says the learning rate never decays
    assert get_args(["--max_steps", "2", "--warmup_steps", "2", "--dry_run"]).warmup_steps == 2
    assert "the learning rate never decays" in capsys.readouterr().out


def test_loss_falls_on_real_text(shards, tmp_path):
    out = tmp_path / "run"
    write_hellaswag_fixture(tmp_path / "hellaswag.jsonl")
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 40, "--eval_every", 20,
               "--num_samples", 1, "--sample_len", 8, "--hellaswag_file", tmp_path / "hellaswag.jsonl",
               "--hellaswag_limit", 4, check=True)
    # each HellaSwag record says how many examples it scored: the first 4 of the file's 6
    assert [r["hellaswag_examples"] for r in read_log(out) if "hellaswag_acc" in r] == [4, 4, 4]
    val = val_losses(out)
    assert val[40] < val[0] - 2.0, val
    assert "---- sample 0 ----\nHello, I'm a language model," in proc.stdout  # text, not a repr
    losses = train_losses(out)
    assert np.mean([losses[s] for s in range(35, 40)]) < np.mean([losses[s] for s in range(5)]) - 2.0
    record = [r for r in read_log(out) if r["step"] == 39 and "loss" in r][0]
    assert {"lr", "grad_norm", "ms", "tok_per_s", "peak_mem_gib"} <= record.keys()
    ckpt = torch.load(sorted(glob.glob(str(out / "ckpt_*.pt")))[-1], weights_only=True)
    assert ckpt["step"] == 40 and ckpt["val_loss"] == val[40] and ckpt["loader"]["tokens_read"] == 40 * 256
    assert ckpt["args"]["max_steps"] == 40 and ckpt["config"]["n_embd"] == 32
    assert all(not k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])


def test_resume_reproduces_uninterrupted_run(shards, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = [*TINY, "--data_dir", shards, "--max_steps", 12, "--eval_every", 6, "--save_every", 6]
    run("train_gpt2.py", *flags, "--out_dir", straight, check=True)
    os.makedirs(resumed)  # stop at step 6: continue from that checkpoint in a fresh process
    checkpoint = torch.load(straight / "ckpt_0000006.pt", weights_only=True)
    for group in checkpoint["optimizer"]["param_groups"]:  # a key that older checkpoints held
        group["base_lr"] = 3e-3
    torch.save(checkpoint, resumed / "ckpt_0000006.pt")
    proc = run("train_gpt2.py", *flags, "--out_dir", resumed, "--resume", check=True)
    assert "continuing it from" in proc.stdout and "at step 6" in proc.stdout
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(b) == list(range(6, 12))
    assert all(a[s] == b[s] for s in b), (a, b)
    assert val_losses(straight)[12] == val_losses(resumed)[12]


def test_ddp_matches_single_process(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--max_steps", 6, "--eval_every", 3]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "single", check=True)
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp")
    single, ddp = train_losses(tmp_path / "single"), train_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(6))
    assert all(abs(single[s] - ddp[s]) < 1e-5 for s in single), (single, ddp)
    assert abs(val_losses(tmp_path / "single")[6] - val_losses(tmp_path / "ddp")[6]) < 1e-5


def wait_for(predicate, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def start(args, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt2.py"), *map(str, args), "--out_dir", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigkill_resumes_from_last_checkpoint(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--max_steps", 60, "--eval_every", 1000, "--save_every", 5,
             "--keep_checkpoints", 2]
    killed = tmp_path / "killed"
    proc = start(flags, killed)
    assert wait_for(lambda: len(glob.glob(str(killed / "ckpt_*.pt"))) >= 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for path in glob.glob(str(killed / "ckpt_*.pt")):  # no checkpoint is ever partial
        assert torch.load(path, weights_only=True)["step"] % 5 == 0
    run("train_gpt2.py", *flags, "--out_dir", killed, "--resume", check=True)
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "straight", check=True)
    a, b = train_losses(tmp_path / "straight"), train_losses(killed)
    assert sorted(b) == list(range(60)) and all(a[s] == b[s] for s in a)


def test_a_rank_killed_under_torchrun_max_restarts_goes_on_from_the_last_checkpoint(shards, tmp_path):
    """torchrun --max_restarts 1 starts the ranks again when one dies, and the run goes on from its newest checkpoint
    to the uninterrupted run's end. The restarted ranks must not read the dead attempt's addresses from torchrun's
    store (they used to, now and then: gloo's "Connection refused", and the restart was spent)."""
    flags = [*TINY, "--data_dir", shards, "--max_steps", 40, "--eval_every", 40, "--save_every", 4]
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "straight")
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max_restarts=1",
           os.path.join(REPO, "train_gpt2.py"), *map(str, flags), "--out_dir", str(killed)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert wait_for(lambda: (killed / "ckpt_0000004.pt").exists())

        def rank_1():  # torchrun's worker of rank 1, by its environment
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    parent = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
                    if parent == proc.pid and b"RANK=1" in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                        return int(pid)
                except OSError:  # a process that has ended
                    pass
        os.kill(rank_1(), signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert val_losses(killed)[40] == val_losses(tmp_path / "straight")[40]
    # the rank that survived says so in one line, not torch's traceback
    assert "Traceback" not in stderr and "error: rank 0 lost another rank" in stderr, stderr[-3000:]


def test_sigterm_saves_and_exits_cleanly(shards, tmp_path):
    out = tmp_path / "run"
    proc = start([*TINY, "--data_dir", shards, "--max_steps", 100000, "--eval_every", 1000], out)
    assert wait_for(lambda: os.path.exists(out / "log.jsonl") and len(read_log(out)) >= 3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "stopped by signal" in stdout
    saved = torch.load(sorted(glob.glob(str(out / "ckpt_*.pt")))[-1], weights_only=True)
    assert saved["step"] == max(train_losses(out)) + 1


def write_hellaswag_fixture(path, count=6):
    import json
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"ind": i, "activity_label": "Cooking", "ctx": f"A man takes {i} eggs and",
                                "endings": ["cracks them into a bowl.", "flies to the moon.", "sings loudly.",
                                            "paints the wall blue."], "label": i % 4, "split": "val"}) + "\n")


def read_wandb_history(run_dir):
    """History rows from an offline run's .wandb file: a LevelDB-style log of protobuf records."""
    import json
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    data = open(glob.glob(os.path.join(run_dir, "run-*.wandb"))[0], "rb").read()
    pos, chunks, rows = 7, b"", []  # 7-byte file header, then 32 KiB blocks of (crc, length, type) records
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
        chunks += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                rows.append({"_step": record.history.step.num, **items})
    return rows


def test_wandb_offline_run_holds_metrics_and_continues_on_resume(shards, tmp_path):
    out = tmp_path / "run"
    flags = [*TINY, "--data_dir", shards, "--out_dir", out, "--eval_every", 4, "--save_every", 4,
             "--wandb_project", "test"]
    run("train_gpt2.py", *flags, "--max_steps", 4, check=True)
    run_dirs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert len(run_dirs) == 1
    rows = read_wandb_history(run_dirs[0])
    logged = {r["_step"]: r for r in rows}
    ours = train_losses(out)
    assert all(abs(logged[s]["loss"] - ours[s]) < 1e-9 for s in ours)
    assert "val_loss" in logged[4]
    run_id = torch.load(str(out / "ckpt_0000004.pt"), weights_only=True)["wandb_run_id"]
    assert run_dirs[0].endswith(run_id)
    proc = run("train_gpt2.py", *flags, "--max_steps", 8, "--resume", check=True)
    assert all(d.endswith(run_id) for d in glob.glob(str(out / "wandb" / "offline-run-*")))
    # the launch that goes on asks wandb to go on from the checkpoint's step (resume_from), where log.jsonl goes
    # on, and says what wandb will show once synced
    second = sorted(set(glob.glob(str(out / "wandb" / "offline-run-*"))) - set(run_dirs))
    assert len(second) == 1 and b"branch_point" in open(glob.glob(f"{second[0]}/run-*.wandb")[0], "rb").read()
    assert min(r["_step"] for r in read_wandb_history(second[0])) == 4
    assert f"wandb is offline: wandb sync uploads this launch into run {run_id} from step 4 on" in proc.stdout


def write_shard(path, tokens, magic=20240520, truncate=0):
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, 1, len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.asarray(tokens, dtype=np.uint16).tobytes()[: len(tokens) * 2 - truncate])


@pytest.mark.parametrize("case", ["missing_dir", "no_shards", "bad_magic", "truncated", "seq_len", "batch", "model"])
def test_bad_input_gives_one_line_error(case, shards, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    tokens = np.arange(5000) % 50000
    write_shard(data / "x_val_000000.bin", tokens)
    write_shard(data / "x_train_000001.bin", tokens)
    flags = [*TINY, "--data_dir", data, "--out_dir", tmp_path / "out", "--max_steps", 1]
    expect = {"missing_dir": "is not a folder", "no_shards": "needs train and val shards", "bad_magic": "magic",
              "truncated": "truncated", "seq_len": "beyond the model's context", "batch": "not divisible",
              "model": "invalid choice"}[case]
    if case == "missing_dir":
        flags += ["--data_dir", tmp_path / "nowhere"]
    elif case == "no_shards":
        flags += ["--data_dir", tmp_path / "out"]
        os.makedirs(tmp_path / "out")
    elif case == "bad_magic":
        write_shard(data / "x_train_000001.bin", tokens, magic=1234)
    elif case == "truncated":
        write_shard(data / "x_train_000001.bin", tokens, truncate=100)
    elif case == "seq_len":
        flags += ["--seq_len", 128, "--total_batch_size", 512]
    elif case == "batch":
        flags += ["--total_batch_size", 1000]
    elif case == "model":
        flags += ["--model", "gpt3"]
    proc = run("train_gpt2.py", *flags)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], proc.stderr


def test_npy_shards_train_the_same_as_bin(shards, tmp_path):
    """build-nanogpt writes its shards as 1-D uint16 .npy files: the same tokens give the same run."""
    from train_gpt2 import find_shards, load_shard
    npy = tmp_path / "npy"
    npy.mkdir()
    for f in find_shards(shards, "val") + find_shards(shards, "train"):
        np.save(npy / os.path.basename(f).replace(".bin", ".npy"), np.array(load_shard(f)))
    flags = [*TINY, "--max_steps", 3, "--eval_every", 3]
    run("train_gpt2.py", *flags, "--data_dir", shards, "--out_dir", tmp_path / "bin", check=True)
    run("train_gpt2.py", *flags, "--data_dir", npy, "--out_dir", tmp_path / "npy_run", check=True)
    assert train_losses(tmp_path / "bin") == train_losses(tmp_path / "npy_run")


def test_float16_trains_with_a_grad_scaler(shards, tmp_path):
    out = tmp_path / "fp16"
    run("train_gpt2.py", *TINY, "--dtype", "float16", "--data_dir", shards, "--out_dir", out, "--max_steps", 6,
        "--eval_every", 6, check=True)
    val = val_losses(out)
    assert np.isfinite(list(val.values())).all() and val[6] < val[0]
    assert torch.load(out / "ckpt_0000006.pt", weights_only=True)["scaler"]["scale"] > 0


def test_val_shard_of_a_folder_named_pretrain_never_trains_and_val_reads_it_once(tmp_path):
    """prepare_fineweb.py names shards after the out_dir: in a folder named `pretrain` the val shard is
    pretrain_val_000000.bin, which holds "train". It must still be val: the run equals one in a folder named
    `corpus`. And --val_tokens past the val shard reads it once, no more, and says so."""
    from train_gpt2 import find_shards
    pretrain, corpus = tmp_path / "pretrain", tmp_path / "corpus"
    run("prepare_fineweb.py", "--input", *stdlib_files(8), "--out_dir", pretrain, "--shard_size", 3000, "--workers", 1,
        check=True)
    corpus.mkdir()
    for f in glob.glob(str(pretrain / "*.bin")):
        os.link(f, corpus / os.path.basename(f).replace("pretrain_", "corpus_"))
    assert [os.path.basename(f) for f in find_shards(pretrain, "val")] == ["pretrain_val_000000.bin"]
    assert not any("_val_" in os.path.basename(f) for f in find_shards(pretrain, "train"))
    one_pass = (3000 - 1) // 128 * 128  # whole 4 x 32 batches in the 3,000-token val shard: 2,944 tokens
    flags = [*TINY, "--max_steps", 2, "--eval_every", 2]
    proc = run("train_gpt2.py", *flags, "--data_dir", pretrain, "--out_dir", tmp_path / "a", "--val_tokens", 100 * 128,
               check=True)
    assert "is more than the val shards hold: each eval reads them once, 2,944 tokens" in proc.stdout
    run("train_gpt2.py", *flags, "--data_dir", corpus, "--out_dir", tmp_path / "b", "--val_tokens", one_pass, check=True)
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")
    assert val_losses(tmp_path / "a") == val_losses(tmp_path / "b")  # 100 batches would wrap: a different mean
    assert [r["val_tokens"] for r in read_log(tmp_path / "a") if "val_loss" in r] == [one_pass, one_pass]


def test_resume_takes_the_checkpoints_flags_and_new_ones_that_are_given(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--max_steps", 4, "--eval_every", 100, "--save_every", 2]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "straight", check=True)
    straight = train_losses(tmp_path / "straight")

    def resume(name, *given):
        (tmp_path / name).mkdir()
        os.link(tmp_path / "straight" / "ckpt_0000002.pt", tmp_path / name / "ckpt_0000002.pt")
        return run("train_gpt2.py", "--out_dir", tmp_path / name, "--resume", *given)

    alone = resume("alone")  # no other flag: the same run goes on (its data, model, max_steps 4, lr...)
    assert alone.returncode == 0, alone.stderr
    assert "flags changed" not in alone.stdout and train_losses(tmp_path / "alone") == {2: straight[2], 3: straight[3]}
    new_lr = resume("new_lr", "--lr", "1e-3", "--max_steps", 5)
    assert new_lr.returncode == 0, new_lr.stderr
    assert "resume: flags changed since the checkpoint: lr 0.003 -> 0.001, max_steps 4 -> 5" in new_lr.stdout
    log = {r["step"]: r for r in read_log(tmp_path / "new_lr") if "loss" in r}
    assert sorted(log) == [2, 3, 4] and log[3]["loss"] != straight[3]  # trained with the new lr
    from train_gpt2 import get_args, lr_multiplier
    args = get_args(["--lr", "1e-3", "--max_steps", "5", "--warmup_steps", "2",
                     "--out_dir", str(tmp_path / "new")])
    assert all(abs(log[s]["lr"] - 1e-3 * lr_multiplier(s, args)) < 1e-12 for s in log)
    for given, expect in ((["--n_embd", 64], "--n_embd 64: the checkpoint"), (["--optimizer", "muon"], "--optimizer muon")):
        proc = resume(f"bad{given[0]}", *given)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and expect in lines[0], proc.stderr
    # a folder of train_gpt2.py's run is not mid_train.py's to continue
    proc = run("mid_train.py", "--out_dir", tmp_path / "alone", "--resume", "--optimizer", "muon")
    assert proc.returncode == 2 and "holds a run of the other script" in proc.stderr, proc.stderr


def rank_pid(parent_pid, rank):
    """The pid of a torchrun worker of the given rank: a child of torchrun whose environment says RANK=rank."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == parent_pid and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def catches_sigterm(pid):
    with open(f"/proc/{pid}/status") as f:
        caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def test_sigterm_to_one_rank_during_val_eval_stops_both_at_once(shards, tmp_path):
    """SIGTERM reaches one rank only, during a long val eval (one pass over the 100k-token val shard): the ranks
    agree between eval batches and both stop at that step, with one checkpoint and no val loss for the cut eval."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    flags = [*TINY, "--data_dir", shards, "--out_dir", out, "--val_tokens", 99840, "--max_steps", 1000,
             "--eval_every", 1000]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             os.path.join(REPO, "train_gpt2.py"), *map(str, flags)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = []
        for line in proc.stdout:  # the start-up line comes right before the step-0 val eval
            output.append(line)
            if "parameters" in line:
                break
        pid = rank_pid(proc.pid, 1)
        assert wait_for(lambda: catches_sigterm(pid))  # rank 1 has its handler: it is at the eval too
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
        output = "".join(output) + proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert "stopped by signal at step 0" in output
    assert [os.path.basename(f) for f in glob.glob(str(out / "ckpt_*.pt"))] == ["ckpt_0000000.pt"]
    assert not [r for r in read_log(out) if "val_loss" in r or "loss" in r]


def test_mfu_peak_is_looked_up_by_the_exact_device_name():
    from train_gpt2 import PEAK_BF16_FLOPS
    peak_flops_of = PEAK_BF16_FLOPS.get  # by the name torch.cuda.get_device_name gives
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops_of("NVIDIA H200") == 989e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12 and peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA L40S") == 362e12 and peak_flops_of("NVIDIA L40") == 181e12
    assert peak_flops_of("NVIDIA L4") == 121e12 and peak_flops_of("NVIDIA A10G") == 70e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == peak_flops_of("NVIDIA A100 80GB PCIe") == 312e12
    assert peak_flops_of("NVIDIA H100") is None and peak_flops_of("NVIDIA GeForce RTX 4080") is None


def test_dtype_auto_is_bfloat16_on_cpus_with_bf16_units_and_float16_on_gpus_without(tmp_path, monkeypatch):
    import train_gpt2
    from train_gpt2 import autocast_dtype, cpu_has_bf16
    # the CPU's bf16 units as Linux lists them in /proc/cpuinfo: AVX512-BF16 (Zen 4, Cooper Lake) or AMX
    for flags, has_bf16 in (("avx512f avx512_bf16", True), ("amx_bf16 amx_tile", True), ("avx2 avx512f", False)):
        (tmp_path / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: fpu sse2 avx {flags} avx512_vnni\n\n")
        assert cpu_has_bf16(tmp_path / "cpuinfo") == has_bf16, flags
    assert not cpu_has_bf16(tmp_path / "missing")  # macOS and Windows have no /proc/cpuinfo: float32
    # this machine's own answer agrees with torch's, where torch has one (recent versions)
    if sys.platform == "linux" and hasattr(torch.cpu, "get_capabilities"):
        caps = torch.cpu.get_capabilities()
        assert cpu_has_bf16() == bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    for has_bf16, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(train_gpt2, "cpu_has_bf16", lambda: has_bf16)
        assert autocast_dtype("auto", "cpu") == expected
        assert autocast_dtype("float32", "cpu") == torch.float32 and autocast_dtype("bfloat16", "cpu") == torch.bfloat16
    # a V100 or T4 emulates bf16 slowly: torch says it has bf16 unless emulation is left out
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert autocast_dtype("auto", "cuda") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert autocast_dtype("auto", "cuda:0") == torch.bfloat16 and autocast_dtype("float32", "cuda") == torch.float32


def test_divergence_stops_at_once_and_keeps_the_good_checkpoints(shards, tmp_path):
    """--lr 1e6 on a good run: it stops at the first non-finite loss with one error line naming the newest good
    checkpoint; the checkpoint of the diverged weights is gone, and no good one was pruned for it."""
    out = tmp_path / "run"
    run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 6, "--save_every", 2, check=True)
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--resume", "--max_steps", 40,
               "--lr", 1e6, "--warmup_steps", 0)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run diverged at step "), err
    assert f"resume from {out / 'ckpt_0000006.pt'} with --resume and a lower --lr" in err[0]
    stopped = int(err[0].split("step ")[1].split()[0])
    assert stopped <= 6 + 2  # within two steps of the lr that diverged
    assert all(math.isfinite(loss) for loss in train_losses(out).values())  # no NaN step was trained on or logged
    assert sorted(os.listdir(out)) == [".lock", "ckpt_0000002.pt", "ckpt_0000004.pt", "ckpt_0000006.pt", "log.jsonl",
                                       "summary.json"]
    for name in ("ckpt_0000002.pt", "ckpt_0000004.pt", "ckpt_0000006.pt"):
        weights = torch.load(out / name, weights_only=True)["model"].values()
        assert all(torch.isfinite(w).all() for w in weights)


SOFTCAP = """        logits = self.lm_head(x)
        logits = 15 * torch.tanh(logits / 15)  # a logit softcap
"""


@pytest.mark.parametrize("edit", ["stock", "softcap"])
def test_training_loss_is_cross_entropy_of_the_logits(edit, monkeypatch):
    """The training loss is F.cross_entropy of the logits: an edit where the logits are made (here a softcap, applied
    to the model's source) reaches training. Given targets, the forward returns the loss alone (no logits output for
    a compiled graph to fill a gradient for); loss and gradients equal those of the logits of a forward without
    targets, ignored targets included, as the mean and as the sum that train_step takes."""
    import types
    import torch.nn.functional as F
    import train_gpt2
    source = inspect.getsource(train_gpt2)
    if edit == "softcap":
        source = source.replace("        logits = self.lm_head(x)\n", SOFTCAP, 1)
        assert "15 * torch.tanh" in source
    module = types.ModuleType(f"edited_{edit}")
    exec(compile(source, f"edited_{edit}", "exec"), module.__dict__)
    torch.manual_seed(0)
    model = module.GPT(module.GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32))
    x, y = torch.randint(0, 50257, (2, 64)), torch.randint(0, 50257, (2, 64))
    y[0, :10] = y[1, 30:] = -1  # ignored: a prompt, padding
    params = list(model.parameters())
    logits = model(x)
    if edit == "softcap":
        assert logits.abs().max() <= 15
    for reduction in ("mean", "sum"):
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-1, reduction=reduction)
        expected_grads = torch.autograd.grad(expected, params)
        loss = model(x, y, reduction=reduction)
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        grads = torch.autograd.grad(loss, params)
        assert loss.item() == expected.item()
        assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads))


def test_flops_count_one_expert_of_a_mixture_that_runs_one_per_token():
    """A mixture of experts in place of each block's MLP: a router and four experts, a token running through one.
    FLOPS_SHARE marks the experts' share that a token uses: FLOPs (and MFU) count one expert, not four."""
    from train_gpt2 import MLP, flops_per_token
    config = GPTConfig(block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    dense = flops_per_token(model, 64)
    for block in model.transformer.h:
        block.mlp = torch.nn.ModuleDict(dict(router=torch.nn.Linear(32, 4, bias=False),
                                             experts=torch.nn.ModuleList([MLP(config) for _ in range(4)])))
        block.mlp.experts.FLOPS_SHARE = 1 / 4  # top-1 of 4
    router = 6 * 32 * 4
    assert flops_per_token(model, 64) == dense + 2 * router
