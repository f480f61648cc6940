#!/usr/bin/env bash
# The workers' step time while psd checkpoints a big shard onto a slow
# disk: ps_bench, 2 workers, 1 ps, one variable of SIZE, run without
# checkpoints and with --checkpoint-every EVERY onto a disk that the
# slowdown shim (tests/slowdown.c) makes take MS per write and per fsync of
# a checkpoint file (psd writes in 1 MiB chunks: a 1 GiB file then needs
# about 1024 x MS). Prints the median and the slowest timed step of each
# run, for every psd binary given (e.g. an older build's, then this one's),
# so the figures compare within one run.
#
#   deploy/bench/ckpt_stall.sh BUILD_DIR [PSD...]
#
# BUILD_DIR: a build with bin/ps_bench and lib/libslowdown.so (the tests).
# Environment: SIZE (1G), STEPS (16), EVERY (4), MS (10).
set -euo pipefail
build=$(cd "$1" && pwd)
shift
psds=("$@")
[ ${#psds[@]} -gt 0 ] || psds=("$build/bin/psd")
shim="$build/lib/libslowdown.so"
[ -f "$shim" ] || { echo "ckpt_stall: no $shim (build the tests)" >&2; exit 2; }
size=${SIZE:-1G}; steps=${STEPS:-16}; every=${EVERY:-4}; ms=${MS:-10}
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
field() { sed -n "s/.*\"$1\":\([0-9.]*\).*/\1/p"; }
printf '%-40s %-16s %12s %12s\n' psd run "p50 step ms" "max step ms"
for psd in "${psds[@]}"; do
  for run in plain checkpoint; do
    # psd exits only once the checkpoints it accepted are on the slow disk.
    args=(--psd "$psd" --rounds 1 --sizes "$size" --workers 2 --steps "$steps" --json --no-pin
          --psd-exit-wait 600)
    if [ $run = checkpoint ]; then
      rm -rf "$out/ck"
      args+=(--psd-arg=--checkpoint-dir "--psd-arg=$out/ck" --psd-arg=--checkpoint-every
             "--psd-arg=$every")
    fi
    line=$(LD_PRELOAD="$shim" PS_SLOW_DISK_MS="$ms" "$build/bin/ps_bench" "${args[@]}" \
             2>"$out/err" | grep '"name":"pushpull"' || true)
    [ -n "$line" ] || { cat "$out/err" >&2; echo "ckpt_stall: $psd $run failed" >&2; exit 1; }
    printf '%-40s %-16s %12s %12s\n' "$psd" "$run" "$(echo "$line" | field step_ms)" \
      "$(echo "$line" | field max_step_ms)"
  done
done
