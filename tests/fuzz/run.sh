#!/usr/bin/env bash
# Runs every libFuzzer target of a PS_FUZZ build for a bounded time:
#
#   tests/fuzz/run.sh BUILD_DIR SECONDS [TARGET...]
#
# Each target fuzzes for SECONDS (-max_total_time) from a copy of its seed
# corpus (tests/fuzz/corpus/TARGET) in a temporary directory, so the
# repository is never modified. Prints per target the executions and the
# result, then a final line `fuzz: N passed, M failed`; exits non-zero if
# any target found a crash, a leak, a timeout (-timeout=10) or ran out of
# memory (-rss_limit_mb=2048). The reproducer and the log of a failure are
# kept under BUILD_DIR/fuzz-artifacts/.
#
# Environment: FUZZ_KEEP=DIR keeps the grown corpora and logs in DIR;
# FUZZ_ARGS adds libFuzzer options (e.g. "-jobs=2 -workers=2").
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR SECONDS [TARGET...]" >&2
  exit 2
fi
build=$(cd "$1" && pwd) || exit 2
secs=$2
shift 2
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_frame fuzz_conn fuzz_handshake fuzz_ckpt fuzz_rdv)
case "$secs" in '' | *[!0-9]*) echo "fuzz: SECONDS must be a whole number" >&2; exit 2 ;; esac

work=${FUZZ_KEEP:-}
if [ -n "$work" ]; then mkdir -p "$work"; else work=$(mktemp -d "${TMPDIR:-/tmp}/psd-fuzz.XXXXXX"); trap 'rm -rf "$work"' EXIT; fi
arts="$build/fuzz-artifacts"

passed=0
failed=0
total=0
for t in "${targets[@]}"; do
  bin="$build/bin/$t"
  if [ ! -x "$bin" ]; then
    echo "$t: FAILED (no $bin: configure with CC=clang cmake -B build-fuzz -DPS_FUZZ=ON and build the fuzz target)"
    failed=$((failed + 1))
    continue
  fi
  corpus="$work/corpus/$t"
  mkdir -p "$corpus" "$work/artifacts/$t"
  cp "$here/corpus/$t/"* "$corpus/" 2>/dev/null || true
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  log="$work/$t.log"
  start=$(date +%s)
  # shellcheck disable=SC2086
  (cd "$work" && "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/$t/" "${dict[@]}" \
    ${FUZZ_ARGS:-} "$corpus") >"$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  execs=$(grep -a '^stat::number_of_executed_units:' "$log" | awk '{s += $2} END {print s + 0}')
  if [ "$execs" = 0 ]; then # no final stats (killed hard): the last status line
    execs=$(grep -ao '^#[0-9]*' "$log" | tail -1 | tr -d '#')
    execs=${execs:-0}
  fi
  total=$((total + execs))
  cov=$(grep -ao 'cov: [0-9]*' "$log" | tail -1 | awk '{print $2}')
  corp=$(find "$corpus" -type f | wc -l)
  found=$(find "$work/artifacts/$t" -type f | head -1)
  if [ $rc -eq 0 ] && [ -z "$found" ]; then
    echo "$t: $execs executions in ${took} s, passed (coverage ${cov:-?} edges, corpus $corp inputs)"
    passed=$((passed + 1))
  else
    kind="exit status $rc"
    case "$(basename "${found:-none}")" in
      crash-*) kind=crash ;; leak-*) kind=leak ;; timeout-*) kind=timeout ;;
      oom-*) kind="out of memory" ;; slow-unit-*) kind="slow input" ;;
    esac
    mkdir -p "$arts"
    keep=""
    if [ -n "$found" ]; then
      keep="$arts/${t}-$(basename "$found")"
      cp "$found" "$keep"
    fi
    cp "$log" "$arts/$t.log"
    echo "$t: $execs executions in ${took} s, FAILED ($kind)${keep:+; reproducer $keep}; log $arts/$t.log"
    grep -a -m1 -E 'ERROR: |SUMMARY: |check failed|malformed frame|neither read nor closed' "$log" | sed "s/^/$t:   /"
    echo "$t:   reproduce: $bin ${keep:-INPUT}   (FUZZ_FRESH=1: a fresh psd for the input)"
    failed=$((failed + 1))
  fi
done
echo "fuzz: $total executions in all"
echo "fuzz: $passed passed, $failed failed"
[ $failed -eq 0 ]
