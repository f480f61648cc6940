#!/usr/bin/env bash
# psplot end to end: a short real run of the CIFAR-10 example (synthetic
# data, 2 workers, psrun --local --telemetry), then psplot; both pictures
# must be real PNGs (signature, IHDR chunk) of exactly the size asked for.
# Then the metrics parser (docs/telemetry.md, "Metrics lines"): the run's
# metrics re-spaced as Python's json.dumps writes them, and with garbage
# lines between them, must give the very same picture; a subset of keys
# (no test_accuracy, no wall_s) plots what it can and names the missing
# keys and the file; a file with nothing to plot is a sentence and exit 2,
# never a gnuplot error; a missing gnuplot or jq is a sentence and exit 3.
# Last, the output rules: the pictures are 0600, and a symbolic link
# planted at one is refused naming it (exit 2), its target untouched.
# Usage: plot_test.sh BIN_DIR. Exits 77 (SKIP) when gnuplot or jq is
# missing (deploy/deps.sh installs both).
set -euo pipefail
bin=$1
for tool in gnuplot:gnuplot-nox jq:jq; do
  if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
    echo "SKIP: ${tool%%:*} is not installed (deploy/deps.sh installs ${tool#*:})"
    exit 77
  fi
done
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

# psplot ARGS... -> $out (stdout and stderr), $rc.
psplot() { out=$("$bin/psplot" "$@" 2>&1) && rc=0 || rc=$?; }
expect() { # rc text: psplot's last run exited rc and said text
  [ "$rc" -eq "$1" ] || { echo "FAIL: psplot exited $rc, expected $1: $out"; exit 1; }
  grep -qF -- "$2" <<<"$out" || { echo "FAIL: psplot did not say '$2': $out"; exit 1; }
}
no_gnuplot_errors() {
  if grep -qiE 'range is invalid|line [0-9]+:|all points y value undefined' <<<"$out"; then
    echo "FAIL: a gnuplot error reached the user: $out"; exit 1
  fi
}

# A missing jq is a sentence too.
mkdir fakebin
ln -s "$(command -v gnuplot)" fakebin/gnuplot
out=$(PATH=$dir/fakebin "$(command -v bash)" "$bin/psplot" --metrics m.jsonl 2>&1) && rc=0 || rc=$?
expect 3 "jq is not installed; install it (Debian: apt-get install jq)"

# The run's metrics, the reference picture (the same file name in every
# directory: the name is in the title).
[ "$(grep -c '"test_accuracy"' m.jsonl)" -ge 2 ] || { echo "FAIL: m.jsonl has no evaluations"; exit 1; }
mkdir ref spaced garbage subset nothing
cp m.jsonl ref/m.jsonl
psplot --metrics ref/m.jsonl --out ref --size 640x480
expect 0 "wrote ref/training.png"
check_png ref/training.png 640 480

# json.dumps spacing: {"step": 0, "loss": 2.5}; the same picture.
sed -e 's/":/": /g' -e 's/,"/, "/g' m.jsonl > spaced/m.jsonl
grep -q '"step": [0-9]' spaced/m.jsonl || { echo "FAIL: the spaced copy is not spaced"; exit 1; }
psplot --metrics spaced/m.jsonl --out spaced --size 640x480
expect 0 "wrote spaced/training.png"
if grep -q "no line of\|skipped" <<<"$out"; then echo "FAIL: spaced input lost keys: $out"; exit 1; fi
cmp -s ref/training.png spaced/training.png ||
  { echo "FAIL: json.dumps spacing gives another picture than cifar_worker's layout"; exit 1; }
echo "ok: json.dumps-spaced metrics give the same picture"

# Garbage lines between the records: skipped, counted, the same picture.
{ echo "training started"; sed -n 1p m.jsonl; echo '{"step": 3, "loss": '; echo
  sed -n '2,$p' m.jsonl; echo '[1, 2, 3]'; } > garbage/m.jsonl
psplot --metrics garbage/m.jsonl --out garbage --size 640x480
expect 0 "psplot: garbage/m.jsonl: skipped 3 line(s) that are not JSON objects (the first is line 1)"
cmp -s ref/training.png garbage/training.png ||
  { echo "FAIL: garbage lines changed the picture"; exit 1; }
echo "ok: garbage lines are skipped with a sentence"

# A subset of the keys, json.dumps-spaced: step and loss only.
printf '{"step": %d, "loss": %s}\n' 0 2.5 10 2.1 20 1.8 30 1.6 > subset/m.jsonl
psplot --metrics subset/m.jsonl --out subset --size 640x480
expect 0 'psplot: no line of subset/m.jsonl has a numeric "test_accuracy": leaving out the test-accuracy plots'
expect 0 'psplot: no line of subset/m.jsonl has a numeric "wall_s": leaving out the plots against wall time'
expect 0 'psplot: no line of subset/m.jsonl has a numeric "images_per_sec"'
no_gnuplot_errors
check_png subset/training.png 640 480
echo "ok: a subset of keys plots what it can and names what is missing"

# The servers' moving average (cifar_worker --average) is a second series
# in the test-accuracy panels: another picture than without it.
mkdir -p avg noavg
printf '{"step": %d, "wall_s": %d, "loss": 1, "test_accuracy": 0.%d}\n' 10 1 5 20 2 6 30 3 7 > noavg/m.jsonl
printf '{"step": %d, "wall_s": %d, "loss": 1, "test_accuracy": 0.%d, "test_accuracy_average": 0.%d}\n' \
  10 1 5 6 20 2 6 7 30 3 7 8 > avg/m.jsonl
psplot --metrics noavg/m.jsonl --out noavg --size 640x480
expect 0 ""
psplot --metrics avg/m.jsonl --out avg --size 640x480
expect 0 ""
no_gnuplot_errors
check_png avg/training.png 640 480
cmp -s avg/training.png noavg/training.png &&
  { echo "FAIL: test_accuracy_average drew nothing more"; exit 1; }
echo "ok: the moving average is drawn beside the test accuracy"

# Nothing to plot: a sentence and exit 2, no picture.
printf '{"step": %d, "epoch": 0.5}\n' 1 2 > nothing/m.jsonl
psplot --metrics nothing/m.jsonl --out nothing --size 640x480
expect 2 'psplot: nothing to plot from nothing/m.jsonl: no line has a numeric "loss", "test_accuracy" or "images_per_sec"'
no_gnuplot_errors
printf '{"loss": %s}\n' 2.5 2.0 > nothing/m.jsonl
psplot --metrics nothing/m.jsonl --out nothing --size 640x480
expect 2 'psplot: nothing to plot from nothing/m.jsonl: no line has a numeric "step" or "wall_s" to plot against'
printf 'not json\n\n' > nothing/m.jsonl
psplot --metrics nothing/m.jsonl --out nothing --size 640x480
expect 2 "psplot: --metrics nothing/m.jsonl holds no JSON objects"
no_gnuplot_errors
[ ! -e nothing/training.png ] || { echo "FAIL: a picture was written with nothing to plot"; exit 1; }
echo "ok: nothing to plot is a sentence and exit 2"

# Output files (docs/security.md, "Output files"): the pictures are 0600,
# and a symbolic link planted at one (--metrics: training.png,
# --telemetry: breakdown.png) is refused with exit 2, naming it; the file
# it points to is untouched.
for f in pics/training.png pics/breakdown.png; do
  [ "$(stat -c %a "$f")" = 600 ] || { echo "FAIL: $f is mode $(stat -c %a "$f"), not 600"; exit 1; }
done
mkdir planted
for pic in training:--metrics:m.jsonl breakdown:--telemetry:tel; do
  IFS=: read -r name opt arg <<<"$pic"
  echo victim > planted/victim
  ln -sfn "$dir/planted/victim" "planted/$name.png"
  psplot "$opt" "$arg" --out planted --size 640x480
  expect 2 "psplot: planted/$name.png: is a symbolic link to $dir/planted/victim; refusing to write through it"
  [ "$(cat planted/victim)" = victim ] && [ -L "planted/$name.png" ] ||
    { echo "FAIL: psplot wrote $name.png through a planted link"; exit 1; }
done
echo "ok: the pictures are 0600; a planted link is refused, named, and its target untouched"
