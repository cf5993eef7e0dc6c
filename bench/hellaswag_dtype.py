"""
What casting the weights costs HellaSwag: the same examples scored in float32 (hellaswag.py's default), under bf16
autocast with float32 weights (--dtype bfloat16), and with the weights cast to bf16 (--dtype bfloat16
--cast_weights); acc, acc_norm, speed, and how many predictions differ from float32.

    python bench/hellaswag_dtype.py --ckpt out/demo --data_file hellaswag_val.jsonl --limit 1000
"""

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402


def predictions(model, rendered, device, n_vocab, batch_size, ctx):
    pred, pred_norm = [], []
    for i in range(0, len(rendered), batch_size):
        p, pn = tg.score_hellaswag(model, rendered[i: i + batch_size], device, n_vocab, ctx)
        pred, pred_norm = pred + p, pred_norm + pn
    return pred, pred_norm


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="a checkpoint (file or out_dir)")
    p.add_argument("--data_file", required=True, help="HellaSwag .jsonl")
    p.add_argument("--limit", type=int, default=1000, help="examples")
    p.add_argument("--batch_size", type=int, default=16, help="examples per forward")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    args = p.parse_args()
    device = tg.init_distributed(args.device)
    device_type = device.split(":")[0]
    model = tg.model_from_checkpoint(tg.load_checkpoint(args.ckpt)[0]).to(device).eval()
    enc = tg.get_tokenizer()
    examples = tg.load_hellaswag(args.data_file, args.limit)
    rendered = sorted((tg.render_hellaswag(ex, enc) for ex in examples), key=lambda r: max(map(len, r[0])))
    labels = [r[2] for r in rendered]
    n_vocab = min(enc.n_vocab, model.config.vocab_size)
    settings = [("float32 (default)", model, tg.nullcontext()),
                ("bf16 autocast, fp32 weights", model, tg.autocast_context(device_type, torch.bfloat16)),
                ("bf16 weights (--cast_weights)", copy.deepcopy(model).to(torch.bfloat16), tg.nullcontext())]
    print(f"{args.ckpt}, {len(examples)} examples of {args.data_file}, {device}\n"
          "| setting | acc | acc_norm | examples/s | acc preds != fp32 | acc_norm preds != fp32 |\n"
          "|---|---:|---:|---:|---:|---:|")
    reference = None
    for name, m, ctx in settings:
        start = time.perf_counter()
        pred, pred_norm = predictions(m, rendered, device, n_vocab, args.batch_size, ctx)
        speed = len(rendered) / (time.perf_counter() - start)
        reference = reference or (pred, pred_norm)
        acc = sum(p == y for p, y in zip(pred, labels)) / len(labels)
        acc_norm = sum(p == y for p, y in zip(pred_norm, labels)) / len(labels)
        differ = sum(a != b for a, b in zip(pred, reference[0]))
        differ_norm = sum(a != b for a, b in zip(pred_norm, reference[1]))
        print(f"| {name} | {acc:.4f} | {acc_norm:.4f} | {speed:.1f} | {differ} | {differ_norm} |", flush=True)


if __name__ == "__main__":
    main()
