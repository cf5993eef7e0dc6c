#!/usr/bin/env bash
# The GPU session's runs (issue 29), offline, from the folder that bench/gpu_bundle.sh fills (wheels, data, peer).
# One part a device call, each sized to end inside the call's 10 minutes on an H100 (the minutes below are
# estimates, not measurements). Each writes its log to $OUT/partN.log as it goes (out/gpu/results where OUT is
# unset), so that a call cut short still brings back what ran.
#
#   bash bench/gpu.sh --part 1   # correctness: tests/test_cuda.py; torchrun --nproc_per_node=1 (NCCL start-up);
#                                # a resumed run equals an uninterrupted one on the GPU; the GPU checkpoint used
#                                # with CUDA hidden; HellaSwag on the GPU (~5 min)
#   bash bench/gpu.sh --part 2   # speed: bench/gpu_vs_peer.py, GPT-2 124M seq 1024 bf16 + compile at micro-batches
#                                # 64/32/16, each then build-nanogpt as shipped, 15 steps a run (~8 min)
#   bash bench/gpu.sh --part 3   # quality per token: bench/muon_vs_adamw.py, GPT-2 124M, 3 AdamW lrs and Muon,
#                                # 400 steps x 32,768 tokens each (~6 min)
#   bash bench/gpu.sh --part 4   # the largest micro-batch in 24 GiB (bench/max_micro_batch.py); a small base model
#                                # then a short mid_train.py run on the bundle's chat, GSM8K and MMLU files (~5 min)
#   bash bench/gpu.sh --part quick  # the parts' most telling steps in one call of 9 minutes, for a lease of 15
#                                # minutes of device time: test_cuda.py, ours against the peer at micro-batch 64,
#                                # the largest micro-batch in 24 GiB, a run with default flags under torchrun, an
#                                # exact resume, HellaSwag; each step capped so that the whole ends in time
#   bash bench/gpu.sh --part next   # one call of at most 6 minutes (issue 57): where the time goes at micro-batch
#                                # 64 (bench/gpu_profile.py), then the candidate speed-ups against the baseline in
#                                # one A/B process (bench/gpu_ab.py, $OUT/ab.jsonl), then build-nanogpt at 64 when
#                                # the card is not the H200 it was measured on; each step capped
#   bash bench/gpu.sh --part later  # one call of 9 minutes: the profile at micro-batch 32, ours against the peer
#                                # at 32, a small base model then a short mid_train.py run; each step capped
#   bash bench/gpu.sh --dry_run  # anywhere (CPU): every part with tiny models and few steps, on a GPU machine
#                                # faked by tests/fake_cuda, so that the scripts take their CUDA path
#
#   bash bench/gpu.sh --part mid    # part 4's small base model and short mid_train.py run alone
#
# Options: --bundle DIR (default .gpu_bundle), --part 1|2|3|4|quick|next|later|mid (default: 1-4 in order),
# --dry_run.
# A step that fails is marked FAIL and the part goes on; the exit status is 1 if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
die() { echo "error: $*" >&2; exit 2; }
bundle=.gpu_bundle parts="1 2 3 4" dry=
while (($#)); do
    case $1 in
        --bundle | --part)
            (($# >= 2)) || die "$1 needs a value"
            if [[ $1 == --bundle ]]; then bundle=${2%/}; else parts=$2; fi
            shift 2 ;;
        --dry_run) dry=1; shift ;;
        *) die "unknown argument '$1'; usage: bash bench/gpu.sh [--bundle DIR] [--part PART] [--dry_run]" ;;
    esac
done
case $parts in
    1 | 2 | 3 | 4 | quick | next | later | mid | "1 2 3 4") ;;
    *) die "--part $parts: give 1, 2, 3, 4, quick, next, later or mid" ;;
esac
compgen -G "$bundle/wheels/*.whl" >/dev/null || die "no wheels in $bundle/wheels: run bash bench/gpu_bundle.sh $bundle first"

# The packages the GPU machine lacks, as its README installs them: no index (no internet there), no deps (the bundle
# holds each one needed), into a folder on PYTHONPATH (its python3 is a venv of its own that we leave as it is)
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

failed=() cap=()
capped() { cap=(); }  # capped SECONDS: the next steps' time limit; the parts sized to one call redefine it
step() {  # step NAME COMMAND...: run it with its output in the part's log too; a failure is marked, the part goes on
    local name=$1 start=$SECONDS rc; shift
    echo "=== $name: $*" | tee -a "$log"
    "${cap[@]}" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    ((rc == 0)) || failed+=("part $part: $name")
    echo "=== $name: $( ((rc == 0)) && echo PASS || echo "FAIL (exit $rc)"), $((SECONDS - start)) s" | tee -a "$log"
}

make_shards() {  # the bundle's FineWeb parquet as token shards of 500K tokens (the first is val), once per machine
    [[ -f $shards/.complete ]] && echo "$shards made already" && return
    rm -rf "$shards"
    python3 prepare_fineweb.py --input "$bundle/fineweb/*.parquet" --out_dir "$shards" --shard_size $shard_size \
        && touch "$shards/.complete"
}

resume_exact() {  # 20 steps twice, and from the step-10 checkpoint of the first: the resumed run must match the
    # first as closely as a repeat of it does (on a GPU some bf16 kernels, flash attention's backward among them,
    # may not repeat bit for bit; on a CPU in float32 every run must be equal)
    local dir=out/gpu/resume
    local flags=("${small[@]}" --data_dir "$shards" --max_steps 20 --eval_every 10 --save_every 10 --num_samples 0)
    rm -rf $dir && mkdir -p $dir/resumed
    python3 train_gpt2.py "${flags[@]}" --out_dir $dir/straight && cp $dir/straight/ckpt_0000010.pt $dir/resumed/ &&
        python3 train_gpt2.py "${flags[@]}" --out_dir $dir/repeat &&
        python3 train_gpt2.py "${flags[@]}" --out_dir $dir/resumed --resume || return
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

part1() {
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

part2() {
    # 15 steps a run, 9 of them timed after the warm-up; B=64 first (the peer's own config), so that a call cut
    # short loses the smallest. About 1.7 min a B for ours (two compilations: eval and train) and 1 for the peer's
    local size=(--micro_batches 64 32 16 --steps 15)
    [[ $dry ]] && size=(--dry_run --micro_batches 16)
    step gpu_vs_peer python3 bench/gpu_vs_peer.py --peer "$bundle/peer/train_gpt2.py" --work_dir out/gpu/peer "${size[@]}"
}

copy_muon_logs() {
    for f in out/gpu/muon/*/log.jsonl; do
        [[ -f $f ]] && cp "$f" "$results/muon_$(basename "$(dirname "$f")").jsonl"
    done
    return 0
}

part3() {
    step shards make_shards
    # bench/RESULTS.md's GPT-2 124M regime: 400 steps x 32,768 tokens (13M tokens, 3.4 passes over the 3.86M train
    # tokens) for each of the 4 runs; at about 0.1 s a step and a minute to compile each, about 6 min in all
    local size=(--n_layer 12 --n_head 12 --n_embd 768 --seq_len 1024 --total_batch_size 32768 --max_steps 400
                --eval_every 25 --val_tokens 262144 --adamw_lrs 6e-4 1.2e-3 2.4e-3 --extra --compile on)
    [[ $dry ]] && size=(--n_layer 2 --n_head 2 --n_embd 32 --seq_len 64 --total_batch_size 512 --max_steps 6
                        --eval_every 3 --val_tokens 1024 --adamw_lrs 1e-3 3e-3 --extra --compile off)
    rm -rf out/gpu/muon
    (while sleep 15; do copy_muon_logs; done) &  # each run's curve into the results as it grows
    local copier=$!
    step muon_vs_adamw python3 bench/muon_vs_adamw.py --data_dir "$shards" --out_dir out/gpu/muon "${size[@]}"
    kill $copier
    copy_muon_logs
    cp out/gpu/muon/summary.json "$results/muon_summary.json" 2>/dev/null
    tail -n 2 out/gpu/muon/*.txt | tee -a "$log"  # each run's last lines (its error, had it one)
}

part4() {
    step shards make_shards
    local probe=()
    [[ $dry ]] && probe=(--dry_run)
    step max_micro_batch python3 bench/max_micro_batch.py --data_dir "$shards" --out_dir out/gpu/max-micro-batch \
        "${probe[@]}"
    midtrain_steps
}

midtrain_steps() {  # a small base model, then a short mid_train.py run on the bundle's chat, GSM8K and MMLU files
    local base=(--max_steps 300 --eval_every 300) mid=(--max_steps 200 --eval_every 100)
    if [[ $dry ]]; then
        base=(--max_steps 4 --eval_every 4)
        mid=(--max_steps 4 --eval_every 2 --micro_batch_size 4 --compile off --dtype float32)
    fi
    rm -rf out/gpu/base out/gpu/mid
    capped 60; step base python3 train_gpt2.py "${small[@]}" --data_dir "$shards" --out_dir out/gpu/base \
        "${base[@]}" --num_samples 0
    capped 90; step mid_train python3 mid_train.py --init_ckpt out/gpu/base --out_dir out/gpu/mid "${mid[@]}" \
        --data "chat:$bundle/mid/identity_conversations.jsonl" "gsm8k:$bundle/mid/train.jsonl" \
        "mmlu:$bundle/mid/mmlu_dev.jsonl"
    cap=()
}

partmid() {  # the midtraining steps alone
    step shards make_shards
    midtrain_steps
}

partquick() {  # one device call: each step gets at most its share of what is left of 520 s (exit 124: cut off)
    local end=$((SECONDS + 520))
    capped() { cap=(timeout -k 5 $(($1 < end - SECONDS ? $1 : end - SECONDS))); }
    make_shards >"$results/shards.log" 2>&1 &  # on the CPU, while the GPU runs the tests
    local shards_made=$!
    capped 170; step test_cuda python3 -m pytest -q -s -rs tests/test_cuda.py
    local size=(--micro_batches 64 --steps 15)
    [[ $dry ]] && size=(--dry_run --micro_batches 16)
    capped 230; step gpu_vs_peer python3 bench/gpu_vs_peer.py --peer "$bundle/peer/train_gpt2.py" \
        --work_dir out/gpu/peer "${size[@]}"
    wait $shards_made; cat "$results/shards.log" >>"$log"
    local probe=(); [[ $dry ]] && probe=(--dry_run)
    capped 170; step max_micro_batch python3 bench/max_micro_batch.py --data_dir "$shards" \
        --out_dir out/gpu/max-micro-batch "${probe[@]}"
    # a small model with every other flag at its default (device, dtype, compile), as a user types it
    local tiny=(--n_layer 4 --n_head 4 --n_embd 256 --seq_len 256 --micro_batch_size 16 --total_batch_size 8192)
    [[ $dry ]] && tiny=("${small[@]}")
    capped 90; step torchrun_defaults python3 -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt2.py \
        "${tiny[@]}" --data_dir "$shards" --out_dir out/gpu/torchrun --max_steps 40 --eval_every 20 \
        --num_samples 1 --sample_len 16 --hellaswag_file "$hellaswag"
    cap=()
    ((end - SECONDS > 150)) && step resume_exact resume_exact
    capped 60; ((end - SECONDS > 30)) && step hellaswag_defaults python3 hellaswag.py --ckpt out/gpu/torchrun \
        --data_file "$hellaswag"
    cap=()
}

partnext() {  # one device call of at most 6 minutes (issue 57), so that a second still fits a lease of 15: where
    # the time goes at micro-batch 64 (bench/gpu_profile.py), the candidate speed-ups as variants of one A/B process
    # (bench/gpu_ab.py), then build-nanogpt at micro-batch 64 unless this card is the H200 it was measured on (a
    # ratio holds on one card only); each step capped, results in $results as they come
    local x=1; [[ $dry ]] && x=5  # a dry run's CPU: 5x the time of each cap
    local end=$((SECONDS + 330 * x))  # with the bundle's install and the header, under 6 minutes
    capped() { local left=$((end - SECONDS > 1 ? end - SECONDS : 1)); cap=(timeout -k 5 $(($1 < left ? $1 : left))); }
    local card; card=$(python3 -c 'import torch; print(torch.cuda.get_device_name())')
    local peer=1 peer_s=$((80 * x)); [[ $card == "NVIDIA H200" ]] && peer= peer_s=0
    local profile=(--out_dir "$results" --warmup_steps 3 --timed_steps 3 --profiled_steps 1)
    local ab=(--out "$results/ab.jsonl") size=(--micro_batches 64 --steps 12)
    if [[ $dry ]]; then
        profile+=(--dry_run --warmup_steps 1 --timed_steps 1) ab+=(--dry_run --warmup_steps 1 --timed_steps 1)
        size=(--dry_run --micro_batches 16)
    fi
    capped $((90 * x)); step profile_B64 python3 bench/gpu_profile.py --micro_batch_size 64 "${profile[@]}"
    # the A/B gets what is left but the peer's share, and plans its variants to end 15 s inside its cap
    local ab_s=$((end - SECONDS - peer_s))
    capped $ab_s; step ab python3 bench/gpu_ab.py "${ab[@]}" --seconds $((ab_s > 30 ? ab_s - 15 : 15))
    if [[ $peer ]]; then
        capped $peer_s; step peer_B64 python3 bench/gpu_vs_peer.py --peer_only --peer "$bundle/peer/train_gpt2.py" \
            --work_dir out/gpu/peer "${size[@]}"
    else
        echo "=== peer_B64: not run: build-nanogpt was measured on this card, $card (bench/RESULTS.md, issue 46)" \
            | tee -a "$log"
    fi
    cap=()
}

partlater() {  # one device call after partnext: each step gets at most its share of what is left of 520 s
    local end=$((SECONDS + 520))
    capped() { cap=(timeout -k 5 $(($1 < end - SECONDS ? $1 : end - SECONDS))); }
    make_shards >"$results/shards.log" 2>&1 &  # on the CPU, while the GPU profiles
    local shards_made=$!
    local profile=(--out_dir "$results")
    [[ $dry ]] && profile+=(--dry_run --warmup_steps 1 --timed_steps 1 --profiled_steps 1)
    capped 100; step profile_B32 python3 bench/gpu_profile.py --micro_batch_size 32 "${profile[@]}"
    local size=(--micro_batches 32 --steps 15)
    [[ $dry ]] && size=(--dry_run --micro_batches 16)
    capped 170; step gpu_vs_peer_B32 python3 bench/gpu_vs_peer.py --peer "$bundle/peer/train_gpt2.py" \
        --work_dir out/gpu/peer "${size[@]}"
    wait $shards_made; cat "$results/shards.log" >>"$log"
    midtrain_steps
}

for part in $parts; do
    log=$results/part$part.log
    : >"$log"
    echo "##### part $part${dry:+ (dry run)}" | tee -a "$log"
    "part$part"
done
if ((${#failed[@]})); then
    printf 'FAILED: %s\n' "${failed[@]}" | tee -a "$log"
    exit 1
fi
echo "all steps of part(s) $parts passed${dry:+ (dry run)}" | tee -a "$log"
