"""
Does the demo base model write like its corpus? GPT-2's BPE spends a token on each space of indentation, so a
corpus of raw Python source is half whitespace-only tokens and a small model learns to emit blanks first. This
prints, for a checkpoint and its data folder:

- the share of whitespace-only tokens (spaces, tabs, newlines and nothing else) in the val and train shards;
- the same share in NUM_SAMPLES samples of SAMPLE_LEN tokens, drawn as `sample.py --ckpt CKPT` draws them
  (from <|endoftext|>, temperature 1, top-k 50), and the samples themselves;
- val loss per byte (nats per UTF-8 byte of the text predicted, <|endoftext|> counted as one byte): unlike loss
  per token, it compares models across tokenizations of a text (raw vs re-indented code), and roughly across corpora.

The quick start's target: the corpus at most 25% whitespace-only tokens, the samples at most
max(1.5 x the corpus's share, 15%).

    python bench/studies/demo_quality.py out/demo --data_dir data/demo
"""

import argparse
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import sample  # noqa: E402  (generate, as sample.py draws)
import train_gpt2 as tg  # noqa: E402


def token_tables(enc):
    """Per token id: whether it is whitespace only, and its length in bytes (<|endoftext|>: one byte)."""
    raw = [enc.decode_single_token_bytes(i) for i in range(tg.EOT_TOKEN)]
    blank = np.array([not b.strip() for b in raw] + [False])
    nbytes = np.array([len(b) for b in raw] + [1])
    return blank, nbytes


def shard_tokens(data_dir, split):
    shards = tg.find_shards(data_dir, split)
    if not shards:
        tg.die(f"no {split} shards in {data_dir}; give the folder prepare_fineweb.py --demo wrote (data/demo)")
    return np.concatenate([tg.load_shard(s) for s in shards])


@torch.no_grad()
def loss_per_byte(model, tokens, nbytes, max_tokens):
    """Mean val loss in nats per token and per byte, over windows of the model's context, as train_gpt2.py evals."""
    T = model.config.block_size
    n = min(max_tokens, (len(tokens) - 1) // T * T)
    if n < T:
        tg.die(f"the val shards hold {len(tokens):,} tokens, less than one window of {T + 1}; prepare more data")
    x = torch.from_numpy(tokens[:n].astype(np.int64)).view(-1, T)
    y = torch.from_numpy(tokens[1:n + 1].astype(np.int64)).view(-1, T)
    nats = 0.0
    for i in range(0, len(x), 8):
        logits = model(x[i:i + 8])
        nats += F.cross_entropy(logits.flatten(0, 1).float(), y[i:i + 8].flatten(), reduction="sum").item()
    return nats / n, nats / nbytes[y.numpy()].sum()


def main():
    # the usage text as written, defaults shown
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.error = lambda message: tg.die(message)
    p.add_argument("ckpt", help="a train_gpt2.py checkpoint (file or out_dir), e.g. out/demo")
    p.add_argument("--data_dir", default="data/demo", help="its token shards")
    p.add_argument("--num_samples", type=tg.positive_int, default=8, help="samples drawn")
    p.add_argument("--sample_len", type=tg.positive_int, default=100, help="new tokens per sample")
    p.add_argument("--prompt", help="prompt of the samples (default: <|endoftext|>, as sample.py starts)")
    p.add_argument("--val_tokens", type=tg.positive_int, default=32768, help="val tokens the loss is measured on")
    p.add_argument("--seed", type=tg.nonneg_int, default=0, help="seed of the samples")
    p.add_argument("--quiet", action="store_true", help="print the figures only, not the samples")
    args = p.parse_args()
    if not os.path.isdir(args.data_dir):
        tg.die(f"--data_dir {args.data_dir} is not a folder; run python prepare_fineweb.py --demo first")

    torch.set_grad_enabled(False)
    enc = tg.get_tokenizer()
    blank, nbytes = token_tables(enc)
    val, train = shard_tokens(args.data_dir, "val"), shard_tokens(args.data_dir, "train")
    corpus_share = blank[np.concatenate([val, train])].mean()
    print(f"corpus {args.data_dir}: whitespace-only tokens {corpus_share:.1%} (val {blank[val].mean():.1%}, "
          f"train {blank[train].mean():.1%}), {nbytes[val].sum() / len(val):.2f} bytes/token in val")

    checkpoint, path = tg.load_checkpoint(args.ckpt)
    model = tg.model_from_checkpoint(checkpoint).eval()
    step = checkpoint.get("step")
    del checkpoint
    per_token, per_byte = loss_per_byte(model, val, nbytes, args.val_tokens)
    print(f"{path} (step {step}): val loss {per_token:.3f} nats/token, {per_byte:.3f} nats/byte "
          f"({per_byte / math.log(2):.3f} bits/byte) on {min(args.val_tokens, len(val)):,} val tokens")

    prompt = enc.encode_ordinary(args.prompt) if args.prompt else [tg.EOT_TOKEN]
    idx = torch.tensor([prompt] * args.num_samples)
    generator = torch.Generator().manual_seed(args.seed)
    rows = torch.cat(list(sample.generate(model, idx, args.sample_len, enc.n_vocab, top_k=50, generator=generator)),
                     dim=1).numpy()
    sample_share = blank[rows].mean()
    if not args.quiet:
        for i, row in enumerate(rows):
            print(f"---- sample {i} ----\n{args.prompt or ''}{enc.decode(row.tolist())}")
    target = max(1.5 * corpus_share, 0.15)
    print(f"samples: whitespace-only tokens {sample_share:.1%} of {rows.size:,} "
          f"({args.num_samples} x {args.sample_len}, top-k 50)")
    print(f"target: corpus <= 25% ({'met' if corpus_share <= 0.25 else 'NOT met'}), samples <= {target:.1%} "
          f"({'met' if sample_share <= target else 'NOT met'})")


if __name__ == "__main__":
    main()
