"""
HellaSwag scoring speed: examples/s scored in padded batches vs one at a time, the same model and examples, and
the same counts (checked). Uses the scoring code that hellaswag.py and train_gpt2.py share.

    python bench/hellaswag_speed.py --data_file ../shared/data/hellaswag/hellaswag_val_subset1000.jsonl --limit 200
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2 as tg  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_file", required=True, help="HellaSwag .jsonl")
    p.add_argument("--limit", type=int, default=200, help="examples")
    p.add_argument("--preset", default="gpt2", choices=list(tg.MODEL_SIZES), help="model size (random weights)")
    p.add_argument("--ckpt", help="a checkpoint instead")
    p.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 16], help="examples per forward to compare")
    p.add_argument("--device", default="auto", help="auto, cuda, mps or cpu")
    p.add_argument("--dtype", default="float32", help="matmul dtype under autocast, as hellaswag.py's --dtype")
    p.add_argument("--cast_weights", action="store_true", help="cast the weights to --dtype, as hellaswag.py's flag")
    args = p.parse_args()
    device = tg.init_distributed(args.device)
    device_type = device.split(":")[0]
    torch.manual_seed(0)
    model = tg.model_from_checkpoint(tg.load_checkpoint(args.ckpt)[0]) if args.ckpt else \
        tg.GPT(tg.GPTConfig(**tg.MODEL_SIZES[args.preset]))
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


if __name__ == "__main__":
    main()
