#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the CIFAR-10
# CNN on this machine with 1 parameter server and 2 workers (psrun --local),
# 2 x 64 images per step (global batch 128), learning rate 0.1.
#
#   bash deploy/run-main.sh [DATA_DIR] [cifar_worker options...]
#
# Data: DATA_DIR if given; else the first of ./data/cifar-10-batches-bin
# (examples/cifar10/download.sh puts it there), ../shared/cifar10,
# ~/data/cifar-10-batches-bin; else a synthetic data set in the same format
# (made by cifar_synth), and it says so. EPOCHS (default 1) sets the length.
#
# Output: everything it logs -- the build, psd's and the workers' lines,
# each worker's result line, the telemetry summary -- goes to stderr; stdout
# carries exactly one line, last: the chief's JSON result
#   {"test_accuracy":...,"images_per_sec":...,"steps":...,"epochs":...,"wall_s":...,
#    "workers":...,"batch":...,"loss":...}
# so `bash deploy/run-main.sh | jq .` works (tests/run_main_test.sh). On
# failure stdout stays empty and the exit status is psrun's (or 1).
# RUN_MAIN_BIN=DIR uses the programs already built in DIR and skips the
# set-up and build (the test does).
set -euo pipefail

data=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  data=$1
  shift
  [ -d "$data" ] || { echo "run-main: data directory '$data' does not exist;" \
    "give the directory holding data_batch_1.bin ... test_batch.bin" >&2; exit 2; }
  data=$(cd "$data" && pwd) # the script runs from the repository root
fi
cd "$(dirname "$0")/.."
if [ -n "${RUN_MAIN_BIN:-}" ]; then
  bin=$RUN_MAIN_BIN
  [ -x "$bin/psrun" ] && [ -x "$bin/cifar_worker" ] ||
    { echo "run-main: RUN_MAIN_BIN=$bin holds no psrun and cifar_worker; build them" \
           "(bash deploy/build.sh) or unset RUN_MAIN_BIN" >&2; exit 2; }
else
  bash deploy/build.sh >&2
  bin=build/bin
fi

if [ -z "$data" ]; then
  for d in data/cifar-10-batches-bin ../shared/cifar10 "$HOME/data/cifar-10-batches-bin"; do
    if [ -f "$d/data_batch_1.bin" ]; then
      data=$d
      break
    fi
  done
fi
if [ -z "$data" ]; then
  echo "run-main: no CIFAR-10 found (looked in ./data/cifar-10-batches-bin, ../shared/cifar10," \
       "~/data/cifar-10-batches-bin); training on SYNTHETIC data instead." \
       "Get the real data with: bash examples/cifar10/download.sh data" >&2
  "$bin/cifar_synth" --out build/synth-cifar10 --train 10000 --test 2000 >&2
  data=build/synth-cifar10
fi
echo "run-main: training on $data" >&2

# psrun's stdout (each worker's result line, "[wN] {...}", and the
# telemetry summary) goes to a file, shown on stderr when the job ends; the
# workers' and psd's logs reach stderr directly. SIGTERM, SIGUSR1 and SIGHUP
# sent to this script are passed on to psrun (Ctrl-C reaches it directly).
out=$(mktemp "${TMPDIR:-/tmp}/run-main.XXXXXX")
trap 'rm -f "$out"' EXIT
"$bin/psrun" --local -n 3 --ps 1 -- "$bin/cifar_worker" --data "$data" \
  --epochs "${EPOCHS:-1}" --batch 64 --lr 0.1 "$@" > "$out" &
psrun=$!
for sig in TERM USR1 HUP; do
  trap 'kill -'$sig' "$psrun" 2>/dev/null || true' "$sig"
done
trap ':' INT
rc=0
while :; do
  wait "$psrun" && rc=0 || rc=$?
  kill -0 "$psrun" 2>/dev/null || break # reaped: rc is its status
done
cat "$out" >&2
if [ "$rc" -ne 0 ]; then
  echo "run-main: the training job failed (psrun exited $rc); the lines above say why" >&2
  exit "$rc"
fi
result=$(sed -n 's/^\[w0\] \({.*}\)$/\1/p' "$out" | tail -n 1)
if [ -z "$result" ]; then
  echo "run-main: the chief (w0) printed no JSON result line although the job succeeded;" \
       "its output is above" >&2
  exit 1
fi
printf '%s\n' "$result"
