"""The CUDA path, on any machine with a GPU (skipped elsewhere); one command, -s to see the figures:

    python -m pytest -q -s tests/test_cuda.py

bf16 autocast + torch.compile against fp32 eager (within TOLERANCE), fused AdamW, the KV cache in bf16, sampling and HellaSwag in the
loop under compile, a GPU checkpoint used on a CPU-only machine, and the peak memory, logged."""

import os
import shutil

import numpy as np
import pytest
import torch

from conftest import read_log, run, train_losses, val_losses
from test_train import write_hellaswag_fixture

# a faked GPU (bench/gpu.sh --dry_run) runs these sizes at CPU speed: tests/test_cuda_rehearsal.py rehearses the path
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("FAKE_CUDA") == "1",
                                reason="needs a CUDA GPU")

# a small GPT, big enough that bf16 rounding shows if something is wrong with it
SMALL = ["--n_layer", "4", "--n_head", "4", "--n_embd", "256", "--block_size", "256", "--seq_len", "256",
         "--micro_batch_size", "16", "--total_batch_size", "4096", "--warmup_steps", "30", "--lr", "1e-3",
         "--val_tokens", "16384"]
STEPS = 300
TOLERANCE = 0.1  # nats: bf16 + compile may differ from fp32 eager by this much in val loss and mean train loss


@pytest.fixture(scope="module")
def gpu_runs(shards, tmp_path_factory):
    """The same 300 steps twice: bf16 + compile (with samples and HellaSwag in the loop), and fp32 eager."""
    root = tmp_path_factory.mktemp("cuda")
    hellaswag = root / "hellaswag.jsonl"
    write_hellaswag_fixture(hellaswag)
    common = [*SMALL, "--device", "cuda", "--data_dir", shards, "--max_steps", STEPS, "--eval_every", 100, "--save_every", STEPS]
    fast = run("train_gpt2.py", *common, "--out_dir", root / "bf16", "--dtype", "bfloat16", "--compile", "on",
               "--num_samples", 2, "--sample_len", 16, "--hellaswag_file", hellaswag, check=True)
    run("train_gpt2.py", *common, "--out_dir", root / "fp32", "--dtype", "float32", "--compile", "off",
        "--num_samples", 0, check=True)
    return root, fast.stdout, hellaswag


def test_bf16_compile_tracks_fp32_eager(gpu_runs):
    root, _, _ = gpu_runs
    val_bf16, val_fp32 = val_losses(root / "bf16"), val_losses(root / "fp32")
    print(f"\nval loss bf16+compile {val_bf16} | fp32 eager {val_fp32}")
    assert val_fp32[STEPS] < val_fp32[0] - 2.0  # it learned
    for step in val_fp32:
        assert abs(val_bf16[step] - val_fp32[step]) < TOLERANCE, (step, val_bf16, val_fp32)
    bf16, fp32 = train_losses(root / "bf16"), train_losses(root / "fp32")
    for start in range(0, STEPS, 50):  # mean train loss over windows of 50 steps
        window = range(start, start + 50)
        assert abs(np.mean([bf16[s] for s in window]) - np.mean([fp32[s] for s in window])) < TOLERANCE, start


def test_peak_memory_is_logged(gpu_runs):
    root, _, _ = gpu_runs
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    for name in ("bf16", "fp32"):
        records = [r for r in read_log(root / name) if "peak_mem_gib" in r]
        peak = max(r["peak_mem_gib"] for r in records)
        median_tok_s = sorted(r["tok_per_s"] for r in records)[len(records) // 2]
        print(f"\n{name}: peak memory {peak:.3f} GiB of {total_gib:.1f}, median {median_tok_s:,.0f} tok/s "
              f"({torch.cuda.get_device_name(0)})")
        assert 0 < peak < total_gib


def test_sampling_and_hellaswag_run_in_the_loop_under_compile(gpu_runs):
    root, stdout, _ = gpu_runs
    assert stdout.count("---- sample 1 ----\n") == STEPS // 100  # after steps 100, 200, 300
    accs = [r["hellaswag_acc_norm"] for r in read_log(root / "bf16") if "hellaswag_acc_norm" in r]
    assert len(accs) == STEPS // 100 + 1 and all(0 <= a <= 1 for a in accs)


def test_fused_adamw_on_cuda():
    from train_gpt2 import GPT, GPTConfig, get_args, setup_training
    args = get_args(["--device", "cuda", "--dtype", "bfloat16", "--compile", "off", "--out_dir", os.devnull])
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)).to("cuda")
    _, optimizers, _, _ = setup_training(model, args, torch.bfloat16, "cuda")
    assert optimizers[0].defaults["fused"] is True


def test_kv_cache_greedy_equals_no_cache_in_bf16(gpu_runs):
    """The first N greedy tokens agree; should they part earlier, it must be at a near-tie of the two likeliest
    logits (within 0.1), which bf16 rounding may decide either way."""
    from sample import autocast_context, generate, get_tokenizer, load_checkpoint, model_from_checkpoint
    root, _, _ = gpu_runs
    N = 24
    model = model_from_checkpoint(load_checkpoint(str(root / "bf16"))[0]).to("cuda").eval()
    enc = get_tokenizer()
    ctx = autocast_context("cuda", torch.bfloat16)
    for prompt in ("import os\n", "def main(", "class Parser:\n    def "):
        idx = torch.tensor([enc.encode(prompt)], device="cuda")
        with_cache, without = (torch.cat(list(generate(model, idx, N, enc.n_vocab, temperature=0, use_cache=c,
                                                       autocast_ctx=ctx)), dim=1)[0].tolist() for c in (True, False))
        parted = next((i for i, (a, b) in enumerate(zip(with_cache, without)) if a != b), N)
        if parted < N:
            with torch.no_grad(), ctx:
                logits = model(torch.cat([idx, torch.tensor([without[:parted]], device="cuda")], dim=1))
            top2 = logits[0, -1, :enc.n_vocab].float().topk(2).values
            print(f"\n{prompt!r}: cache and no cache part at token {parted}, top-2 logit gap {top2[0] - top2[1]:.4f}")
            assert top2[0] - top2[1] < 0.1, (prompt, parted, enc.decode(with_cache), enc.decode(without))


def test_gpu_checkpoint_is_used_on_a_cpu_only_machine(gpu_runs, shards, tmp_path):
    """With CUDA hidden: sample.py and hellaswag.py load the GPU run's checkpoint, and training resumes from it."""
    root, _, hellaswag = gpu_runs
    cpu_only = {"CUDA_VISIBLE_DEVICES": ""}
    ckpt = str(root / "bf16" / f"ckpt_{STEPS:07d}.pt")
    proc = run("sample.py", "--ckpt", ckpt, "--device", "cpu", "--prompt", "import ", "--max_new_tokens", 8,
               env=cpu_only, check=True)
    assert proc.stdout.strip()
    run("hellaswag.py", "--ckpt", ckpt, "--data_file", hellaswag, "--device", "cpu", env=cpu_only, check=True)
    out = tmp_path / "resumed"
    os.makedirs(out)
    shutil.copy(ckpt, out)
    run("train_gpt2.py", *SMALL, "--device", "cpu", "--data_dir", shards, "--out_dir", out, "--resume",
        "--max_steps", STEPS + 2, "--eval_every", 1000, "--dtype", "float32", "--compile", "off", "--num_samples", 0,
        env=cpu_only, check=True)
    assert sorted(train_losses(out)) == [STEPS, STEPS + 1]
