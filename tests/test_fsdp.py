import re

import torch

from conftest import TINY, run, torchrun, train_losses, val_losses


def mib_per_rank(stdout):
    return float(re.search(r"([\d.]+) MiB of them per rank", stdout).group(1))


def test_fsdp_matches_ddp_resumes_exactly_and_loads_everywhere(shards, tmp_path):
    # wider than TINY so that the blocks, not the embedding, hold most weights
    flags = [*TINY, "--n_embd", 64, "--n_layer", 4, "--data_dir", shards, "--max_steps", 8, "--eval_every", 4,
             "--save_every", 4, "--total_batch_size", 512]
    ddp = torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp")
    fsdp = torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "fsdp", "--fsdp")
    a, b = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "fsdp")
    assert sorted(b) == list(range(8)) and all(abs(a[s] - b[s]) < 1e-4 for s in a), (a, b)
    assert abs(val_losses(tmp_path / "ddp")[8] - val_losses(tmp_path / "fsdp")[8]) < 1e-4
    ratio = mib_per_rank(fsdp.stdout) / mib_per_rank(ddp.stdout)
    assert 0.45 < ratio < 0.55, ratio  # each of 2 ranks holds about half the weights

    # the FSDP checkpoint is a full one: FSDP resumes it exactly, and DDP, sample.py and mid_train.py load it
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "ckpt_0000004.pt").hardlink_to(tmp_path / "fsdp" / "ckpt_0000004.pt")
    torchrun("train_gpt2.py", *flags, "--out_dir", resumed, "--fsdp", "--resume")
    again = train_losses(resumed)
    assert sorted(again) == [4, 5, 6, 7] and all(again[s] == b[s] for s in again), (again, b)
    ddp_resumed = tmp_path / "ddp_resumed"
    ddp_resumed.mkdir()
    (ddp_resumed / "ckpt_0000004.pt").hardlink_to(tmp_path / "fsdp" / "ckpt_0000004.pt")
    torchrun("train_gpt2.py", *flags, "--out_dir", ddp_resumed, "--resume")
    assert all(abs(train_losses(ddp_resumed)[s] - b[s]) < 1e-4 for s in again)
    ckpt = torch.load(tmp_path / "fsdp" / "ckpt_0000008.pt", weights_only=True)
    assert ckpt["model"]["transformer.h.0.attn.c_attn.weight"].shape == (192, 64)
    proc = run("sample.py", "--ckpt", tmp_path / "fsdp", "--prompt", "import", "--max_new_tokens", 5, check=True)
    assert proc.stdout.startswith("import")


def test_fsdp_losses_are_float32_in_a_bfloat16_policy(shards, tmp_path):
    """FSDP with a bfloat16 policy computes its losses in float32, as DDP's autocast does: its train and
    val losses agree with DDP's in bfloat16 far closer than bfloat16's own step near 10 nats (0.0625)."""
    flags = [*TINY, "--n_embd", 64, "--data_dir", shards, "--max_steps", 3, "--eval_every", 3, "--save_every", 100,
             "--total_batch_size", 512, "--dtype", "bfloat16"]
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp")
    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "fsdp", "--fsdp")
    a, b = train_losses(tmp_path / "ddp"), train_losses(tmp_path / "fsdp")
    assert sorted(b) == [0, 1, 2] and all(abs(a[s] - b[s]) < 0.01 for s in a), (a, b)
    val_a, val_b = val_losses(tmp_path / "ddp"), val_losses(tmp_path / "fsdp")
    assert all(abs(val_a[s] - val_b[s]) < 0.01 for s in (0, 3)), (val_a, val_b)
