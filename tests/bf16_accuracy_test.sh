#!/usr/bin/env bash
# bf16_accuracy_test.sh BIN_DIR - deploy/bench/bf16_accuracy.sh end to end on
# a small synthetic CIFAR-10 (cifar_synth): two seeds x float32 and bf16,
# a few steps each, through psrun. Checks the script's report: a row per
# seed with both accuracies, the per-seed differences, and the mean with
# its interval and verdict. (The accuracy figure itself needs the real
# data set and is in docs/measured.md, with the command.)
set -euo pipefail
bin=$(cd "$1" && pwd)
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
"$bin/cifar_synth" --out "$dir/synth" --train 512 --test 64 --seed 3 >/dev/null
out=$(DATA="$dir/synth" STEPS=4 SEEDS="1 2" THREADS=1 bash "$root/deploy/bench/bf16_accuracy.sh" "$bin" 2>"$dir/err") ||
  { echo "FAIL: the script failed"; cat "$dir/err"; exit 1; }
echo "$out"
fail() { echo "FAIL: $*"; exit 1; }
grep -Eq '^1 +[0-9.]+% +[0-9.]+%$' <<<"$out" || fail "no row for seed 1"
grep -Eq '^2 +[0-9.]+% +[0-9.]+%$' <<<"$out" || fail "no row for seed 2"
grep -Eq '^bf16 - f32 per seed: [-+][0-9.]+, [-+][0-9.]+$' <<<"$out" || fail "no per-seed differences"
grep -Eq '^bf16 - f32: mean [-+][0-9.]+ points, 95% interval \[[-+][0-9.]+, [-+][0-9.]+\] over 2 seeds: (within|NOT within|not resolved)' <<<"$out" ||
  fail "no mean, interval and verdict"
[ "$(grep -c 'training with --wire-dtype' "$dir/err")" = 4 ] || fail "not 4 runs: $(cat "$dir/err")"
echo "PASS: bf16_accuracy.sh"
