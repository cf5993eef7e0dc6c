#!/usr/bin/env bash
# The GPU checks and the GPU benchmark in one command, on a machine with a CUDA GPU (no internet needed):
#
#   bash bench/gpu.sh [--peer ../shared/peers/build-nanogpt/train_gpt2.py] [more bench/gpu_vs_peer.py flags]
#   bash bench/gpu.sh --dry_run        # anywhere: test_cuda.py skips without CUDA, the bench runs a tiny model
#
# 1. tests/test_cuda.py: bf16 + compile tracks fp32 eager, fused AdamW, KV cache = no cache in bf16, sampling and
#    HellaSwag in the loop under compile, a GPU checkpoint used with CUDA hidden, peak memory (printed).
# 2. bench/gpu_vs_peer.py: GPT-2 124M, seq 1024, bf16 + compile at micro-batches 16/32/64 (tok/s, MFU, peak
#    memory), then build-nanogpt's train_gpt2.py as shipped with the same config, and the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -q -s -rs tests/test_cuda.py
python bench/gpu_vs_peer.py "$@"
