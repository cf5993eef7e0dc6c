#!/usr/bin/env bash
# The demo's training speed, A/B in one run: another tree (OLD, e.g. a git worktree of an earlier commit, with
# data/demo prepared) against this one in float32 and with its default dtype; 25 demo steps each, in turns, ROUNDS
# rounds; prints each run's median tok/s over steps 5-24 and the dtype it ran in.
#     git worktree add /tmp/old COMMIT && ln -s "$PWD/data" /tmp/old/data && bash bench/demo_ab.sh /tmp/old 3
set -e
OLD=$1 ROUNDS=${2:-3} NEW=$(cd "$(dirname "$0")/.." && pwd) OUT=$(mktemp -d)
median() { python -c "import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
print(round(statistics.median(r['tok_per_s'] for r in records if 'tok_per_s' in r and r['step'] >= 5)))" "$1"; }
for round in $(seq 1 "$ROUNDS"); do
  for run in "old $OLD --dtype float32" "new $NEW --dtype float32" "new $NEW"; do
    set -- $run
    name=$1 dir=$2; shift 2
    rm -rf "$OUT/run"
    (cd "$dir" && python train_gpt2.py --demo --max_steps 25 --eval_every 1000 --save_every 1000 --num_samples 0 \
      "$@" --out_dir "$OUT/run" > "$OUT/stdout" 2>&1)
    echo "round $round | $name $* | $(median "$OUT/run/log.jsonl") tok/s | $(grep -o 'cpu [a-z0-9]*' "$OUT/stdout" | head -1)"
  done
done
rm -rf "$OUT"
