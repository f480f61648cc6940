#!/usr/bin/env bash
# PyTorch's DistributedDataParallel against psd, as same-run ratios: one
# PyTorch model (the CIFAR-10 tutorial CNN of examples/python/cifar_net.py)
# trained for EPOCHS epochs on the same data, batches and recipe
#   (a) with DDP over gloo, 2 processes (examples/python/cifar10_ddp.py), and
#   (b) through psd, 1 ps + 2 workers under psrun --local
#       (examples/python/cifar10_torch.py: psd.torch.DistributedModule),
#   (c) with C=1 also by the C worker (cifar_worker, same recipe), whose
#       images/s over (b)'s is what the Python wrapper and PyTorch cost.
# Same batch per worker, same torch threads per process (THREADS), every
# process of every run pinned to the same CPUs (taskset -c CPUS: the ps of
# (b) shares them, as its cost is part of psd's). Rounds are interleaved
# (a, b[, c], then the reverse order in the next round) so all see the same
# machine state; prints each one's images/s (the training loop's, from the
# chief's summary line; start-up, loading and the final evaluation are not
# in it) as median [min-max] over the rounds, the ratios psd/DDP (and
# C/psd) of the medians and per round, and the test accuracy after each run.
# A psd chief starts its clock at its first pull, before the other worker
# has started: its first step carries that wait (1-2 s here), which weighs
# on short runs (STEPS) and not on epochs (well under 1% of one). DDP's
# ranks start together (the DDP constructor is a barrier).
#
#   deploy/bench/torch_ddp_vs_psd.sh [DATA_DIR]     (default: $DATA)
#   ROUNDS=3 EPOCHS=1 C=1 deploy/bench/torch_ddp_vs_psd.sh /work/shared/cifar10
#   STEPS=20 deploy/bench/torch_ddp_vs_psd.sh DIR    # a quick look (no epochs)
#
# The final evaluation (10000 test images, outside the timing) takes tens of
# seconds a run on one thread; when only images/s matter, a DATA_DIR whose
# test_batch.bin is the first records of the real one (head -c $((1000 * 3073)))
# with the training files linked in makes the rounds quicker.
#
# Environment: ROUNDS (1), EPOCHS (2), STEPS (instead of EPOCHS), BATCH (128
# per worker), THREADS (torch threads per process, 1), CPUS (taskset list;
# default all of this machine's), RECIPE (the optimizer options given to
# all: "--lr 0.02 --momentum 0.9 --cosine"), EVAL_EVERY (0: test accuracy at
# the end only), C (1: also cifar_worker), BIN (build/bin: psrun,
# cifar_worker), PYTHON (/usr/bin/python3: Debian's python3-torch),
# PYTHONPATH and PSD_LIBPSCLIENT (default: the tree's python/ and
# BIN/../lib/libpsclient.so), JSON=1 (also print every run's summary).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${BIN:-$root/build/bin}" && pwd)
data=${1:-${DATA:-}}
[ -n "$data" ] || { echo "usage: $0 DATA_DIR (CIFAR-10 binary files; or DATA=...)" >&2; exit 2; }
rounds=${ROUNDS:-1}; batch=${BATCH:-128}; threads=${THREADS:-1}
cpus=${CPUS:-0-$(($(nproc) - 1))}
recipe=${RECIPE:---lr 0.02 --momentum 0.9 --cosine}
py=${PYTHON:-/usr/bin/python3}
export PYTHONPATH=${PYTHONPATH:-$root/python}
export PSD_LIBPSCLIENT=${PSD_LIBPSCLIENT:-$bin/../lib/libpsclient.so}
export OMP_NUM_THREADS=$threads
if [ -n "${STEPS:-}" ]; then length=(--steps "$STEPS"); else length=(--epochs "${EPOCHS:-2}"); fi
# shellcheck disable=SC2206  # RECIPE is a list of options
common=(--data "$data" "${length[@]}" --batch "$batch" --threads "$threads"
        --eval-every "${EVAL_EVERY:-0}" $recipe)
ex=$root/examples/python
kinds="ddp psd"
[ "${C:-0}" = 1 ] && kinds="ddp psd c"
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT

run() { # kind round: appends the chief's summary line, tagged, to $out/runs
  local cmd
  case $1 in
    ddp) cmd=("$py" "$ex/cifar10_ddp.py" --nproc 2 "${common[@]}") ;;
    psd) cmd=("$bin/psrun" --local -n 3 --ps 1 -- "$py" "$ex/cifar10_torch.py" "${common[@]}") ;;
    c) cmd=("$bin/psrun" --local -n 3 --ps 1 -- "$bin/cifar_worker" "${common[@]}") ;;
  esac
  taskset -c "$cpus" "${cmd[@]}" >"$out/out" 2>"$out/err" || {
    echo "$1 run failed:" >&2; tail -20 "$out/err" >&2; exit 1; }
  # psrun prefixes the chief's lines with [w0]; the DDP chief's has "workers"
  sed "s/^\[w0\] //" "$out/out" | grep "^{.*\"workers\"" |
    sed "s/^{/{\"kind\":\"$1\",\"round\":$2,/" >>"$out/runs"
}

echo "cpus $cpus, $threads torch thread(s) per process, batch $batch per worker, 2 workers," \
     "${length[*]}, recipe: $recipe" >&2
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for r in $(seq 1 "$rounds"); do
  order=$kinds
  [ $((r % 2)) = 0 ] && order=$(echo "$kinds" | tr ' ' '\n' | tac | tr '\n' ' ')
  for k in $order; do run "$k" "$r"; done
  echo "round $r of $rounds done" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
[ "${JSON:-0}" = 1 ] && cat "$out/runs"
"$py" - "$out/runs" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
med = statistics.median
def fmt(v, f='%.1f'):
    return (f + ' [' + f + '-' + f + ']') % (med(v), min(v), max(v))
def of(kind, key):
    return [r[key] for r in runs if r['kind'] == kind]
names = {'ddp': 'DDP (gloo, 2 processes)', 'psd': 'psd (1 ps + 2 workers)', 'c': 'cifar_worker (C, psd)'}
for k in names:
    if of(k, 'images_per_sec'):
        print(f"{names[k]:26s} images/s {fmt(of(k, 'images_per_sec'))}   test accuracy "
              f"{fmt(of(k, 'test_accuracy'), '%.4f')}   steps {of(k, 'steps')[0]}")
def ratio(a, b, label):
    x, y = of(a, 'images_per_sec'), of(b, 'images_per_sec')
    if x and y:
        per = [p / q for p, q in zip(x, y)]
        print(f'{label}: {med(x) / med(y):.3f} (of medians); per round {fmt(per, "%.3f")}')
ratio('psd', 'ddp', 'images/s psd / DDP')
ratio('c', 'psd', 'images/s C worker / psd Python')
PY
