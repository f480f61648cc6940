#!/usr/bin/env bash
# Same-run comparison of two builds of psd (e.g. before and after a
# refactoring): the loopback push+pull benchmark against raw TCP and a short
# CIFAR-10 training run through psrun --local, interleaved A, B, A, B, ...
# so both see the same machine state. Prints each figure's median and range
# per build, and the ratio of the medians (B / A).
#
#   deploy/bench/before_after.sh A_BIN_DIR B_BIN_DIR [DATA_DIR]
#
# A_BIN_DIR and B_BIN_DIR hold psd, psrun, ps_bench and cifar_worker (each
# build's bin/). DATA_DIR: CIFAR-10 binary files (default ../shared/cifar10).
# Environment: ROUNDS (3), SIZES (4,1M,64M), CIFAR_STEPS (40), BATCH (64).
set -euo pipefail
a=$(cd "$1" && pwd); b=$(cd "$2" && pwd)
data=${3:-$(cd "$(dirname "$0")/../.." && pwd)/../shared/cifar10}
rounds=${ROUNDS:-3}; sizes=${SIZES:-4,1M,64M}; steps=${CIFAR_STEPS:-40}; batch=${BATCH:-64}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
for r in $(seq 1 "$rounds"); do
  for side in A B; do
    bin=$a; [ $side = B ] && bin=$b
    "$bin/ps_bench" --rounds 1 --tcp-baseline --sizes "$sizes" --json --psd "$bin/psd" \
      >>"$out/bench.$side" 2>/dev/null
    if [ -f "$data/data_batch_1.bin" ]; then
      "$bin/psrun" --local -n 3 --ps 1 -- "$bin/cifar_worker" --data "$data" --steps "$steps" \
        --batch "$batch" --lr 0.1 --eval-every 0 2>/dev/null |
        grep '"test_accuracy":[0-9]' | sed 's/^\[w[0-9]*\] //' >>"$out/cifar.$side" || true
    fi
    echo "round $r $side done" >&2
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys, os
d = sys.argv[1]
def load(name):
    rows = []
    p = os.path.join(d, name)
    if os.path.exists(p):
        for line in open(p):
            line = line.strip()
            if line.startswith('{'):
                try: rows.append(json.loads(line))
                except ValueError: pass
    return rows
def series(rows, key):
    s = {}
    for r in rows:
        k, v = key(r)
        if k is not None and v is not None: s.setdefault(k, []).append(v)
    return s
def bench_key(r):
    if r.get('name') == 'pushpull' and 'step_ms' in r: return ('pushpull %d B step_ms' % r['bytes'], r['step_ms'])
    if r.get('name') == 'ratio': return ('ratio %d B vs %s' % (r['bytes'], r['vs']), r['value'])
    if r.get('name') == 'tcp_stream': return ('tcp_stream gbps', r['gbps'])
    return (None, None)
print('%-34s %24s %24s %8s' % ('figure', 'A median [min-max]', 'B median [min-max]', 'B/A'))
for fname, key in (('bench', bench_key), ('cifar', lambda r: ('cifar images_per_sec', r.get('images_per_sec')))):
    A = series(load(fname + '.A'), key); B = series(load(fname + '.B'), key)
    for k in sorted(set(A) | set(B)):
        fa, fb = A.get(k, []), B.get(k, [])
        def fmt(v): return '%.4g [%.4g-%.4g]' % (statistics.median(v), min(v), max(v)) if v else '-'
        ratio = statistics.median(fb) / statistics.median(fa) if fa and fb and statistics.median(fa) else float('nan')
        print('%-34s %24s %24s %8.3f' % (k, fmt(fa), fmt(fb), ratio))
PY
