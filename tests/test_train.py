import glob
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import REPO, TINY, read_log, run, torchrun, train_losses, val_losses
from train_gpt2 import GPT, MODEL_SIZES, GPTConfig, get_tokenizer


def test_gpt2_124m_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig(**MODEL_SIZES["gpt2"]))
    assert model.num_params() == 124_475_904


def test_logits_equal_transformers_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=128, vocab_size=50257)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    ours = GPT(GPTConfig(block_size=128, n_layer=2, n_head=4, n_embd=64)).eval()
    ours.load_hf_state_dict(hf.state_dict())
    idx = torch.randint(0, 50257, (2, 100))
    with torch.no_grad():
        expected = hf(idx).logits
        got, _ = ours(idx)
    assert (got[..., :50257] - expected).abs().max().item() < 1e-4


def test_tokenizer_is_gpt2_and_offline():
    enc = get_tokenizer()
    assert enc.n_vocab == 50257
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def test_single_batch_overfits():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.tensor(get_tokenizer().encode(open(os.path.join(REPO, "train_gpt2.py")).read()[:2000]))
    x, y = tokens[:64].view(2, 32), tokens[1:65].view(2, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2


def test_loss_falls_on_real_text(shards, tmp_path):
    out = tmp_path / "run"
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 40, "--eval_every", 20,
               "--num_samples", 1, "--sample_len", 8, check=True)
    val = val_losses(out)
    assert val[40] < val[0] - 2.0, val
    assert "---- sample 0 ----\nHello, I'm a language model," in proc.stdout  # text, not a repr
    losses = train_losses(out)
    assert np.mean([losses[s] for s in range(35, 40)]) < np.mean([losses[s] for s in range(5)]) - 2.0
    record = [r for r in read_log(out) if r["step"] == 39 and "loss" in r][0]
    assert {"lr", "grad_norm", "ms", "tok_per_s", "data_ms", "fwd_bwd_ms", "opt_ms"} <= record.keys()
    ckpt = torch.load(sorted(glob.glob(str(out / "ckpt_*.pt")))[-1], weights_only=True)
    assert ckpt["step"] == 40 and ckpt["val_loss"] == val[40] and ckpt["loader"]["pos"] > 0
    assert ckpt["args"]["max_steps"] == 40 and ckpt["config"]["n_embd"] == 32
    assert all(not k.startswith(("module.", "_orig_mod.")) for k in ckpt["model"])


def test_log_every_keeps_mean_loss_last_loss_and_tokens(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--max_steps", 7, "--eval_every", 100]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "every", check=True)
    sparse = run("train_gpt2.py", *flags, "--out_dir", tmp_path / "sparse", "--log_every", 3, check=True)
    per_step = {r["step"]: r for r in read_log(tmp_path / "every") if "loss" in r}
    logged = {r["step"]: r for r in read_log(tmp_path / "sparse") if "loss" in r}
    assert sorted(logged) == [0, 3, 6]
    for step in (3, 6):  # each line covers the steps since the last one: 1-3, 4-6
        steps = range(step - 2, step + 1)
        assert logged[step]["loss"] == pytest.approx(np.mean([per_step[s]["loss"] for s in steps]), rel=1e-6)
        assert logged[step]["grad_norm"] == pytest.approx(np.mean([per_step[s]["grad_norm"] for s in steps]), rel=1e-6)
        assert logged[step]["loss_last"] == pytest.approx(per_step[step]["loss"], rel=1e-6)
        assert logged[step]["tokens"] == (step + 1) * 256
    assert "step     3/7 | loss" in sparse.stdout and " | eta " in sparse.stdout


def test_resume_reproduces_uninterrupted_run(shards, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = [*TINY, "--data_dir", shards, "--max_steps", 12, "--eval_every", 6, "--save_every", 6]
    run("train_gpt2.py", *flags, "--out_dir", straight, check=True)
    os.makedirs(resumed)  # stop at step 6: continue from that checkpoint in a fresh process
    os.link(straight / "ckpt_0000006.pt", resumed / "ckpt_0000006.pt")
    proc = run("train_gpt2.py", *flags, "--out_dir", resumed, "--resume", check=True)
    assert "resuming from" in proc.stdout
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


def test_compile_with_eval_sampling_and_hellaswag(shards, tmp_path):
    hellaswag = tmp_path / "hellaswag.jsonl"
    write_hellaswag_fixture(hellaswag)
    out = tmp_path / "run"
    proc = run("train_gpt2.py", *TINY, "--data_dir", shards, "--out_dir", out, "--max_steps", 4, "--eval_every", 2,
               "--num_samples", 2, "--sample_len", 6, "--compile", "--hellaswag_file", hellaswag,
               "--hellaswag_every", 2, check=True)
    assert proc.stdout.count("---- sample 1 ----\n") == 2
    assert "compiling the model" in proc.stdout.split("step     0 |")[0]  # said before the first (slow) step
    log = read_log(out)
    assert [r["step"] for r in log if "val_loss" in r] == [0, 2, 4]
    assert [r["hellaswag_acc_norm"] for r in log if "hellaswag_acc_norm" in r][-1] >= 0
    assert "hellaswag acc" in proc.stdout


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
             "--wandb_project", "test", "--wandb_run_name", "tiny"]
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
    run("train_gpt2.py", *flags, "--max_steps", 8, "--resume", check=True)
    assert all(d.endswith(run_id) for d in glob.glob(str(out / "wandb" / "offline-run-*")))


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
    expect = {"missing_dir": "does not exist", "no_shards": "needs *train* and *val* shards", "bad_magic": "magic",
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


def test_dtype_auto_on_cpu_picks_the_faster_matmul_and_says_so(capsys):
    import re
    from train_gpt2 import autocast_dtype
    dtype = autocast_dtype("auto", "cpu", 64)
    line = capsys.readouterr().err
    bf16, fp32 = map(float, re.search(r"bf16 matmul ([\d.]+) TFLOP/s vs fp32 ([\d.]+)", line).groups())
    assert line.startswith(f"dtype auto: {str(dtype)[6:]} (")
    assert dtype in (torch.bfloat16, torch.float32)
    if bf16 != fp32:  # the figures are rounded to 3 decimals
        assert (dtype == torch.bfloat16) == (bf16 > fp32)
    assert autocast_dtype("float32", "cpu") == torch.float32 and capsys.readouterr().err == ""  # no probe
