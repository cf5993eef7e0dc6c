import os

import pytest
import torch

import mid_train
import train_gpt2
from conftest import TINY, read_log, run, torchrun, train_losses, val_losses
from train_gpt2 import GPT, GPTConfig, make_optimizers, zeropower_via_newtonschulz5


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
             "--eval_every", 5, "--save_every", 5, "--muon_momentum_warmup", 4, "--muon_weight_decay", "0.01"]
    run("train_gpt2.py", *flags, "--out_dir", tmp_path / "straight", check=True)
    straight = train_losses(tmp_path / "straight")
    assert val_losses(tmp_path / "straight")[10] < val_losses(tmp_path / "straight")[0] - 0.3
    # each optimizer's lr is in the record: Muon's warms up and decays as AdamW's does, from its own peak
    records = [r for r in read_log(tmp_path / "straight") if "loss" in r]
    assert all(abs(r["muon_lr"] / r["lr"] - 0.02 / 3e-3) < 1e-6 for r in records), records[0]
    ckpt = torch.load(tmp_path / "straight" / "ckpt_0000005.pt", weights_only=True)
    state = ckpt["optimizer"]["state"]  # both optimizers' state, keyed by parameter name
    assert "momentum_buffer" in state["transformer.h.0.mlp.c_fc.weight"] and "exp_avg" in state["transformer.wte.weight"]
    groups = ckpt["optimizer"]["param_groups"]  # AdamW's (decay, no decay), then Muon's, one a weight
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] + [0.01] * 8
    # each block's linear layers, by the rows of the matrices each stacks: the fused query, key and value (3 parts),
    # its projection, the MLP's two
    assert [g["parts"] for g in groups[2:]] == [[32, 32, 32], [32], [128], [32]] * 2

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "ckpt_0000005.pt").hardlink_to(tmp_path / "straight" / "ckpt_0000005.pt")
    run("train_gpt2.py", *flags, "--out_dir", resumed, "--resume", check=True)
    again = train_losses(resumed)
    assert sorted(again) == [5, 6, 7, 8, 9] and all(again[s] == straight[s] for s in again)

    torchrun("train_gpt2.py", *flags, "--out_dir", tmp_path / "ddp")
    ddp = train_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(10)) and all(abs(ddp[s] - straight[s]) < 1e-4 for s in ddp), (straight, ddp)


def tiny_model_and_optimizers(get_args, argv):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=64))
    # no run folder to continue: an out_dir that holds none
    return model, make_optimizers(model, get_args([*argv, "--out_dir", os.devnull]), "cpu")


def test_muon_orthogonalizes_q_k_v_as_three_blocks():
    model, (_, muon) = tiny_model_and_optimizers(train_gpt2.get_args, ["--optimizer", "muon"])
    C = 64
    attn, mlp = model.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].mlp.c_fc.weight
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    # Q's gradient 100x K's and V's, as after a step where queries mattered most; orthogonalizing the stacked
    # (3C x C) matrix would spend the whole update on Q and leave K and V almost where they were
    def spread(scale):  # a C x C gradient with singular values from 0.1 to 3 (times scale), as gradients have
        U, V = torch.linalg.qr(torch.randn(C, C))[0], torch.linalg.qr(torch.randn(C, C))[0]
        return scale * U @ torch.diag(torch.logspace(-1, 0.5, C)) @ V.T
    attn.grad = torch.cat([spread(100.0), spread(1.0), spread(1.0)])
    mlp.grad = torch.randn(4 * C, C)
    before = {"attn": attn.detach().clone(), "mlp": mlp.detach().clone()}
    muon.step()
    lr = muon.param_groups[0]["lr"]
    for name, block in zip("QKV", ((before["attn"] - attn.detach()) / lr).view(3, C, C)):
        s = torch.linalg.svdvals(block)
        assert 0.6 < s.min() and s.max() < 1.25, (name, s)  # each C x C block orthogonal, at scale 1 (square)
    s = torch.linalg.svdvals((before["mlp"] - mlp.detach()) / lr)
    assert 0.6 * 2 < s.min() and s.max() < 1.25 * 2, s  # c_fc (4C x C) stays one matrix, at scale sqrt(4C / C)


@pytest.mark.parametrize("script", [train_gpt2, mid_train])
def test_muon_weight_decay_is_its_own_flag(script):
    argv = ["--optimizer", "muon", "--weight_decay", "0.1", "--init_ckpt", "x"][: 4 if script is train_gpt2 else 6]
    _, (adamw, muon) = tiny_model_and_optimizers(script.get_args, argv)
    assert muon.param_groups[0]["weight_decay"] == 0.0  # by default Muon does not take AdamW's 0.1

    model, (adamw, muon) = tiny_model_and_optimizers(script.get_args, [*argv, "--muon_weight_decay", "0.01"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # a zero gradient orthogonalizes to a zero update: only the decay moves weights
    W = model.transformer.h[0].mlp.c_fc.weight
    wte = model.transformer.wte.weight
    W0, wte0 = W.detach().clone(), wte.detach().clone()
    for opt in (adamw, muon):
        opt.step()
    muon_lr, lr = muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"]
    torch.testing.assert_close(W.detach(), W0 * (1 - muon_lr * 0.01))
    torch.testing.assert_close(wte.detach(), wte0 * (1 - lr * 0.1))


def test_a_groups_own_learning_rate_survives_the_schedule():
    """A parameter group given its own lr (a fork's: the embedding at 10x) keeps that ratio through the schedule,
    which scales each group's own peak."""
    model, (adamw, muon) = tiny_model_and_optimizers(train_gpt2.get_args, ["--optimizer", "muon"])
    adamw.param_groups[0]["lr"] *= 10  # as built with lr=args.lr * 10
    args = train_gpt2.get_args(["--optimizer", "muon", "--warmup_steps", "10", "--out_dir", os.devnull])
    for step in range(4):
        train_gpt2.set_schedule([adamw, muon], train_gpt2.lr_multiplier(step, args), step, args)
    assert adamw.param_groups[0]["lr"] == pytest.approx(10 * args.lr * 0.4)
    assert adamw.param_groups[1]["lr"] == pytest.approx(args.lr * 0.4)
    assert muon.param_groups[0]["lr"] == pytest.approx(args.muon_lr * 0.4)
