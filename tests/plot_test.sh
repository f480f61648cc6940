#!/usr/bin/env bash
# psplot end to end: a short real run of the CIFAR-10 example (synthetic
# data, 2 workers, psrun --local --telemetry), then psplot; both pictures
# must be real PNGs (signature, IHDR chunk) of exactly the size asked for.
# Usage: plot_test.sh BIN_DIR. Exits 77 (SKIP) when gnuplot is missing.
set -euo pipefail
bin=$1
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "SKIP: gnuplot is not installed (deploy/deps.sh installs gnuplot-nox)"
  exit 77
fi
dir=$(mktemp -d "${TMPDIR:-/tmp}/plot_test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
cd "$dir"
"$bin/cifar_synth" --out synth --train 1280 --test 200 --seed 5 >/dev/null
"$bin/psrun" --local -n 3 --ps 1 --telemetry tel -- "$bin/cifar_worker" --data synth \
  --steps 20 --batch 16 --threads 1 --eval-every 5 --metrics m.jsonl > run.out 2>&1 ||
  { cat run.out; echo "FAIL: the training run failed"; exit 1; }
grep -q "straggler:" run.out || { cat run.out; echo "FAIL: psrun printed no summary"; exit 1; }
[ "$(grep -c '"type":"worker"' tel.w0)" -eq 20 ] || { echo "FAIL: tel.w0 lacks 20 records"; exit 1; }
[ "$(grep -c '"type":"ps"' tel.ps0)" -eq 20 ] || { echo "FAIL: tel.ps0 lacks 20 records"; exit 1; }

# A missing gnuplot is a clear message, not a crash.
out=$(PATH=/nonexistent "$(command -v bash)" "$bin/psplot" --metrics m.jsonl 2>&1) && rc=0 || rc=$?
[ "$rc" -eq 3 ] && grep -q "gnuplot is not installed" <<<"$out" ||
  { echo "FAIL: without gnuplot psplot said (rc $rc): $out"; exit 1; }
"$bin/psplot" --metrics m.jsonl --telemetry tel --out pics --size 640x480

check_png() { # file width height
  local f=$1
  [ -s "$f" ] || { echo "FAIL: $f was not written"; exit 1; }
  local sig ihdr w h
  sig=$(od -An -tx1 -N8 "$f" | tr -d ' \n')
  [ "$sig" = "89504e470d0a1a0a" ] || { echo "FAIL: $f is not a PNG (signature $sig)"; exit 1; }
  ihdr=$(od -An -c -j12 -N4 "$f" | tr -d ' \n')
  [ "$ihdr" = "IHDR" ] || { echo "FAIL: $f has no IHDR chunk first ($ihdr)"; exit 1; }
  w=$((16#$(od -An -tx1 -j16 -N4 "$f" | tr -d ' \n')))
  h=$((16#$(od -An -tx1 -j20 -N4 "$f" | tr -d ' \n')))
  [ "$w" -eq "$2" ] && [ "$h" -eq "$3" ] ||
    { echo "FAIL: $f is ${w}x${h}, expected $2x$3"; exit 1; }
  echo "ok: $f is a ${w}x${h} PNG ($(stat -c %s "$f") bytes)"
}
check_png pics/training.png 640 480
check_png pics/breakdown.png 640 480
