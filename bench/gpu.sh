#!/usr/bin/env bash
# The checks that need a GPU, run offline from the folder that bench/gpu_bundle.sh fills (a wheel, data, and
# build-nanogpt's scripts), on a machine with a CUDA GPU and torch. Each part takes as long as the card needs;
# --time_limit caps the whole. Each part writes its log to $OUT/PART.log as it goes (out/gpu/results where OUT is
# unset), so that a run cut short still leaves what ran.
#
#   bash bench/gpu.sh --part correctness  # tests/test_cuda.py; torchrun --nproc_per_node=1 (NCCL's start-up); a
#                                         # resumed run against an uninterrupted one; the GPU checkpoint used with
#                                         # CUDA hidden; HellaSwag on the GPU
#   bash bench/gpu.sh --part speed        # GPT-2 124M against build-nanogpt at micro-batches 64, 32 and 16
#                                         # (bench/vs_build_nanogpt.py --speed); the candidate speed-ups against the
#                                         # baseline, each profiled (bench/train_speed.py --profile)
#   bash bench/gpu.sh --part muon         # quality per token: bench/studies/muon_vs_adamw.py, GPT-2 124M, 3 AdamW
#                                         # lrs and Muon, 400 steps x 32,768 tokens each
#   bash bench/gpu.sh --part memory       # the largest micro-batch that trains in 24 GiB (bench/train_speed.py
#                                         # --fit_gib 24), checked by train_gpt2.py itself
#   bash bench/gpu.sh --part mid          # a small base model, then a short mid_train.py run on the bundle's chat,
#                                         # GSM8K and MMLU files
#   bash bench/gpu.sh --dry_run           # anywhere (a CPU): every part with tiny models and few steps, on a GPU
#                                         # faked by tests/fake_cuda, so that the scripts take their CUDA path
#
# Options: --bundle DIR (default .gpu_bundle); --part PART (default: all five in the order above; give it again for
# more than one); --time_limit SECONDS (each step capped to what is left; steps with no time left are not run);
# --dry_run. A step that fails is marked FAIL and the part goes on; the exit status is 1 if any step failed or
# was not run.
set -uo pipefail
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0; }
[[ ${1:-} == -h || ${1:-} == --help ]] && usage
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 2; }
all_parts="correctness speed muon memory mid"
bundle=.gpu_bundle parts= dry= time_limit=
while (($#)); do
    case $1 in
        --bundle | --part | --time_limit)
            (($# >= 2)) || die "$1 needs a value"
            case $1 in
                --bundle) bundle=${2%/} ;;
                --part) [[ " $all_parts " == *" $2 "* ]] || die "--part $2: give one of: $all_parts"
                        parts+="${parts:+ }$2" ;;
                --time_limit) [[ $2 =~ ^[1-9][0-9]*$ ]] || die "--time_limit $2: give a whole number of seconds"
                              time_limit=$2 ;;
            esac
            shift 2 ;;
        --dry_run) dry=1; shift ;;
        *) die "unknown argument '$1'; usage: bash bench/gpu.sh [--bundle DIR] [--part PART] [--time_limit SECONDS]" \
               "[--dry_run]" ;;
    esac
done
parts=${parts:-$all_parts}
compgen -G "$bundle/wheels/*.whl" >/dev/null || die "no wheels in $bundle/wheels: run bash bench/gpu_bundle.sh $bundle first"

# The packages the GPU machine may lack, from the bundle: no index (it may have no internet), no deps (the bundle
# holds each one needed), into a folder on PYTHONPATH (its Python environment is left as it is)
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$bundle"/wheels/*.whl \
    || die "installing $bundle/wheels/*.whl failed"
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [[ $dry ]]; then  # two H100s faked on this CPU: each script runs with its default devices, as on the GPU machine
    export PYTHONPATH=$PWD/tests/fake_cuda:$PYTHONPATH FAKE_CUDA=1
fi
results=${OUT:-out/gpu/results}
mkdir -p "$results"
echo "python3 $(python3 -c 'import sys, torch; print(sys.version.split()[0], "| torch", torch.__version__, "| CUDA:",
    torch.cuda.get_device_name() if torch.cuda.is_available() else "none")')${dry:+ (faked)} | bundle $bundle" \
    "| results in $results"

shards=data/gpu-fineweb${dry:+-dry} shard_size=500000 hellaswag=$bundle/hellaswag/hellaswag_val_subset1000.jsonl
if [[ $dry ]]; then  # tests/conftest.py's tiny GPT in float32, so that a resumed run repeats bit for bit; small
    # shards, as a test's bundle holds little text
    shard_size=20000
    small=(--n_layer 2 --n_head 2 --n_embd 32 --block_size 64 --seq_len 32 --micro_batch_size 4
           --total_batch_size 256 --val_tokens 512 --dtype float32 --compile off)
else  # tests/test_cuda.py's small GPT, as a GPU trains it
    small=(--n_layer 4 --n_head 4 --n_embd 256 --block_size 256 --seq_len 256 --micro_batch_size 16
           --total_batch_size 8192 --val_tokens 65536 --dtype bfloat16 --compile on)
fi

failed=() not_run=() cap=()
end=$((SECONDS + ${time_limit:-0}))
step() {  # step NAME COMMAND...: run it with its output in the part's log too; a failure is marked, the part goes on
    local name=$1 start=$SECONDS rc; shift
    if [[ $time_limit ]]; then  # what is left of --time_limit caps the step (timeout's exit 124: cut off)
        ((end - SECONDS > 0)) || { not_run+=("$part: $name"); echo "=== $name: not run: --time_limit reached" \
            | tee -a "$log"; return; }
        cap=(timeout -k 5 $((end - SECONDS)))
    fi
    echo "=== $name: $*" | tee -a "$log"
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout cannot run it; it caps its own commands
        "$@" 2>&1 | tee -a "$log"
    else
        "${cap[@]}" "$@" 2>&1 | tee -a "$log"
    fi
    rc=${PIPESTATUS[0]}
    ((rc == 0)) || failed+=("$part: $name")
    echo "=== $name: $( ((rc == 0)) && echo PASS || echo "FAIL (exit $rc)"), $((SECONDS - start)) s" | tee -a "$log"
}

make_shards() {  # the bundle's FineWeb parquet as token shards of 500K tokens (the first is val), once per machine
    [[ -f $shards/.complete ]] && echo "$shards made already" && return
    rm -rf "$shards"
    "${cap[@]}" python3 prepare_fineweb.py --input "$bundle/fineweb/*.parquet" --out_dir "$shards" \
        --shard_size $shard_size && touch "$shards/.complete"
}

resume_exact() {  # 20 steps twice, and from the step-10 checkpoint of the first: the resumed run must match the
    # first as closely as a repeat of it does (on a GPU some bf16 kernels, flash attention's backward among them,
    # may not repeat bit for bit; on a CPU in float32 every run must be equal)
    local dir=out/gpu/resume
    local flags=("${small[@]}" --data_dir "$shards" --max_steps 20 --eval_every 10 --save_every 10 --num_samples 0)
    rm -rf $dir && mkdir -p $dir/resumed
    local run=("${cap[@]}" python3 train_gpt2.py "${flags[@]}")
    "${run[@]}" --out_dir $dir/straight && cp $dir/straight/ckpt_0000010.pt $dir/resumed/ &&
        "${run[@]}" --out_dir $dir/repeat && "${run[@]}" --out_dir $dir/resumed --resume || return
    python3 - $dir <<'EOF'
import json, sys
def losses(run):  # {(step, "loss" or "val_loss"): value}
    with open(f"{sys.argv[1]}/{run}/log.jsonl") as f:
        return {(r["step"], k): r[k] for r in map(json.loads, f) for k in ("loss", "val_loss") if k in r}
straight, repeat, resumed = losses("straight"), losses("repeat"), losses("resumed")
assert sorted(s for s, k in resumed if k == "loss") == list(range(10, 20)), sorted(resumed)
gap = {name: max(abs(run[key] - straight[key]) for key in resumed)  # over the resumed run's losses
       for name, run in (("resumed", resumed), ("repeat", repeat))}
print(f"train losses of steps 10-19, val losses at 10 and 20: the largest |difference| from the uninterrupted run "
      f"is {gap['resumed']:.3g} resumed, {gap['repeat']:.3g} repeated")
assert gap["resumed"] <= 2 * gap["repeat"], "the resumed run is further from the uninterrupted one than a repeat is"
EOF
}

part_correctness() {
    step test_cuda python3 -m pytest -q -s -rs tests/test_cuda.py
    step shards make_shards
    # one process under torchrun: the NCCL start-up path on CUDA (gloo on a CPU), HellaSwag and samples in the loop
    step torchrun_nproc1 python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt2.py "${small[@]}" \
        --data_dir "$shards" --out_dir out/gpu/torchrun --max_steps 40 --eval_every 20 --num_samples 1 \
        --sample_len 16 --hellaswag_file "$hellaswag"
    step resume_exact resume_exact
    # the GPU run's checkpoint where no GPU is seen, as on a CPU-only machine
    step sample_cuda_hidden env CUDA_VISIBLE_DEVICES= python3 sample.py --ckpt out/gpu/resume/straight --device cpu \
        --prompt "The" --max_new_tokens 16
    step hellaswag_cuda_hidden env CUDA_VISIBLE_DEVICES= python3 hellaswag.py --ckpt out/gpu/resume/straight \
        --device cpu --data_file "$hellaswag" --limit 20
    if [[ ! $dry ]]; then  # batched scoring of all 1,000 on the GPU, bf16
        step hellaswag_gpu python3 hellaswag.py --ckpt out/gpu/resume/straight --data_file "$hellaswag" --device cuda \
            --dtype bfloat16
    fi
}

part_speed() {
    # ours then build-nanogpt as shipped at each micro-batch, 15 steps a run, 9 of them timed after the warm-up
    local peer=(--micro_batches 64 32 16 --steps 15) speed=()
    if [[ $dry ]]; then
        peer=(--dry_run --micro_batches 16)
        speed=(--dry_run --warmup_steps 1 --timed_steps 1 --profiled_steps 1)
    fi
    step vs_build_nanogpt python3 bench/vs_build_nanogpt.py --speed --peer "$bundle/peer/train_gpt2.py" \
        --work_dir out/gpu/peer "${peer[@]}"
    # the baseline, each candidate speed-up, the winners together, the baseline again: each profiled
    step train_speed python3 bench/train_speed.py --profile --out_dir "$results/speed" "${speed[@]}"
}

copy_muon_logs() {
    for f in out/gpu/muon/*/log.jsonl; do
        [[ -f $f ]] && cp "$f" "$results/muon_$(basename "$(dirname "$f")").jsonl"
    done
    return 0
}

part_muon() {
    step shards make_shards
    # GPT-2 124M, 400 steps x 32,768 tokens (13M tokens, 3.4 passes over the 3.86M train tokens) for each of the
    # 4 runs
    local size=(--n_layer 12 --n_head 12 --n_embd 768 --seq_len 1024 --total_batch_size 32768 --max_steps 400
                --eval_every 25 --val_tokens 262144 --adamw_lrs 6e-4 1.2e-3 2.4e-3 --extra --compile on)
    [[ $dry ]] && size=(--n_layer 2 --n_head 2 --n_embd 32 --seq_len 64 --total_batch_size 512 --max_steps 6
                        --eval_every 3 --val_tokens 1024 --adamw_lrs 1e-3 3e-3 --extra --compile off)
    rm -rf out/gpu/muon
    (while sleep 15; do copy_muon_logs; done) &  # each run's curve into the results as it grows
    local copier=$!
    step muon_vs_adamw python3 bench/studies/muon_vs_adamw.py --data_dir "$shards" --out_dir out/gpu/muon "${size[@]}"
    kill $copier
    copy_muon_logs
    cp out/gpu/muon/summary.json "$results/muon_summary.json" 2>/dev/null
    tail -n 2 out/gpu/muon/*.txt | tee -a "$log"  # each run's last lines (its error, had it one)
}

part_memory() {
    step shards make_shards
    local probe=()
    [[ $dry ]] && probe=(--dry_run)
    step fit_24GiB python3 bench/train_speed.py --fit_gib 24 --data_dir "$shards" --out_dir out/gpu/fit "${probe[@]}"
}

part_mid() {  # a small base model, then a short mid_train.py run on the bundle's chat, GSM8K and MMLU files
    step shards make_shards
    local base=(--max_steps 300 --eval_every 300) mid=(--max_steps 200 --eval_every 100)
    if [[ $dry ]]; then
        base=(--max_steps 4 --eval_every 4)
        mid=(--max_steps 4 --eval_every 2 --micro_batch_size 4 --compile off --dtype float32)
    fi
    rm -rf out/gpu/base out/gpu/mid
    step base python3 train_gpt2.py "${small[@]}" --data_dir "$shards" --out_dir out/gpu/base "${base[@]}" \
        --num_samples 0
    step mid_train python3 mid_train.py --init_ckpt out/gpu/base --out_dir out/gpu/mid "${mid[@]}" \
        --data "chat:$bundle/mid/identity_conversations.jsonl" "gsm8k:$bundle/mid/train.jsonl" \
        "mmlu:$bundle/mid/mmlu_dev.jsonl"
}

for part in $parts; do
    log=$results/$part.log
    : >"$log"
    echo "##### part $part${dry:+ (dry run)}" | tee -a "$log"
    "part_$part"
done
if ((${#not_run[@]})); then
    printf 'NOT RUN (--time_limit): %s\n' "${not_run[@]}" | tee -a "$log"
fi
if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}" | tee -a "$log"
fi
((${#failed[@]} + ${#not_run[@]} == 0)) || exit 1
echo "all steps of part(s) $parts passed${dry:+ (dry run)}" | tee -a "$log"
