#!/usr/bin/env bash
# Accuracy with 16-bit wire dtypes: the CIFAR-10 CNN trained through psrun
# twice with the same data, seed and settings, once with float32 on the
# wire and once with bfloat16 pushes and pulls (psrun --wire-dtype bf16;
# the servers keep float32), printing the chief's test accuracy after each
# evaluation (every epoch by default) for both and the final difference.
# The issue's target: within one point after 2 epochs.
#
#   deploy/bench/bf16_accuracy.sh [BIN_DIR]      (default: build/bin)
#
# Environment: DATA (/work/shared/cifar10), EPOCHS (2), WORKERS (2),
# BATCH (64 per worker), LR (0.1), THREADS (compute threads per worker;
# default: cifar_worker's), DTYPES ("f32 bf16"; fp16 too if wanted),
# STEPS (instead of EPOCHS, for a quick check of the script itself),
# EVAL_EVERY (steps; default one epoch of the global batch).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${1:-$root/build/bin}" && pwd)
data=${DATA:-/work/shared/cifar10}; epochs=${EPOCHS:-2}; workers=${WORKERS:-2}
batch=${BATCH:-64}; lr=${LR:-0.1}; dtypes=${DTYPES:-f32 bf16}
[ -e "$data/test_batch.bin" ] || { echo "no CIFAR-10 binaries in $data (DATA=...)" >&2; exit 1; }
per_epoch=$(( (50000 + workers * batch - 1) / (workers * batch) ))
eval_every=${EVAL_EVERY:-$per_epoch}
length=(--epochs "$epochs")
[ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
threads=()
[ -n "${THREADS:-}" ] && threads=(--threads "$THREADS")
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
for dt in $dtypes; do
  echo "training with --wire-dtype $dt ..." >&2
  # --transport tcp: on one node auto would pick shared memory, which
  # carries float32 whatever the dtype (docs/protocol.md §1a)
  "$bin/psrun" --local -n $((workers + 1)) --ps 1 --transport tcp --wire-dtype "$dt" -- \
    "$bin/cifar_worker" --data "$data" "${length[@]}" --batch "$batch" --lr "$lr" --seed 1 \
    --eval-every "$eval_every" --metrics "$out/$dt.jsonl" "${threads[@]}" \
    >"$out/$dt.log" 2>&1 || { echo "run with $dt failed:" >&2; tail -20 "$out/$dt.log" >&2; exit 1; }
done
python3 - "$out" $dtypes <<'PY'
import json, sys
out, dtypes = sys.argv[1], sys.argv[2:]
acc = {}
for dt in dtypes:
    rows = [json.loads(l) for l in open(f'{out}/{dt}.jsonl') if l.startswith('{')]
    acc[dt] = [(r['step'], r.get('epoch'), r['test_accuracy']) for r in rows if 'test_accuracy' in r]
    if not acc[dt]:
        sys.exit(f'{dt}: no test accuracy in the metrics')
for dt in dtypes:
    print(f'{dt:5s} ' + '  '.join(f'step {s} epoch {e:.2f}: {100 * a:.2f}%' for s, e, a in acc[dt]))
base = acc[dtypes[0]][-1][2]
for dt in dtypes[1:]:
    d = 100 * (acc[dt][-1][2] - base)
    print(f'final {dt} - {dtypes[0]}: {d:+.2f} points ({"within" if abs(d) <= 1 else "NOT within"} 1 point)')
PY
