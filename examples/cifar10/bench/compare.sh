#!/bin/bash
# Training throughput of the C CNN (cnn_bench) against the same network in
# PyTorch (torch_cifar.py), batch 128 by default, at 1 and 2 threads.
# The runs are interleaved (C, torch, C, torch, ...) for ROUNDS rounds and
# pinned with taskset (1 thread: CPU 0; 2 threads: CPUs 0,1); the medians
# and their ratio are printed, with the 1024^3 SGEMM rate of one thread.
#
#   examples/cifar10/bench/compare.sh            # after cmake --build build
#   ROUNDS=5 STEPS=30 THREADS="1 2" BATCH=128 NO_LRN=1 compare.sh
#   DEVICE=gpu compare.sh                        # GPU: cnn_bench --device gpu
#                                                # vs torch on cuda, same GPU
#
# With DEVICE=gpu: no pinning (PyTorch runs its backward on its own
# thread), THREADS is 1, and the C runs add where the step time goes
# (cnn_bench: ms_eager = no graphs, ms_copies = the transfers alone,
# ms_ops_synced = each op timed with a wait after it).
#
# Environment: CNN_BENCH (default <repo>/build/bin/cnn_bench), PYTHON
# (default /usr/bin/python3, which has Debian's python3-torch), ROUNDS (3),
# STEPS (timed steps per run, 20), WARMUP (3), THREADS ("1 2"), BATCH (128),
# NO_LRN (set: both LRN layers left out, in both programs).
# Needs: apt-get install -y --no-install-recommends python3-torch libopenblas-dev
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
bench=${CNN_BENCH:-$root/build/bin/cnn_bench}
py=${PYTHON:-/usr/bin/python3}
rounds=${ROUNDS:-3}
steps=${STEPS:-20}
warmup=${WARMUP:-3}
threads_list=${THREADS:-1 2}
batch=${BATCH:-128}
device=${DEVICE:-cpu}
case "$device" in
  cpu) devflag=(); tdev=cpu ;;
  gpu) devflag=(--device gpu); tdev=cuda; threads_list=1 ;;
  *) echo "compare.sh: DEVICE must be cpu or gpu, got '$device'" >&2; exit 2 ;;
esac
lrnflag=()
[ -n "${NO_LRN:-}" ] && lrnflag=(--no-lrn)

[ -x "$bench" ] || { echo "compare.sh: no $bench (cmake --build build)" >&2; exit 1; }
"$py" -c 'import torch' 2>/dev/null || {
  echo "compare.sh: $py cannot import torch (apt-get install python3-torch)" >&2; exit 1; }

pin() { # pin THREADS CMD...: first THREADS CPUs, when taskset exists
  local t=$1; shift
  if [ "$device" = cpu ] && command -v taskset >/dev/null && [ "$(nproc)" -ge "$t" ]; then
    taskset -c "0-$((t - 1))" "$@"
  else
    "$@"
  fi
}

log=$(mktemp)
trap 'rm -f "$log"' EXIT
sg=$(pin 1 "$bench" --sgemm)
echo "sgemm: $sg"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
  for t in $threads_list; do
    c=$(OMP_NUM_THREADS="$t" pin "$t" "$bench" --threads "$t" --batch "$batch" \
          --steps "$steps" --warmup "$warmup" "${lrnflag[@]}" "${devflag[@]}")
    echo "round $r C     $c"
    echo "C $c" >>"$log"
    p=$(OMP_NUM_THREADS="$t" pin "$t" "$py" "$here/torch_cifar.py" --threads "$t" \
          --batch "$batch" --steps "$steps" --warmup "$warmup" "${lrnflag[@]}" --device "$tdev")
    echo "round $r torch $p"
    echo "T $p" >>"$log"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
"$py" - "$log" "$sg" "$device" <<'PY'
import json, statistics, sys
runs = {"C": {}, "T": {}}
for line in open(sys.argv[1]):
    kind, js = line.split(" ", 1)
    d = json.loads(js)
    runs[kind].setdefault(d["threads"], []).append(d)
sg = json.loads(sys.argv[2])["sgemm_gflops"]
med = statistics.median
print()
print("threads  C img/s  torch img/s  C/torch (of medians)  C/torch (median of rounds)  C GFLOP/s  of SGEMM peak")
for t in sorted(runs["C"]):
    cs = [d["images_per_sec"] for d in runs["C"][t]]
    ts = [d["images_per_sec"] for d in runs["T"].get(t, [])] or [float("nan")]
    g = med(d["gflops"] for d in runs["C"][t])
    pr = [c / p for c, p in zip(cs, ts)]
    print(f"{t:7d}  {med(cs):7.1f}  {med(ts):11.1f}  {med(cs) / med(ts):20.2f}  {med(pr):26.2f}  "
          f"{g:9.1f}  {100 * g / (sg * t):5.1f}%")
    print(f"         C runs {[round(x) for x in cs]}  torch runs {[round(x) for x in ts]}")
print(f"SGEMM 1024^3 on 1 thread: {sg:.1f} GFLOP/s (peak above = that x threads)")
if sys.argv[3] == "gpu":
    cs = [d for t in runs["C"] for d in runs["C"][t]]
    ts = [d for t in runs["T"] for d in runs["T"][t]]
    print()
    print(f"GPU: {cs[0].get('device_name', '?')} (torch: {ts[0].get('device_name', '?')})")
    step, eager = med(d["ms_per_step"] for d in cs), med(d["ms_eager"] for d in cs)
    copies, synced = med(d["ms_copies"] for d in cs), med(d["ms_ops_synced"] for d in cs)
    print(f"C step (graph replay)            {step:8.3f} ms   torch step {med(d['ms_per_step'] for d in ts):8.3f} ms")
    print(f"C step, every op launched        {eager:8.3f} ms   -> launches cost {eager - step:6.3f} ms/step, saved by the graph")
    print(f"transfers alone, unoverlapped    {copies:8.3f} ms   (params + images up, grads down; overlapped in the step)")
    print(f"ops each timed with a wait       {synced:8.3f} ms   (GPU time + one launch and wait per op; upper bound on compute)")
PY
