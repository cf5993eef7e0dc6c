"""
Does a checkpoint read its context? Feed it random token sequences, each twice in a row. A model that can copy from
its context (induction heads, Olsson et al. 2022) predicts the second pass far better than the first; one that
cannot scores both passes alike (often above a uniform guess, ln 50257 = 10.8 nats: random tokens are unlike any
training text). Answering from a pasted
text, restating a question's words, or recalling a fact about a name asked about all need the model to look back.
--teach_steps N first trains each model on nothing but that copying (AdamW, bf16 autocast), to see whether it can
pick the skill up at all.

    python bench/studies/context_probe.py out/demo out/mid
    python bench/studies/context_probe.py out/demo --teach_steps 150
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import train_gpt2 as tg  # noqa: E402

TEACH_IDS = (300, 20000)  # token ids of the copying lessons: common enough to have trained embeddings


def teach(model, args):
    """Train on copying alone: 8 fresh random sequences a step (ids in TEACH_IDS), each fed twice, with the loss on
    the repeat only (the first pass cannot be predicted, so it teaches nothing about copying)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)  # other sequences than the probe's
    model.train()
    for step in range(args.teach_steps):
        seq = torch.randint(*TEACH_IDS, (8, args.length), generator=generator)
        idx = torch.cat([seq, seq], dim=1)
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(idx)
        loss = F.cross_entropy(logits[:, args.length:-1].flatten(0, 1).float(), idx[:, args.length + 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 25 == 0 or step == args.teach_steps - 1:
            print(f"teach step {step}: loss on the repeat {loss.item():.2f} "
                  f"(uniform over the ids drawn: {math.log(TEACH_IDS[1] - TEACH_IDS[0]):.2f})")
    model.eval()


def main():
    # the usage text as written, defaults shown
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("ckpts", nargs="+", help="checkpoints of train_gpt2.py or mid_train.py (files or out_dirs)")
    p.error = lambda message: tg.die(message)
    p.add_argument("--length", type=tg.ranged(int, 2), default=64, help="tokens in each random sequence (fed twice)")
    p.add_argument("--batch", type=tg.positive_int, default=16, help="random sequences")
    p.add_argument("--seed", type=tg.nonneg_int, default=0, help="which random sequences")
    p.add_argument("--teach_steps", type=tg.nonneg_int, default=0, help="AdamW steps on copying before the probe")
    p.add_argument("--lr", type=tg.positive_float, default=3e-3, help="learning rate of --teach_steps")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    first = torch.randint(0, tg.EOT_TOKEN, (args.batch, args.length))
    idx = torch.cat([first, first], dim=1)
    print(f"{args.batch} random sequences of {args.length} tokens, each fed twice; mean loss in nats "
          f"(uniform guess {torch.log(torch.tensor(float(tg.EOT_TOKEN + 1))):.2f})")
    for ckpt in args.ckpts:
        checkpoint, path = tg.load_checkpoint(ckpt)
        model = tg.model_from_checkpoint(checkpoint).eval()
        step = checkpoint.get("step")
        del checkpoint
        if 2 * args.length > model.config.block_size:
            tg.die(f"--length {args.length}: twice that must fit the model's context of {model.config.block_size}")
        if args.teach_steps:
            teach(model, args)
        with torch.no_grad():
            logits = model(idx)
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten(), reduction="none")
        losses = losses.view(args.batch, -1)
        first_pass = losses[:, : args.length - 1].mean().item()  # tokens 1..L-1: nothing to copy from yet
        second_pass = losses[:, args.length:].mean().item()  # tokens L+1..2L-1: each seen L tokens earlier
        print(f"{path} (step {step}): first pass {first_pass:.2f}, second pass {second_pass:.2f}, "
              f"gain from the context {first_pass - second_pass:+.2f}")


if __name__ == "__main__":
    main()
