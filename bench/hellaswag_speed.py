"""
HellaSwag's scoring speed, with the scoring code that hellaswag.py and train_gpt2.py share.

Default: examples/s scored in padded batches against one at a time, the same model and examples, and the same
counts (checked). --precisions: instead, what the precision costs and buys on a checkpoint: the same examples
scored in float32 (hellaswag.py's default), under bf16 autocast with float32 weights (--dtype bfloat16), and with
the weights cast to bf16 (--dtype bfloat16 --cast_weights); acc, acc_norm, examples/s, and how many predictions
differ from float32's.

    python bench/hellaswag_speed.py --data_file ../shared/data/hellaswag/hellaswag_val_subset1000.jsonl --limit 200
    python bench/hellaswag_speed.py --precisions --ckpt out/demo --data_file hellaswag_val.jsonl --limit 1000
"""

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402


def batch_sizes(args, model, device, device_type):
    """Examples/s at each batch size."""
    dtype = tg.autocast_dtype(args.dtype, device_type)
    model.to(device=device, dtype=dtype if args.cast_weights else torch.float32).eval()  # as hellaswag.py
    ctx = tg.nullcontext() if args.cast_weights else tg.autocast_context(device_type, dtype)
    examples, enc = tg.load_hellaswag(args.data_file, args.limit), tg.get_tokenizer()
    print("| model | device | examples | batch | examples/s | vs first | acc_norm |\n|---|---|---:|---:|---:|---:|---:|")
    first, counts = None, set()
    for batch_size in args.batch_sizes:
        tg.evaluate_hellaswag(model, examples[:batch_size], enc, device, batch_size, autocast_ctx=ctx)  # warm-up
        start = time.perf_counter()
        acc, acc_norm, count = tg.evaluate_hellaswag(model, examples, enc, device, batch_size, autocast_ctx=ctx)
        speed = count / (time.perf_counter() - start)
        first = first or speed
        counts.add((acc, acc_norm))
        print(f"| {args.ckpt or args.preset} | {device} | {count} | {batch_size} | {speed:.2f} | {speed / first:.2f}x | "
              f"{acc_norm:.4f} |", flush=True)
    print(f"the same counts at every batch size: {len(counts) == 1}")


def predictions(model, rendered, device, n_vocab, batch_size, ctx):
    pred, pred_norm = [], []
    for i in range(0, len(rendered), batch_size):
        p, pn = tg.score_hellaswag(model, rendered[i: i + batch_size], device, n_vocab, ctx)
        pred, pred_norm = pred + p, pred_norm + pn
    return pred, pred_norm


def precisions(args, model, device, device_type):
    """The three precisions on the same examples: accuracy, speed, predictions that differ from float32's."""
    model = model.to(device).eval()
    enc = tg.get_tokenizer()
    examples = tg.load_hellaswag(args.data_file, args.limit)
    rendered = sorted((tg.render_hellaswag(ex, enc) for ex in examples), key=lambda r: max(map(len, r[0])))
    labels = [r[2] for r in rendered]
    n_vocab = min(enc.n_vocab, model.config.vocab_size)
    batch_size = args.batch_sizes[-1]
    settings = [("float32 (default)", model, tg.nullcontext()),
                ("bf16 autocast, fp32 weights", model, tg.autocast_context(device_type, torch.bfloat16)),
                ("bf16 weights (--cast_weights)", copy.deepcopy(model).to(torch.bfloat16), tg.nullcontext())]
    print(f"{args.ckpt or args.preset}, {len(examples)} examples of {args.data_file}, {device}, batch {batch_size}\n"
          "| setting | acc | acc_norm | examples/s | acc preds != fp32 | acc_norm preds != fp32 |\n"
          "|---|---:|---:|---:|---:|---:|")
    reference = None
    for name, m, ctx in settings:
        start = time.perf_counter()
        pred, pred_norm = predictions(m, rendered, device, n_vocab, batch_size, ctx)
        speed = len(rendered) / (time.perf_counter() - start)
        reference = reference or (pred, pred_norm)
        acc = sum(p == y for p, y in zip(pred, labels)) / len(labels)
        acc_norm = sum(p == y for p, y in zip(pred_norm, labels)) / len(labels)
        differ = sum(a != b for a, b in zip(pred, reference[0]))
        differ_norm = sum(a != b for a, b in zip(pred_norm, reference[1]))
        print(f"| {name} | {acc:.4f} | {acc_norm:.4f} | {speed:.1f} | {differ} | {differ_norm} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_file", required=True, help="HellaSwag .jsonl")
    p.add_argument("--limit", type=int, default=200, help="examples")
    p.add_argument("--preset", default="gpt2", choices=list(tg.MODEL_SIZES), help="model size (random weights)")
    p.add_argument("--ckpt", help="a checkpoint (file or out_dir) instead")
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 16],
                   help="examples per forward to compare (--precisions: the last)")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", help="matmul dtype under autocast, as hellaswag.py's --dtype")
    p.add_argument("--cast_weights", action="store_true", help="cast the weights to --dtype, as hellaswag.py's flag")
    p.add_argument("--precisions", action="store_true", help="compare the three precisions instead (see above)")
    args = p.parse_args()
    device = tg.init_distributed(args.device)
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    model = tg.model_from_checkpoint(tg.load_checkpoint(args.ckpt)[0]) if args.ckpt else \
        tg.GPT(tg.GPTConfig(**tg.MODEL_SIZES[args.preset]))
    (precisions if args.precisions else batch_sizes)(args, model, device, device_type)


if __name__ == "__main__":
    main()
