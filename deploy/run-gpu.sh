#!/usr/bin/env bash
# run-gpu.sh - the first run of the CUDA backend on a GPU machine, from the
# bundle deploy/gpu-bundle.sh packs (this file is its run-gpu.sh):
#
#   tar xzf psd-gpu-bundle.tar.gz
#   psd-gpu-bundle/run-gpu.sh [--data DIR | --synthetic] [--results DIR] > summary.json
#
# Steps, in order, each timed and bounded by `timeout`:
#   cuda_gpu_tests  every GPU op and a short training run against the CPU backend
#   memcheck        compute-sanitizer --tool memcheck over cuda_gpu_tests
#   synccheck       compute-sanitizer --tool synccheck over cuda_gpu_tests
#   cnn_bench       cnn_bench --device gpu, batch 128, ROUNDS runs: median img/s
#   cnn_profile     cnn_bench --device gpu --profile: the per-op breakdown (log)
#   torch           the same network in PyTorch, eager fp32 on the same GPU,
#                   batch 128, ROUNDS runs: median img/s
#   train           10 epochs of CIFAR-10 through psrun --local (1 ps, 1 GPU
#                   worker, batch 128, lr 0.1 decayed x0.1 at epoch 6): accuracy
#
# Output: stdout is ONE JSON document, the summary (also written to
# RESULTS/summary.json): "status", "exit_status", "reason", "gpu", "figures"
# (gpu_images_per_sec, torch_images_per_sec, gpu_over_torch -- the target is
# >= 2 --, test_accuracy, memcheck_errors, synccheck_errors) and "steps"
# (per step: status, seconds, exit, reason, log, figures). Progress lines
# and each step's verdict go to stderr; each step's full output to
# RESULTS/<step>.log.
#
# Step status: passed, failed (non-zero exit, a GPU test skipped on a GPU
# machine, an error count, accuracy under MIN_ACCURACY), timeout,
# unavailable (compute-sanitizer, PyTorch or the data not found: recorded,
# never counted as a pass), not_run (no GPU).
#
# Exit status:
#   0  every step passed
#   1  a step failed or timed out (the summary says which, and why), or
#      the run was stopped by SIGINT or SIGTERM
#   2  usage error, or the bundle is damaged (a file missing or differing
#      from SHA256SUMS): nothing was run. A program that cannot load here
#      (a library missing, glibc older than MANIFEST's glibc_needed) fails
#      the steps that use it (exit 1), with the loader's message.
#   3  no GPU: nvidia-smi missing, failing (driver error), listing no GPU,
#      or CUDA_VISIBLE_DEVICES hiding them all; nothing was measured
#   4  incomplete: no step failed, but one could not run (unavailable) or
#      was not chosen (--only)
#
# Options: --data DIR (CIFAR-10 binary files: data_batch_1..5.bin,
# test_batch.bin; default: DATA, else ./cifar10, ~/shared/cifar10,
# ~/data/cifar-10-batches-bin, ~/cifar-10-batches-bin), --synthetic (train
# on cifar_synth's data instead: checks the worker path; its classes are
# easy, so the accuracy must still reach MIN_SYNTH_ACCURACY: chance, 0.1,
# means the evaluation is broken), --results DIR (default ./gpu-run-DATE), --epochs N (10),
# --only STEP,STEP... (run only those steps, e.g. --only cnn_bench,torch).
# Environment: PYTHON (python3), NVIDIA_SMI (nvidia-smi), COMPUTE_SANITIZER
# (found on PATH, $CUDA_HOME/bin, /usr/local/cuda/bin), SANITIZER_ARGS,
# BATCH (128), STEPS (200 timed steps per benchmark run), WARMUP (20),
# ROUNDS (3), MIN_ACCURACY (0.65 on real data; the CPU backend reaches
# 0.726 with this recipe), MIN_SYNTH_ACCURACY (0.5 with --synthetic; 40
# CPU steps pass 0.5, this recipe runs 782), timeouts in seconds T_TESTS (900),
# T_SANITIZER (3600 each), T_BENCH (600 per run), T_TRAIN (5400).
set -uo pipefail

EXIT_OK=0       # every step passed
EXIT_FAILED=1   # a step failed or timed out
EXIT_USAGE=2    # bad option, damaged bundle, or it cannot run here
EXIT_NO_GPU=3   # no usable GPU visible: nothing measured
EXIT_PARTIAL=4  # nothing failed, but a step could not run
TARGET_RATIO=2  # GPU img/s over PyTorch eager fp32 img/s that issue 18 asks for
SMI_TIMEOUT=60  # seconds nvidia-smi gets; a hung driver must not hang the run

here=$(cd "$(dirname "$0")" && pwd)
STEPS_ORDER=(cuda_gpu_tests memcheck synccheck cnn_bench cnn_profile torch train)
declare -A ST SECS RC REASON FIGS LOGF LOADERR
for s in "${STEPS_ORDER[@]}"; do
  ST[$s]=not_run SECS[$s]=0 RC[$s]=null REASON[$s]="" FIGS[$s]="" LOGF[$s]=""
done
STATUS="" TOP_REASON="" GPU_JSON=null TOP_FIGS="" RESULTS=""

say() { printf 'run-gpu: %s\n' "$*" >&2; }
usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
}

# ------------------------------------------------------------------ JSON

# A JSON string of $1: printable ASCII only (log lines may hold anything).
jstr() {
  local s
  s=$(printf '%s' "$1" | LC_ALL=C tr '\t\n\r' '   ' | LC_ALL=C tr -cd '\40-\176')
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  printf '"%s"' "$s"
}
is_num() { [[ $1 =~ ^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$ ]]; }
jnum() { if is_num "${1:-}"; then printf '%s' "$1"; else printf 'null'; fi; }
# The number KEY holds in the one-line JSON object $1 (empty if none).
# Whitespace is allowed around the colon: cnn_bench and cifar_worker print
# "key":value, Python's json.dumps (torch_cifar.py) "key": value.
jget() {
  local re="\"$2\"[[:space:]]*:[[:space:]]*(-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?)"
  [[ $1 =~ $re ]] && printf '%s' "${BASH_REMATCH[1]}"
}
# A flat one-line JSON object of numbers, plain strings and booleans: what
# cnn_bench and torch_cifar.py print (with or without json.dumps' spaces).
# Anything else (nan, a stray message) is kept as a string, so the summary
# stays valid JSON.
FLAT_RE='^\{[[:space:]]*("[A-Za-z0-9_]+"[[:space:]]*:[[:space:]]*(-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?|"[^"\\]*"|true|false|null)[[:space:]]*(,[[:space:]]*|\}$))+$'
jobj() { if [[ $1 =~ $FLAT_RE ]]; then printf '%s' "$1"; else jstr "$1"; fi; }
addfig() { FIGS[$1]+="${FIGS[$1]:+,}\"$2\":$3"; } # step key json-value
median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END{if(NR) print (NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2)}'; }
now() { if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s.%N; fi; }

write_summary() { # the one JSON document: stdout and RESULTS/summary.json
  local doc first=1 s manifest="" k v
  if [ -f "$here/MANIFEST" ]; then
    while IFS='=' read -r k v; do
      [[ $k =~ ^[a-z_]+$ ]] || continue
      manifest+="${manifest:+,}\"$k\":$(jstr "$v")"
    done < "$here/MANIFEST"
  fi
  doc="{\"status\":$(jstr "$STATUS"),\"exit_status\":$1,\"reason\":$(jstr "$TOP_REASON")"
  doc+=",\"host\":$(jstr "$(hostname 2>/dev/null || echo unknown)")"
  doc+=",\"glibc\":$(jstr "$(getconf GNU_LIBC_VERSION 2>/dev/null)"),\"cublas\":$(jstr "${CUBLAS:-}")"
  doc+=",\"started\":$(jstr "$STARTED"),\"results_dir\":$(jstr "$RESULTS")"
  local le=""
  for k in "${!LOADERR[@]}"; do le+="${le:+,}$(jstr "${LOADERR[$k]}")"; done
  doc+=",\"load_errors\":[$le]"
  doc+=",\"bundle\":{$manifest},\"gpu\":$GPU_JSON,\"figures\":{$TOP_FIGS},\"steps\":{"
  for s in "${STEPS_ORDER[@]}"; do
    [ $first = 1 ] || doc+=","
    first=0
    doc+="\"$s\":{\"status\":\"${ST[$s]}\",\"seconds\":$(jnum "${SECS[$s]}"),\"exit\":${RC[$s]}"
    doc+=",\"reason\":$(jstr "${REASON[$s]}"),\"log\":$(jstr "${LOGF[$s]}"),\"figures\":{${FIGS[$s]}}}"
  done
  doc+="}}"
  [ -n "$RESULTS" ] && [ -d "$RESULTS" ] && printf '%s\n' "$doc" > "$RESULTS/summary.json"
  printf '%s\n' "$doc"
}
finish() { # finish EXIT_STATUS STATUS REASON
  STATUS=$2 TOP_REASON=$3
  write_summary "$1"
  say "$2${3:+: $3} (exit $1)${RESULTS:+; summary and logs in $RESULTS}"
  exit "$1"
}

# --------------------------------------------------------------- options

STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
DATA_DIR=${DATA:-} SYNTH=0 EPOCHS=10 ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --data) [ $# -ge 2 ] || { usage; finish $EXIT_USAGE error "--data needs a directory"; }
            DATA_DIR=$2; shift 2 ;;
    --synthetic) SYNTH=1; shift ;;
    --only) [ $# -ge 2 ] || finish $EXIT_USAGE error "--only needs a list of steps"
            ONLY=$2; shift 2
            for o in ${ONLY//,/ }; do
              [[ " ${STEPS_ORDER[*]} " == *" $o "* ]] ||
                finish $EXIT_USAGE error "--only: no step '$o' (steps: ${STEPS_ORDER[*]})"
            done ;;
    --results) [ $# -ge 2 ] || finish $EXIT_USAGE error "--results needs a directory"
               RESULTS=$2; shift 2 ;;
    --epochs) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]{0,3}$ ]] ||
                finish $EXIT_USAGE error "--epochs needs a whole number from 1 to 9999"
              EPOCHS=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage; finish $EXIT_USAGE error "unknown option '$1' (run-gpu.sh --help)" ;;
  esac
done
PYTHON=${PYTHON:-python3}
BATCH=${BATCH:-128} STEPS=${STEPS:-200} WARMUP=${WARMUP:-20} ROUNDS=${ROUNDS:-3}
MIN_ACCURACY=${MIN_ACCURACY:-0.65} MIN_SYNTH_ACCURACY=${MIN_SYNTH_ACCURACY:-0.5}
T_TESTS=${T_TESTS:-900} T_SANITIZER=${T_SANITIZER:-3600} T_BENCH=${T_BENCH:-600}
T_TRAIN=${T_TRAIN:-5400}
for v in BATCH STEPS WARMUP ROUNDS T_TESTS T_SANITIZER T_BENCH T_TRAIN; do
  [[ ${!v} =~ ^[1-9][0-9]{0,6}$ ]] || finish $EXIT_USAGE error "$v must be a positive whole number, got '${!v}'"
done
is_num "$MIN_ACCURACY" || finish $EXIT_USAGE error "MIN_ACCURACY must be a number, got '$MIN_ACCURACY'"
is_num "$MIN_SYNTH_ACCURACY" ||
  finish $EXIT_USAGE error "MIN_SYNTH_ACCURACY must be a number, got '$MIN_SYNTH_ACCURACY'"
RESULTS=${RESULTS:-$PWD/gpu-run-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS" || { r=$RESULTS; RESULTS=""; finish $EXIT_USAGE error "cannot create $r"; }
RESULTS=$(cd "$RESULTS" && pwd)

# ------------------------------------------------- can the bundle run here

BIN=$here/bin
OURS_LD="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OURS=(env "LD_LIBRARY_PATH=$OURS_LD") # runs our programs with the bundle's libraries

preflight() {
  local t p missing
  for t in timeout awk sort; do
    command -v "$t" >/dev/null 2>&1 || finish $EXIT_USAGE error "'$t' is not installed on this machine"
  done
  for p in cuda_gpu_tests cnn_bench cifar_worker cifar_synth psd psrun; do
    [ -x "$BIN/$p" ] || finish $EXIT_USAGE error "the bundle lacks bin/$p (unpack all of it)"
  done
  if [ -f "$here/SHA256SUMS" ] && command -v sha256sum >/dev/null 2>&1; then
    local bad
    bad=$(cd "$here" && sha256sum --quiet -c SHA256SUMS 2>&1 | sed -n 's/: FAILED.*//p' | tr '\n' ' ')
    [ -z "$bad" ] || finish $EXIT_USAGE error "the bundle is damaged (${bad% }: not as in SHA256SUMS); copy it again"
  fi
  # A program that cannot load here (a library missing, or newer than
  # this machine's glibc: Debian's libevent, which psd links, needs 2.36)
  # fails the steps that use it, with the loader's words; the rest still run.
  if command -v ldd >/dev/null 2>&1; then
    for p in "$BIN"/*; do
      missing=$("${OURS[@]}" ldd "$p" 2>&1 | grep -E 'not found|No such file|error while loading' |
                tr -s ' \t\n' ' ')
      [ -z "$missing" ] || LOADERR[${p##*/}]="bin/${p##*/} cannot load here:$missing"
    done
  fi
}
preflight

# ------------------------------------------------------------ is there a GPU

no_gpu() { # every step stays not_run
  for s in "${STEPS_ORDER[@]}"; do REASON[$s]="no GPU"; done
  finish $EXIT_NO_GPU no_gpu "no GPU: $1; nothing was run or measured"
}
probe_gpu() {
  local smi=${NVIDIA_SMI:-nvidia-smi} out rc lines
  command -v "$smi" >/dev/null 2>&1 ||
    no_gpu "nvidia-smi not found ('$smi' is not on PATH: no NVIDIA driver installed here?)"
  out=$(timeout -k 5 "$SMI_TIMEOUT" "$smi" --query-gpu=index,name,driver_version,memory.total \
          --format=csv,noheader 2>&1)
  rc=$?
  [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] ||
    no_gpu "nvidia-smi did not answer within $SMI_TIMEOUT s (driver hung?)"
  [ "$rc" -eq 0 ] ||
    no_gpu "driver error: nvidia-smi failed (exit $rc): $(printf '%s\n' "$out" | grep -m1 .)"
  lines=$(printf '%s\n' "$out" | grep -E '^ *[0-9]+ *,')
  [ -n "$lines" ] || no_gpu "no device: nvidia-smi lists no GPU ($(printf '%s' "$out" | head -c 200))"
  if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
    case "$CUDA_VISIBLE_DEVICES" in
      "" | -1* | NoDevFiles*)
        no_gpu "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every device" ;;
    esac
  fi
  local first name driver mem count
  count=$(printf '%s\n' "$lines" | wc -l)
  first=$(printf '%s\n' "$lines" | head -n1)
  IFS=',' read -r _ name driver mem <<< "$first"
  GPU_JSON="{\"count\":$count,\"name\":$(jstr "${name# }"),\"driver\":$(jstr "${driver# }"),\"memory\":$(jstr "${mem# }")}"
  say "GPU: ${name# } (driver ${driver# }, ${mem# }); $count visible"
}
probe_gpu

# cuBLAS is opened at run time (nn_cuda.cu's blas_load: the library path,
# then the build machine's toolkit directory). Where the GPU machine keeps
# it elsewhere -- $CUDA_HOME, a versioned toolkit, PyTorch's pip wheel --
# that directory joins our programs' LD_LIBRARY_PATH; the summary says
# which was found ("cublas"), or that none was (the steps then fail with
# the backend's own message).
find_cublas() {
  local so d py
  so=$(grep -a -o -m1 'libcublas\.so\.[0-9]*' "$BIN/cnn_bench" | head -n1)
  [ -n "$so" ] || return 0
  CUBLAS="$so: not found"
  if ldconfig -p 2>/dev/null | grep -q -F "$so "; then
    CUBLAS="$so: in the system's library cache"
    return 0
  fi
  for d in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }} "${CUDA_HOME:-}/lib64" "${CUDA_PATH:-}/lib64" /usr/local/cuda/lib64 \
           /usr/local/cuda-*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -n "$d" ] && [ -e "$d/$so" ]; then
      CUBLAS="$d/$so"
      OURS_LD+=":$d"
      OURS=(env "LD_LIBRARY_PATH=$OURS_LD")
      return 0
    fi
  done
  # PyTorch's wheels: nvidia/cublas/lib (CUDA 12), nvidia/cu13/lib (CUDA 13)
  py='import os, sys, nvidia
for base in nvidia.__path__:
    for root, _, files in os.walk(base):
        if sys.argv[1] in files:
            print(root)
            sys.exit(0)'
  d=$(timeout 60 "$PYTHON" -c "$py" "$so" 2>/dev/null | head -n1)
  if [ -n "$d" ] && [ -e "$d/$so" ]; then
    CUBLAS="$d/$so (PyTorch's)"
    OURS_LD+=":$d"
    OURS=(env "LD_LIBRARY_PATH=$OURS_LD")
  fi
}
CUBLAS=""
find_cublas
say "cuBLAS: $CUBLAS"

# ------------------------------------------------------------------ steps

# bounded LIMIT OUT ERR CMD...: runs CMD under timeout (stdout to OUT, stderr
# appended to ERR), sets rc. A timeout is 124 (137 if it ignored SIGTERM).
# In the background, so that a signal to this script is handled at once:
# SIGINT or SIGTERM stops the step (timeout passes it on) and the run.
bounded() {
  local limit=$1 out=$2 err=$3
  shift 3
  if [ "$out" = "$err" ]; then
    timeout -k 30 "$limit" "$@" < /dev/null >> "$out" 2>&1 &
  else
    timeout -k 30 "$limit" "$@" < /dev/null > "$out" 2>> "$err" &
  fi
  CHILD=$!
  while :; do
    wait "$CHILD" && rc=0 || rc=$?
    kill -0 "$CHILD" 2>/dev/null || break # reaped: rc is its status
  done
  CHILD=""
  if [ -n "$STOPPED" ]; then
    ST[$CUR]=failed REASON[$CUR]="stopped by $STOPPED" RC[$CUR]=$rc
    finish $EXIT_FAILED failed "stopped by $STOPPED during $CUR"
  fi
}
CHILD="" STOPPED="" CUR=""
trap 'STOPPED=SIGINT; [ -z "$CHILD" ] || kill -TERM "$CHILD" 2>/dev/null' INT
trap 'STOPPED=SIGTERM; [ -z "$CHILD" ] || kill -TERM "$CHILD" 2>/dev/null' TERM
# begin STEP: its log and start time. end STEP STATUS REASON: its verdict.
begin() {
  CUR=$1
  LOGF[$1]="$RESULTS/$1.log"
  : > "${LOGF[$1]}"
  T0=$(now)
  say "$1: running (log: ${LOGF[$1]})"
}
end() {
  SECS[$1]=$(awk -v a="$T0" -v b="$(now)" 'BEGIN{printf "%.1f", b - a}')
  ST[$1]=$2 REASON[$1]=$3
  say "$1: $2 (${SECS[$1]} s)${3:+: $3}"
}
last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n1 | cut -c1-300; }
# cause FILE ERE...: the first line matching the first ERE that matches
# one, else the last line: the sentence saying why, not the noise after it.
cause() {
  local f=$1 re l
  shift
  for re in "$@"; do
    l=$(grep -m1 -E "$re" "$f" 2>/dev/null | cut -c1-300)
    [ -z "$l" ] || { printf '%s' "$l"; return; }
  done
  last_line "$f"
}
timed_out() { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; }
# loads STEP PROGRAM...: false (and STEP failed) if one of them cannot load.
loads() {
  local step=$1 p
  shift
  for p in "$@"; do
    if [ -n "${LOADERR[$p]:-}" ]; then
      end "$step" failed "${LOADERR[$p]}"
      return 1
    fi
  done
}

step_tests() {
  begin cuda_gpu_tests
  local out=$RESULTS/cuda_gpu_tests.out re='cuda_gpu: ([0-9]+) checks, ([0-9]+) failed'
  loads cuda_gpu_tests cuda_gpu_tests || return
  bounded "$T_TESTS" "$out" "${LOGF[cuda_gpu_tests]}" "${OURS[@]}" "$BIN/cuda_gpu_tests"
  RC[cuda_gpu_tests]=$rc
  cat "$out" >> "${LOGF[cuda_gpu_tests]}"
  if [[ $(cat "$out") =~ $re ]]; then
    addfig cuda_gpu_tests checks "${BASH_REMATCH[1]}"
    addfig cuda_gpu_tests failed "${BASH_REMATCH[2]}"
    TOP_FIGS+="${TOP_FIGS:+,}\"cuda_gpu_checks\":${BASH_REMATCH[1]},\"cuda_gpu_failed\":${BASH_REMATCH[2]}"
  fi
  if timed_out; then end cuda_gpu_tests timeout "no result within $T_TESTS s"
  elif [ "$rc" -eq 77 ]; then
    end cuda_gpu_tests failed "it skipped itself (exit 77) although nvidia-smi lists a GPU: $(last_line "$out")"
  elif [ "$rc" -ne 0 ]; then end cuda_gpu_tests failed "exit $rc: $(last_line "${LOGF[cuda_gpu_tests]}")"
  else end cuda_gpu_tests passed ""
  fi
}

find_sanitizer() {
  local c
  for c in "${COMPUTE_SANITIZER:-}" compute-sanitizer "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer; do
    [ -n "$c" ] && command -v "$c" 2>/dev/null && return 0
  done
  return 1
}
# API errors are left to the backend, which checks every call and whose
# tests provoke some on purpose; the tools look for what it cannot see:
# out-of-bounds and misaligned accesses (memcheck), barrier and
# synchronization hazards (synccheck).
step_sanitizer() { # memcheck | synccheck
  local tool=$1 san errs
  begin "$tool"
  loads "$tool" cuda_gpu_tests || return
  if ! san=$(find_sanitizer); then
    end "$tool" unavailable "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin; or set COMPUTE_SANITIZER): not checked"
    return
  fi
  # shellcheck disable=SC2086 # SANITIZER_ARGS is a list of options
  bounded "$T_SANITIZER" "${LOGF[$tool]}" "${LOGF[$tool]}" "${OURS[@]}" "$san" --tool "$tool" \
    --target-processes all --report-api-errors no --error-exitcode 86 \
    ${SANITIZER_ARGS:-} "$BIN/cuda_gpu_tests"
  RC[$tool]=$rc
  errs=$(grep -o 'ERROR SUMMARY: [0-9]* error' "${LOGF[$tool]}" | awk '{s += $3; n++} END{if (n) print s}')
  addfig "$tool" errors "$(jnum "$errs")"
  TOP_FIGS+="${TOP_FIGS:+,}\"${tool}_errors\":$(jnum "$errs")"
  if timed_out; then end "$tool" timeout "no result within $T_SANITIZER s"
  elif [ -z "$errs" ]; then end "$tool" failed "no ERROR SUMMARY line (exit $rc): $(last_line "${LOGF[$tool]}")"
  elif [ "$errs" -ne 0 ]; then end "$tool" failed "$errs errors (exit $rc); see the log"
  elif [ "$rc" -ne 0 ]; then end "$tool" failed "cuda_gpu_tests exited $rc under $tool: $(last_line "${LOGF[$tool]}")"
  else end "$tool" passed ""
  fi
}

# ROUNDS runs of a benchmark printing one JSON line: sets IPS (median
# img/s, empty on failure), LASTJSON and WHY.
bench_rounds() { # STEP CMD...
  local step=$1 r line list=() out=$RESULTS/$1.out
  shift
  IPS="" LASTJSON="" WHY=""
  : > "$out"
  for r in $(seq 1 "$ROUNDS"); do
    bounded "$T_BENCH" "$out.$r" "${LOGF[$step]}" "$@"
    RC[$step]=$rc
    cat "$out.$r" >> "$out"
    line=$(grep '^{' "$out.$r" | tail -n1)
    if timed_out; then WHY="timeout: round $r gave no result within $T_BENCH s"; return; fi
    if [ "$rc" -ne 0 ]; then WHY="round $r exited $rc: $(last_line "${LOGF[$step]}")"; return; fi
    LASTJSON=$line
    local v
    v=$(jget "$line" images_per_sec)
    if [ -z "$v" ]; then WHY="round $r printed no images_per_sec: $(last_line "$out.$r")"; return; fi
    list+=("$v")
    rm -f "$out.$r"
  done
  IPS=$(median "${list[@]}")
  addfig "$step" images_per_sec "$IPS"
  addfig "$step" rounds "[$(IFS=,; echo "${list[*]}")]"
  addfig "$step" result "$(jobj "$LASTJSON")"
}

step_bench() {
  begin cnn_bench
  loads cnn_bench cnn_bench || return
  bench_rounds cnn_bench "${OURS[@]}" "$BIN/cnn_bench" --device gpu --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP"
  if [ -n "$IPS" ]; then
    TOP_FIGS+="${TOP_FIGS:+,}\"gpu_images_per_sec\":$IPS"
    end cnn_bench passed ""
  else
    case "$WHY" in timeout*) end cnn_bench timeout "$WHY" ;; *) end cnn_bench failed "$WHY" ;; esac
  fi
}

# --profile times each op with a wait after it: its img/s is not the
# throughput (cnn_bench's is), its per-op table on stderr is the point.
step_profile() {
  begin cnn_profile
  local out=$RESULTS/cnn_profile.out line
  loads cnn_profile cnn_bench || return
  bounded "$T_BENCH" "$out" "${LOGF[cnn_profile]}" "${OURS[@]}" "$BIN/cnn_bench" --device gpu --batch "$BATCH" \
    --steps "$STEPS" --warmup "$WARMUP" --profile
  RC[cnn_profile]=$rc
  line=$(grep '^{' "$out" | tail -n1)
  [ -z "$line" ] || addfig cnn_profile result "$(jobj "$line")"
  if timed_out; then end cnn_profile timeout "no result within $T_BENCH s"
  elif [ "$rc" -ne 0 ]; then end cnn_profile failed "exit $rc: $(last_line "${LOGF[cnn_profile]}")"
  elif [ -z "$line" ]; then end cnn_profile failed "no JSON line on stdout"
  else end cnn_profile passed ""
  fi
}

step_torch() {
  begin torch
  local script=$here/examples/cifar10/bench/torch_cifar.py probe
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    end torch unavailable "PYTHON=$PYTHON not found: no PyTorch comparison"
    return
  fi
  # Not installed: unavailable. Installed but failing to import or to see
  # the GPU: failed.
  probe='import importlib.util, sys
missing = [m for m in ("torch", "numpy") if importlib.util.find_spec(m) is None]
if missing:
    print("not installed: " + ", ".join(missing)); sys.exit(3)
import torch
print("torch %s, CUDA %s, cuda available: %s" % (torch.__version__, torch.version.cuda, torch.cuda.is_available()))
sys.exit(0 if torch.cuda.is_available() else 4)'
  bounded "$T_BENCH" "$RESULTS/torch.probe" "${LOGF[torch]}" "$PYTHON" -c "$probe"
  RC[torch]=$rc
  cat "$RESULTS/torch.probe" >> "${LOGF[torch]}"
  if [ "$rc" -eq 3 ]; then
    end torch unavailable "$PYTHON: $(last_line "$RESULTS/torch.probe")"
    return
  elif [ "$rc" -ne 0 ]; then
    end torch failed "$PYTHON cannot use PyTorch on the GPU (exit $rc): $(last_line "${LOGF[torch]}")"
    return
  fi
  addfig torch version "$(jstr "$(last_line "$RESULTS/torch.probe")")"
  bench_rounds torch "$PYTHON" "$script" --device cuda --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP"
  if [ -n "$IPS" ]; then
    TOP_FIGS+="${TOP_FIGS:+,}\"torch_images_per_sec\":$IPS"
    end torch passed ""
  else
    case "$WHY" in timeout*) end torch timeout "$WHY" ;; *) end torch failed "$WHY" ;; esac
  fi
}

find_data() {
  local d
  if [ -n "$DATA_DIR" ]; then
    printf '%s' "$DATA_DIR"
    return
  fi
  for d in "$PWD/cifar10" "$HOME/shared/cifar10" "$HOME/data/cifar-10-batches-bin" \
           "$HOME/cifar-10-batches-bin"; do
    [ -f "$d/data_batch_1.bin" ] && { printf '%s' "$d"; return; }
  done
}

step_train() {
  begin train
  local data synthetic=false f decay out=$RESULTS/train.out result acc
  loads train psrun psd cifar_worker cifar_synth || return
  if [ $SYNTH = 1 ]; then
    data=$RESULTS/synthetic-cifar10 synthetic=true
    "${OURS[@]}" "$BIN/cifar_synth" --out "$data" --train 10000 --test 2000 >> "${LOGF[train]}" 2>&1 ||
      { end train failed "cifar_synth could not write $data"; return; }
  else
    data=$(find_data)
    if [ -z "$data" ]; then
      end train unavailable "no data: give --data DIR (the CIFAR-10 binary version), or --synthetic"
      return
    fi
    for f in data_batch_1 data_batch_2 data_batch_3 data_batch_4 data_batch_5 test_batch; do
      [ -f "$data/$f.bin" ] || { end train failed "no data: $data has no $f.bin"; return; }
    done
  fi
  addfig train data "$(jstr "$data")"
  addfig train synthetic $synthetic
  addfig train epochs "$EPOCHS"
  decay=$(( EPOCHS * 6 / 10 > 0 ? EPOCHS * 6 / 10 : 1 ))
  bounded "$T_TRAIN" "$out" "${LOGF[train]}" "${OURS[@]}" "$BIN/psrun" --local -n 2 --ps 1 -- \
    "$BIN/cifar_worker" --device gpu --data "$data" --epochs "$EPOCHS" --batch "$BATCH" \
    --lr 0.1 --lr-decay "0.1:$decay" --metrics "$RESULTS/train-metrics.jsonl"
  RC[train]=$rc
  cat "$out" >> "${LOGF[train]}"
  result=$(sed -n 's/^\[w0\] \({.*}\)$/\1/p' "$out" | tail -n1)
  acc=$(jget "$result" test_accuracy)
  [ -z "$result" ] || addfig train result "$(jobj "$result")"
  if timed_out; then end train timeout "no result within $T_TRAIN s"; return; fi
  if [ "$rc" -ne 0 ]; then
    end train failed "psrun exited $rc: $(cause "${LOGF[train]}" '^\[w[0-9]+\] cifar_worker( [0-9]+)?: ' \
      '^psrun: .*(exited|failed|cannot|error)' ' ERROR ')"
    return
  fi
  [ -n "$acc" ] || { end train failed "the chief printed no test_accuracy"; return; }
  TOP_FIGS+="${TOP_FIGS:+,}\"test_accuracy\":$acc,\"train_images_per_sec\":$(jnum "$(jget "$result" images_per_sec)")"
  if [ $synthetic = false ] && awk -v a="$acc" -v m="$MIN_ACCURACY" 'BEGIN{exit !(a < m)}'; then
    end train failed "test accuracy $acc after $EPOCHS epochs is under MIN_ACCURACY=$MIN_ACCURACY"
  elif [ $synthetic = true ] && awk -v a="$acc" -v m="$MIN_SYNTH_ACCURACY" 'BEGIN{exit !(a < m)}'; then
    end train failed "test accuracy $acc on the synthetic data after $EPOCHS epochs is under MIN_SYNTH_ACCURACY=$MIN_SYNTH_ACCURACY (chance is 0.1: the evaluation or the training is broken)"
  else
    end train passed ""
  fi
}

# --only: the steps not chosen stay not_run ("not chosen"), and the run
# is at best incomplete.
chosen() {
  [ -z "$ONLY" ] && return 0
  [[ ,$ONLY, == *,$1,* ]] && return 0
  REASON[$1]="not chosen (--only $ONLY)"
  return 1
}
! chosen cuda_gpu_tests || step_tests
! chosen memcheck || step_sanitizer memcheck
! chosen synccheck || step_sanitizer synccheck
! chosen cnn_bench || step_bench
! chosen cnn_profile || step_profile
! chosen torch || step_torch
! chosen train || step_train

# ---------------------------------------------------------------- verdict

gi=$(jget "{${TOP_FIGS}}" gpu_images_per_sec)
ti=$(jget "{${TOP_FIGS}}" torch_images_per_sec)
if [ -n "$gi" ] && [ -n "$ti" ]; then
  ratio=$(awk -v g="$gi" -v t="$ti" 'BEGIN{printf "%.3f", g / t}')
  met=$(awk -v r="$ratio" -v t="$TARGET_RATIO" 'BEGIN{print (r >= t) ? "true" : "false"}')
  TOP_FIGS+=",\"gpu_over_torch\":$ratio,\"target_ratio\":$TARGET_RATIO,\"target_met\":$met"
  say "GPU $gi img/s / PyTorch eager fp32 $ti img/s = ${ratio}x at batch $BATCH (target >= ${TARGET_RATIO}x)"
fi
bad="" missing=""
for s in "${STEPS_ORDER[@]}"; do
  case "${ST[$s]}" in
    failed | timeout) bad+="${bad:+, }$s (${ST[$s]})" ;;
    unavailable | not_run) missing+="${missing:+, }$s" ;;
  esac
done
[ -z "$bad" ] || finish $EXIT_FAILED failed "failed steps: $bad${missing:+; not run: $missing}"
[ -z "$missing" ] || finish $EXIT_PARTIAL incomplete "not run: $missing (the steps' reasons say why)"
finish $EXIT_OK passed "every step passed"
