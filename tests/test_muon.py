import torch

from conftest import TINY, run, torchrun, train_losses, val_losses
from train_gpt2 import zeropower_via_newtonschulz5


def test_newton_schulz_orthogonalizes():
    torch.manual_seed(0)
    for shape in [(64, 128), (128, 64), (96, 384)]:  # rectangular, as the MLP and attention weights are
        G = torch.randn(*shape) * torch.logspace(-1, 0.5, shape[1])  # unevenly scaled, as gradients are
        X = zeropower_via_newtonschulz5(G)
        s = torch.linalg.svdvals(X)
        s_in = torch.linalg.svdvals(G)
        assert s_in.max() / s_in.min() > 5
        assert 0.6 < s.min() and s.max() < 1.25  # quintic Newton-Schulz: singular values near 1, not exactly 1
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        cosine = (X * (U @ Vh)).sum() / (X.norm() * (U @ Vh).norm())
        assert cosine > 0.97  # and it points the way of the exact orthogonal factor U V^T


def test_muon_trains_resumes_exactly_and_ddp_matches(shards, tmp_path):
    flags = [*TINY, "--data_dir", shards, "--optimizer", "muon", "--muon_lr", "0.02", "--max_steps", 10,
             "--eval_every", 5, "--save_every", 5, "--muon_momentum_warmup", 4]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "straight", check=True)
    straight = train_losses(tmp_path / "straight")
    assert val_losses(tmp_path / "straight")[10] < val_losses(tmp_path / "straight")[0] - 0.3
    ckpt = torch.load(tmp_path / "straight" / "ckpt_0000005.pt", weights_only=True)
    state = ckpt["optimizer"]["state"]  # both optimizers' state, keyed by parameter name
    assert "momentum_buffer" in state["transformer.h.0.mlp.c_fc.weight"] and "exp_avg" in state["transformer.wte.weight"]

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "ckpt_0000005.pt").hardlink_to(tmp_path / "straight" / "ckpt_0000005.pt")
    run("train_gpt2.py", *flags, "--out_dir", resumed, "--resume", check=True)
    again = train_losses(resumed)
    assert sorted(again) == [5, 6, 7, 8, 9] and all(again[s] == straight[s] for s in again)

    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp")
    ddp = train_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(10)) and all(abs(ddp[s] - straight[s]) < 1e-4 for s in ddp), (straight, ddp)
