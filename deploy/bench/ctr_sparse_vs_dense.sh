#!/usr/bin/env bash
# Why sparse tables matter, as same-run ratios: the CTR example's embedding
# (ROWS x DIM floats; 1M x 16 = 64 MB by default) trained
#   (a) as a psd sparse table: each step pulls and pushes only the rows its
#       batch touches (ctr_worker --embed table), and
#   (b) as one dense psd variable pushed and pulled whole every step
#       (ctr_worker --embed dense),
# with the same data, model (the MLP is psd variables in both) and update
# rule (SGD), for 1 and 2 workers. Runs are interleaved (a, b, then b, a in
# the next round) so both see the same machine state; prints, per
# configuration, the median and range over the rounds of the chief's
# median step time, its parts and the bytes its connections moved per step
# (TCP_INFO), then the ratio dense / table per round (median and range).
#
#   deploy/bench/ctr_sparse_vs_dense.sh [BIN_DIR]      (default: build/bin)
#
# Environment: ROUNDS (5), STEPS (40; the first WARMUP=5 are not timed),
# BATCH (1024 records per worker: about 27k keys, 9k distinct rows),
# ROWS (1000000), DIM (16), WORKERS ("1 2"), PS (1), DATA (a directory of
# ctr_synth output; default: made in a temporary directory, 300000 records
# with ids up to 2e6), JSON=1 (also print every run's summary line).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${1:-$root/build/bin}" && pwd)
rounds=${ROUNDS:-5}; steps=${STEPS:-40}; warmup=${WARMUP:-5}; batch=${BATCH:-1024}
rows=${ROWS:-1000000}; dim=${DIM:-16}; workers=${WORKERS:-1 2}; ps=${PS:-1}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
data=${DATA:-}
if [ -z "$data" ]; then
  data=$out/data
  "$bin/ctr_synth" --out "$data" --train 300000 --test 1000 --seed 1 >&2
fi
run() { # workers mode round
  "$bin/psrun" --local -n $(($1 + ps)) --ps "$ps" -- "$bin/ctr_worker" --data "$data" \
    --steps "$steps" --warmup "$warmup" --batch "$batch" --dim "$dim" --hash-rows "$rows" \
    --capacity "$rows" --opt sgd --lr 0.5 --no-eval --embed "$2" 2>"$out/err" |
    sed -n 's/^\[w0\] //p' | grep '^{' | sed "s/^{/{\"round\":$3,/" >>"$out/runs" || {
    echo "run failed (workers $1, $2):" >&2; tail -20 "$out/err" >&2; exit 1; }
}
for r in $(seq 1 "$rounds"); do
  for w in $workers; do
    if [ $((r % 2)) = 1 ]; then order="table dense"; else order="dense table"; fi
    for mode in $order; do run "$w" "$mode" "$r"; done
  done
  echo "round $r of $rounds done" >&2
done
[ "${JSON:-0}" = 1 ] && cat "$out/runs"
python3 - "$out/runs" "$rows" "$dim" "$batch" "$ps" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
rows, dim, batch, ps = sys.argv[2:6]
print(f'embedding {rows} x {dim} floats ({int(rows) * int(dim) * 4 / 1e6:.0f} MB), batch {batch} '
      f'records per worker, {ps} ps; chief\'s figures, median [min-max] over rounds')
keys = ['step_ms', 'pull_ms', 'compute_ms', 'push_ms', 'bytes_sent_per_step',
        'bytes_recv_per_step', 'unique_keys_per_step']
def fmt(v):
    return '%.4g [%.4g-%.4g]' % (statistics.median(v), min(v), max(v))
for w in sorted({r['workers'] for r in runs}):
    for mode in ('table', 'dense'):
        sel = [r for r in runs if r['workers'] == w and r['embed'] == mode]
        print(f'workers {w} {mode:5s} ' + '  '.join(f'{k} {fmt([r[k] for r in sel])}' for k in keys))
    for k in ('step_ms', 'bytes_sent_per_step', 'bytes_recv_per_step'):
        ratio = []
        for rnd in sorted({r['round'] for r in runs}):
            t = [r[k] for r in runs if r['workers'] == w and r['round'] == rnd and r['embed'] == 'table']
            d = [r[k] for r in runs if r['workers'] == w and r['round'] == rnd and r['embed'] == 'dense']
            if t and d and t[0] > 0: ratio.append(d[0] / t[0])
        if ratio: print(f'workers {w} dense/table {k}: {fmt(ratio)} x')
PY
