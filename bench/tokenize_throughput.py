"""
prepare_fineweb.py's tokenization throughput (tokens/s) with 1 worker and with all cores, on the same input.

    python bench/tokenize_throughput.py --input '../shared/data/fineweb/fineweb_legal_pilot_batches/*.parquet'
    python bench/tokenize_throughput.py --demo          # the Python stdlib corpus of --demo
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", help="files or globs for prepare_fineweb.py --input")
    p.add_argument("--demo", action="store_true", help="use the --demo corpus (Python's standard library)")
    p.add_argument("--workers", nargs="+", type=int, default=[1, os.cpu_count()], help="worker counts to compare")
    args = p.parse_args()
    source = ["--demo"] if args.demo else ["--input", *args.input]
    print("| workers | documents | tokens | seconds | tokens/s | vs first |\n|---:|---:|---:|---:|---:|---:|")
    first = None
    for workers in args.workers:
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "prepare_fineweb.py", *source, "--out_dir", out, "--workers",
                                   str(workers), "--shard_size", "100000"], cwd=REPO, capture_output=True,
                                  text=True, check=True)
            seconds = time.perf_counter() - start  # the whole command, process start-up included
        docs, tokens = (int(x.replace(",", "")) for x in re.search(r"([\d,]+) documents, ([\d,]+) tokens", proc.stdout).groups())
        first = first or tokens / seconds
        print(f"| {workers} | {docs:,} | {tokens:,} | {seconds:.2f} | {tokens / seconds:,.0f} | {tokens / seconds / first:.2f}x |")


if __name__ == "__main__":
    main()
