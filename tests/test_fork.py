"""docs/forking.md's worked examples, applied as a researcher would: every edit on that page, in a copy of the repo,
synced into the other scripts, then the fork trains, resumes exactly, samples and midtrains from its checkpoint."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, TINY, read_log, train_losses
from test_mid_train import MID, conversations, write_chat
from sync_shared import SCRIPTS

# an edit: the file, then the lines to find and the lines to put in their place, each in a python fence
EDIT = re.compile(r"<!-- edit: (\S+) -->\n```python\n(.*?)```\nwith\n```python\n(.*?)```", re.S)


def guide_edits():
    with open(os.path.join(REPO, "docs", "forking.md")) as f:
        return EDIT.findall(f.read())


def run_in(fork, script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=fork, env=env, capture_output=True,
                          text=True, timeout=600)


def make_fork(fork, edits):
    """The repo's scripts copied into the folder fork, the edits (script, lines to find, lines in their place)
    applied, and synced into the other scripts."""
    for script in SCRIPTS:
        shutil.copy(os.path.join(REPO, script), fork)
    os.makedirs(fork / "tools")
    for name in ("sync_shared.py", "shared_blocks.json"):
        shutil.copy(os.path.join(REPO, "tools", name), fork / "tools")
    for script, old, new in edits:
        with open(fork / script) as f:
            text = f.read()
        assert text.count(old) == 1, f"the guide's lines are not in {script} once:\n{old}"
        with open(fork / script, "w") as f:
            f.write(text.replace(old, new))
    proc = run_in(fork, "tools/sync_shared.py")
    assert proc.returncode == 0, proc
    return proc


@pytest.fixture(scope="module")
def fork(shards, tmp_path_factory):
    """A copy of the repo with every edit of the guide applied and synced, and the demo shards as .u32 files (the
    guide's new data format)."""
    fork = tmp_path_factory.mktemp("fork")
    edits = guide_edits()
    # RoPE (4), QK-norm, window (3), activation, softcap, training-only term, groups, metric, eval (3), task (2), data
    # format (2), sequence-length warm-up (3)
    assert len(edits) == 23, edits
    proc = make_fork(fork, edits)
    assert proc.returncode == 0 and "synced mid_train.py" in proc.stdout, proc
    sys.path.insert(0, REPO)
    from train_gpt2 import find_shards, load_shard
    os.makedirs(fork / "data")
    for path in find_shards(shards, "train")[:2] + find_shards(shards, "val"):
        name = os.path.basename(path).replace(".bin", ".u32")
        load_shard(path).astype(np.uint32).tofile(fork / "data" / name)
    return fork


def test_guide_edits_reach_every_copy(fork):
    for script in ("mid_train.py", "sample.py", "hellaswag.py", "export_hf.py"):
        with open(fork / script) as f:
            text = f.read()
        assert "def rotate(x, start):" in text and "30 * torch.tanh(logits / 30)" in text, script
        assert "wpe" not in text.split("# ---- shared: model ----")[1].split("# ---- end shared: model ----")[0]


def test_forked_model_trains_resumes_exactly_samples_and_midtrains(fork, base_ckpt):
    # the sequence-length warm-up's short rows up to step 3, so that the run continued from step 3 starts in them
    flags = [*TINY, "--data_dir", "data", "--max_steps", 6, "--save_every", 3, "--eval_every", 3,
             "--seq_warmup_steps", 4]
    proc = run_in(fork, "train_gpt2.py", *flags, "--out_dir", "straight")
    assert proc.returncode == 0, proc.stderr
    # the new eval: on the eval's line and in its records
    assert re.search(r"step +3/6 \| val_loss [\d.]+ \| val_bpb [\d.]+ \| val_acc [\d.]+ \|", proc.stdout), proc.stdout
    assert [r["step"] for r in read_log(fork / "straight") if 0 < r.get("val_acc", 0) < 1] == [0, 3, 6]
    # the added metrics before the loss, in the order the guide's edits add them (the penalty's first)
    assert re.search(r"step +5/6 \| penalty [\d.e-]+ \| max_logit [\d.]+ \| loss [\d.]+ \| grad_norm [\d.]+ \| lr ",
                     proc.stdout)
    records = [r for r in read_log(fork / "straight") if "loss" in r]
    assert len(records) == 6 and all(0 < r["max_logit"] <= 30 for r in records)  # the metric, under the softcap
    # the training-only term: logged as its own metric
    assert all(r["penalty"] > 0 for r in records) and re.search(r"\| penalty [\d.]+", proc.stdout)
    straight = train_losses(fork / "straight")
    assert straight[5] < straight[0]

    os.makedirs(fork / "resumed")
    shutil.copy(fork / "straight" / "ckpt_0000003.pt", fork / "resumed")
    proc = run_in(fork, "train_gpt2.py", *flags, "--out_dir", "resumed", "--resume")
    assert proc.returncode == 0, proc.stderr
    resumed = train_losses(fork / "resumed")
    assert sorted(resumed) == [3, 4, 5] and all(resumed[s] == straight[s] for s in resumed), (straight, resumed)
    # the warm-up's first step, in short rows, is not the full rows' step
    proc = run_in(fork, "train_gpt2.py", *flags[:-2], "--max_steps", 1, "--eval_every", 1, "--out_dir", "no_warmup")
    assert proc.returncode == 0 and train_losses(fork / "no_warmup")[0] != straight[0], proc.stderr

    # the embedding's group kept its 3x learning rate through the schedule
    import torch
    groups = torch.load(fork / "straight" / "ckpt_0000006.pt", weights_only=True)["optimizer"]["param_groups"]
    assert groups[2]["lr"] == pytest.approx(3 * groups[0]["lr"]) and groups[0]["lr"] > 0

    proc = run_in(fork, "sample.py", "--ckpt", "straight", "--num_samples", 1, "--max_new_tokens", 8, "--prompt", "def")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    # with the KV cache (the prompt, then a token at a time) the rotated model gives the logits it gives without
    check = ("import torch, sample as s; model = s.model_from_checkpoint(s.load_checkpoint('straight')[0]);"
             "idx = torch.randint(0, 50257, (1, 12)); full = model(idx); cache = s.KVCache();"
             "steps = [model(idx[:, :4], kv_cache=cache)[:, -1]] + [model(idx[:, i:i + 1], kv_cache=cache)[:, -1]"
             " for i in range(4, 12)]; print((torch.stack(steps, 1) - full[:, 3:]).abs().max().item())")
    proc = subprocess.run([sys.executable, "-c", check], cwd=fork, capture_output=True, text=True)
    assert proc.returncode == 0 and float(proc.stdout) < 1e-4, (proc.stdout, proc.stderr)

    # midtraining continues the forked model (its copy of the model block, synced)
    write_chat(fork / "chat.jsonl", conversations(40))
    proc = run_in(fork, "mid_train.py", *MID, "--init_ckpt", "straight", "--data", "chat:chat.jsonl",
                  "--max_steps", 2, "--out_dir", "mid")
    assert proc.returncode == 0 and "max_logit" in proc.stdout, proc.stderr
    assert [r["step"] for r in read_log(fork / "mid") if "val_acc" in r] == [0, 2]  # the new eval, midtraining too

    # a checkpoint of the model before the edit: one line naming a weight that differs
    proc = run_in(fork, "sample.py", "--ckpt", base_ckpt, "--max_new_tokens", 4)
    assert proc.returncode == 2 and proc.stderr.startswith("error: the checkpoint holds another model"), proc.stderr
    assert "wpe" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1

    # the model GPT-2's weights do not fit: one line naming the first weight that differs
    proc = run_in(fork, "export_hf.py", "--ckpt", "straight", "--out_dir", "hf")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "wpe" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    check = ("import sys; sys.argv = ['x']; import train_gpt2 as t; from transformers import GPT2Config, GPT2LMHeadModel;"
             "hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64));"
             "t.load_hf_state_dict(t.GPT(t.GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)), hf.state_dict())")
    proc = subprocess.run([sys.executable, "-c", check], cwd=fork, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: OpenAI's GPT-2 weights do not fit"), proc.stderr
    assert "transformer.wpe.weight" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


UNTIED_HEAD = ("train_gpt2.py",
               "        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings\n", "")
# each token attends to itself and the 19 before it
LOCAL_ATTENTION = ("train_gpt2.py",
                   "        y = F.scaled_dot_product_attention(q, k, v, is_causal=k.size(2) == T)\n",
                   "        past = k.size(2) - T\n"
                   "        window = torch.ones(T, k.size(2), dtype=torch.bool).tril(past).triu(past - 19)\n"
                   "        y = F.scaled_dot_product_attention(q, k, v, attn_mask=window)\n")


@pytest.mark.parametrize("edit", [UNTIED_HEAD, LOCAL_ATTENTION], ids=["untied-head", "local-attention"])
def test_export_carries_an_untied_head_and_names_the_part_it_cannot_carry(tmp_path, edit):
    """export_hf.py on a forked model: an untied head is exported as one (GPT-2's config can say so); attention
    over a window of 20 tokens, which GPT-2's cannot compute, is named, with the token it first differs at, though
    a short text would not show it."""
    make_fork(tmp_path, [edit])
    save = ("import torch, train_gpt2 as t; from dataclasses import asdict; torch.manual_seed(0);"
            "model = t.GPT(t.GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32));"
            "torch.save({'model': model.state_dict(), 'config': asdict(model.config), 'kind': 'base'}, 'ckpt.pt')")
    proc = subprocess.run([sys.executable, "-c", save], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = run_in(tmp_path, "export_hf.py", "--ckpt", "ckpt.pt", "--out_dir", "hf")
    if edit is UNTIED_HEAD:
        assert proc.returncode == 0 and "logits match ours" in proc.stdout, proc.stderr
        with open(tmp_path / "hf" / "config.json") as f:
            assert '"tie_word_embeddings": false' in f.read()
    else:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert "block 0's output differs from GPT-2's from token 20 on" in lines[0], lines[0]


def test_the_guides_attention_window_holds_when_sampling_with_the_kv_cache(tmp_path):
    """A mask edited into attention must cover sampling too, where the KV cache feeds one token at a time (T = 1,
    the keys before it cached) and the stock code runs unmasked. The guide's window, synced into sample.py: a
    token's logits do not depend on a token past the window, and the samples of a seed with the cache are those
    without it."""
    edits = [edit for edit in guide_edits() if "attn_window" in edit[2]]
    assert len(edits) == 3, edits  # the config field, kept in the attention, the mask
    make_fork(tmp_path, edits)
    check = ("import torch, sample as s; torch.manual_seed(0);"
             "model = s.GPT(s.GPTConfig(block_size=64, n_layer=1, n_head=2, n_embd=32, attn_window=8)).eval();"
             "logits = lambda idx: (lambda out: out[0] if isinstance(out, tuple) else out)(model(idx));"
             "idx = torch.randint(0, 50257, (1, 40)); other = idx.clone(); other[0, 20] += 1;"
             "print((logits(idx)[0, 28] - logits(other)[0, 28]).abs().max().item(),"
             "(logits(idx)[0, 27] - logits(other)[0, 27]).abs().max().item());"
             "runs = [torch.cat(list(s.generate(model, idx[:, :5], 50, 50257, generator=torch.Generator().manual_seed(1), use_cache=c)), 1)"
             " for c in (True, False)]; print(torch.equal(*runs), len(set(runs[0][0].tolist())))")
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (past_window, in_window), (same, distinct) = [line.split() for line in proc.stdout.split("\n")[:2]]
    assert float(past_window) == 0 and float(in_window) > 0  # token 20 is 8 before 28: outside; 7 before 27: in
    assert same == "True" and int(distinct) > 10


def test_the_guides_new_midtraining_task_trains_and_holds_out_its_val(base_ckpt, tmp_path):
    """The guide's ARC kind, declared in mid_train.py's table alone: --data arc:FILE reads its rows as ARC's,
    not as another kind's, trains on them and holds out its val."""
    edits = [edit for edit in guide_edits() if "arc_conversation" in edit[2]]
    assert len(edits) == 2, edits  # the function, the table's entry
    make_fork(tmp_path, edits)
    rows = [{"question": f"Which is warmer, {i}?", "choices": {"text": ["ice", "sun"], "label": ["A", "B"]},
             "answerKey": "B"} for i in range(40)]
    with open(tmp_path / "arc.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    proc = run_in(tmp_path, "mid_train.py", *MID, "--init_ckpt", base_ckpt, "--data", "arc:arc.jsonl",
                  "--max_steps", 2, "--out_dir", "mid")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "val: arc:arc.jsonl held out, 4 conversations" in proc.stdout, proc.stdout
    assert "train: arc:arc.jsonl, 36 conversations x1" in proc.stdout, proc.stdout


# a float field of GPTConfig, used by the model: a logit softcap whose cap is a flag
SOFTCAP_FIELD = [("train_gpt2.py", "    n_embd: int = 768\n",
                  "    n_embd: int = 768\n    softcap: float = 30.0\n"),
                 ("train_gpt2.py", "        logits = self.lm_head(x)\n",
                  "        logits = self.lm_head(x)\n"
                  "        logits = self.config.softcap * torch.tanh(logits / self.config.softcap)\n")]


def test_a_float_field_of_the_model_is_a_flag_that_takes_a_float(shards, tmp_path):
    make_fork(tmp_path, SOFTCAP_FIELD)
    proc = run_in(tmp_path, "train_gpt2.py", *TINY, "--data_dir", shards, "--max_steps", 1, "--eval_every", 100,
                  "--softcap", 15.5, "--out_dir", "run")
    assert proc.returncode == 0, proc.stderr
    import torch
    assert torch.load(tmp_path / "run" / "ckpt_0000001.pt", weights_only=True)["config"]["softcap"] == 15.5
    proc = run_in(tmp_path, "train_gpt2.py", "--softcap", "-1")  # a float field takes a number >= 0
    assert proc.returncode == 2 and "argument --softcap: '-1' is not a number >= 0" in proc.stderr, proc.stderr


# grouped-query attention: n_kv_head key/value heads, each shared by n_head / n_kv_head query heads; the fused input
# stacks the queries' n_embd rows and the keys' and values' fewer, and declares them to Muon
GROUPED_QUERY_ATTENTION = [
    ("train_gpt2.py", "    n_embd: int = 768\n", "    n_embd: int = 768\n    n_kv_head: int = 12\n"),
    ("train_gpt2.py",
     "        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key and value in one matmul\n"
     "        # c_attn stacks three matrices, query, key and value, and Muon orthogonalizes each apart.\n"
     "        # So we declare the rows of each.\n"
     "        self.c_attn.MUON_PARTS = [config.n_embd] * 3\n",
     "        self.kv_width = config.n_kv_head * (config.n_embd // config.n_head)\n"
     "        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * self.kv_width)\n"
     "        self.c_attn.MUON_PARTS = [config.n_embd, self.kv_width, self.kv_width]\n"
     "        self.n_kv_head = config.n_kv_head\n"),
    ("train_gpt2.py",
     "        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)\n"
     "        # each head is a batch dimension: (B, n_head, T, head_size)\n"
     "        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))\n",
     "        q, k, v = self.c_attn(x).split([self.n_embd, self.kv_width, self.kv_width], dim=2)\n"
     "        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)\n"
     "        k, v = (t.view(B, T, self.n_kv_head, C // self.n_head).transpose(1, 2) for t in (k, v))\n"),
    ("train_gpt2.py", "is_causal=k.size(2) == T)", "is_causal=k.size(2) == T, enable_gqa=True)"),
]

# Muon's update of the fused input (64 query rows, 16 key rows, 16 value rows) where the queries' gradient is 100x
# the others', as after a step where queries mattered most: each declared part's singular values; then the same
# layer declared as three equal parts, which its rows do not make
MUON_ON_GROUPED_QUERIES = """
import os, torch, train_gpt2 as t
torch.manual_seed(0)
model = t.GPT(t.GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=4, n_embd=64, n_kv_head=1))
args = t.get_args(['--optimizer', 'muon', '--out_dir', os.devnull])
adamw, muon = t.make_optimizers(model, args, 'cpu')
for p in model.parameters():
    p.grad = torch.zeros_like(p)
def spread(rows, scale):  # singular values from 0.1 to 3, times scale
    U, V = torch.linalg.qr(torch.randn(rows, rows))[0], torch.linalg.qr(torch.randn(64, rows))[0]
    return scale * U @ torch.diag(torch.logspace(-1, 0.5, rows)) @ V.T
attn = model.transformer.h[0].attn.c_attn
attn.weight.grad = torch.cat([spread(64, 100.0), spread(16, 1.0), spread(16, 1.0)])
before = attn.weight.detach().clone()
muon.step()
for part in ((before - attn.weight.detach()) / muon.param_groups[0]['lr']).split([64, 16, 16]):
    s = torch.linalg.svdvals(part)
    print(s.min().item(), s.max().item())
attn.MUON_PARTS = [64] * 3
t.make_optimizers(model, args, 'cpu')
"""


def test_muon_orthogonalizes_each_declared_part_of_grouped_query_attention(shards, tmp_path):
    make_fork(tmp_path, GROUPED_QUERY_ATTENTION)
    proc = run_in(tmp_path, "train_gpt2.py", *TINY, "--data_dir", shards, "--max_steps", 2, "--eval_every", 100,
                  "--n_kv_head", 1, "--optimizer", "muon", "--dry_run")
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-c", MUON_ON_GROUPED_QUERIES], cwd=tmp_path, capture_output=True,
                          text=True)
    # each part orthogonal on its own (singular values near 1), the keys' and values' too, which an update of the
    # stack as one matrix would leave near 0 beside the queries' 100x gradient
    lines = proc.stdout.split("\n")
    assert len(lines) == 4, (proc.stdout, proc.stderr)
    for line in lines[:3]:
        low, high = map(float, line.split())
        assert 0.6 < low and high < 1.25, proc.stdout
    # parts that do not add up to the weight's rows: one error line, at the start
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: --optimizer muon: the MUON_PARTS [64, 64, 64] of transformer.h.0.attn.c_attn "
                                  "add up to 192 rows, but its weight has 96"), proc.stderr
