#!/usr/bin/env bash
# deploy/run-main.sh as documented, on a tiny synthetic data set (never the
# real CIFAR-10): stdout must be exactly one line, a JSON object with the
# README's keys (test_accuracy, images_per_sec, steps, epochs, wall_s) and
# the steps asked for, so `run-main.sh | jq .` works; the logs -- psd's,
# the workers', the other worker's result line and the telemetry summary --
# go to stderr. A failing run leaves stdout empty and exits non-zero with a
# sentence; SIGTERM to the script stops the job through psrun.
# Usage: run_main_test.sh BIN_DIR SOURCE_DIR. Exits 77 (SKIP) without jq.
set -euo pipefail
bin=$1
src=$2
command -v jq >/dev/null 2>&1 ||
  { echo "SKIP: jq is not installed (deploy/deps.sh installs it)"; exit 77; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/run_main_test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; echo "--- stdout:"; cat "$dir/stdout"; echo "--- stderr:"; cat "$dir/stderr"; exit 1; }
"$bin/cifar_synth" --out "$dir/synth" --train 640 --test 100 --seed 9 >/dev/null

RUN_MAIN_BIN=$bin bash "$src/deploy/run-main.sh" "$dir/synth" --steps 8 --batch 16 --threads 1 \
  > "$dir/stdout" 2> "$dir/stderr" || fail "run-main.sh exited $?"
[ "$(wc -l < "$dir/stdout")" -eq 1 ] || fail "stdout is not exactly one line"
jq -e . "$dir/stdout" >/dev/null || fail "stdout is not JSON"
jq -e 'type == "object"
       and (.test_accuracy | type == "number") and .test_accuracy >= 0 and .test_accuracy <= 1
       and (.images_per_sec | type == "number") and .images_per_sec > 0
       and .steps == 8 and (.epochs | type == "number") and (.wall_s | type == "number")
       and .workers == 2 and .batch == 16' "$dir/stdout" >/dev/null ||
  fail "the result line lacks the expected keys and values"
grep -q '^\[w1\] {' "$dir/stderr" || fail "the other worker's result line is not on stderr"
grep -q 'psd telemetry summary' "$dir/stderr" || fail "the telemetry summary is not on stderr"
grep -q "run-main: training on $dir/synth" "$dir/stderr" || fail "no 'training on' line on stderr"
# The documented pipeline itself.
RUN_MAIN_BIN=$bin bash "$src/deploy/run-main.sh" "$dir/synth" --steps 2 --batch 16 --threads 1 \
  2>/dev/null | jq -e .steps > "$dir/steps" || fail "run-main.sh | jq failed"
[ "$(cat "$dir/steps")" = 2 ] || fail "run-main.sh | jq .steps gave $(cat "$dir/steps")"
echo "ok: stdout is one JSON line: $(cat "$dir/stdout")"

# A failing run: nothing on stdout, a non-zero status, a sentence.
rc=0
RUN_MAIN_BIN=$bin bash "$src/deploy/run-main.sh" "$dir/synth" --steps 2 --batch 0 \
  > "$dir/stdout" 2> "$dir/stderr" || rc=$?
[ "$rc" -ne 0 ] || fail "a run with --batch 0 succeeded"
[ ! -s "$dir/stdout" ] || fail "a failed run wrote to stdout"
grep -q "run-main: the training job failed (psrun exited $rc)" "$dir/stderr" ||
  fail "a failed run did not say so"
rc=0
RUN_MAIN_BIN=$bin bash "$src/deploy/run-main.sh" "$dir/nonexistent" \
  > "$dir/stdout" 2> "$dir/stderr" || rc=$?
[ "$rc" -eq 2 ] && [ ! -s "$dir/stdout" ] || fail "a missing data directory: rc $rc"
grep -q "data directory '$dir/nonexistent' does not exist" "$dir/stderr" ||
  fail "a missing data directory is not named"
echo "ok: failures leave stdout empty and say why"

# SIGTERM to the script reaches psrun: the job stops at once, stdout empty.
RUN_MAIN_BIN=$bin bash "$src/deploy/run-main.sh" "$dir/synth" --steps 1000000 --batch 16 \
  --threads 1 > "$dir/stdout" 2> "$dir/stderr" &
script=$!
for _ in $(seq 300); do
  grep -q 'w1 step' "$dir/stderr" && break
  sleep 0.1
done
grep -q 'w1 step' "$dir/stderr" || fail "the long run never reported a step"
kill -TERM "$script"
rc=0
timeout 30 tail --pid="$script" -f /dev/null || fail "run-main.sh did not stop within 30 s of SIGTERM"
wait "$script" || rc=$?
[ "$rc" -eq 143 ] || fail "after SIGTERM run-main.sh exited $rc, expected 143 (psrun's status)"
[ ! -s "$dir/stdout" ] || fail "a stopped run wrote to stdout"
grep -q 'received SIGTERM; stopping all tasks' "$dir/stderr" || fail "psrun never got the SIGTERM"
echo "ok: SIGTERM is passed on to psrun"
