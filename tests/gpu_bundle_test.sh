#!/usr/bin/env bash
# The GPU run bundle (deploy/gpu-bundle.sh, deploy/run-gpu.sh, docs/gpu.md)
# on a machine without a GPU:
#  - packing the build's programs gives one tarball under 60 MB holding
#    the six programs, run-gpu.sh, the PyTorch comparison and SHA256SUMS;
#  - every packed program and library loads with only the bundle's lib/
#    and the system's base libraries (glibc, libstdc++, libgcc_s): ldd
#    finds nothing missing and resolves everything else inside lib/;
#  - run-gpu.sh, unpacked elsewhere, reports "no GPU" with the reason and
#    exits 3 -- never success -- for each way a GPU can be missing: no
#    nvidia-smi, nvidia-smi failing (driver error), listing no GPU, and
#    CUDA_VISIBLE_DEVICES hiding them; its stdout and summary.json are the
#    same valid JSON, every step "not_run";
#  - with an nvidia-smi that lists a GPU the machine does not have, the
#    real steps fail and it says which and why (exit 1): cuda_gpu_tests'
#    skip (77) is a failure, cnn_bench's exit is recorded, train's reason
#    is the worker's sentence, a missing compute-sanitizer or PyTorch is
#    "unavailable", not passed; a program that cannot load (a library
#    damaged) fails its step with the loader's words (--only train);
#  - a damaged bundle (a program differing from SHA256SUMS) and a bad
#    option stop it before anything runs (exit 2).
# Usage: gpu_bundle_test.sh SOURCE_DIR BUILD_DIR CUDA_ENABLED(ON|OFF).
# Exits 77 (SKIP) without jq, or when the build has no CUDA backend (after
# checking that gpu-bundle.sh refuses it).
set -euo pipefail
src=$1
build=$2
cuda=$3
command -v jq >/dev/null 2>&1 ||
  { echo "SKIP: jq is not installed (deploy/deps.sh installs it)"; exit 77; }
dir=$(mktemp -d "${TMPDIR:-/tmp}/gpu_bundle_test.XXXXXX")
trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/out "$dir"/err; do [ -f "$f" ] && { echo "--- $f:"; cat "$f"; }; done; exit 1; }

rc=0
bash "$src/deploy/gpu-bundle.sh" --from "$build" --out "$dir/b.tar.gz" > "$dir/out" 2> "$dir/err" || rc=$?
if [ "$cuda" != ON ]; then
  [ $rc -ne 0 ] && grep -q 'has no CUDA backend\|must be Release or RelWithDebInfo' "$dir/err" ||
    fail "gpu-bundle.sh packed a build without the CUDA backend (rc $rc)"
  echo "SKIP: this build has no CUDA backend (gpu-bundle.sh refuses it, as it should)"
  exit 77
fi
[ $rc -eq 0 ] || fail "gpu-bundle.sh --from $build exited $rc"
size=$(stat -c %s "$dir/b.tar.gz")
[ "$(cat "$dir/out")" = "$dir/b.tar.gz $size" ] || fail "stdout is not 'PATH SIZE'"
[ "$size" -lt 60000000 ] || fail "the bundle is $size bytes, not under 60 MB"
echo "ok: bundle of $size bytes"

mkdir "$dir/u"
tar -C "$dir/u" -xzf "$dir/b.tar.gz"
b=$dir/u/psd-gpu-bundle
for f in run-gpu.sh MANIFEST SHA256SUMS README.md examples/cifar10/bench/torch_cifar.py \
         examples/python/cifar_net.py bin/cuda_gpu_tests bin/cnn_bench bin/cifar_worker \
         bin/cifar_synth bin/psd bin/psrun lib/libopenblas.so.0; do
  [ -s "$b/$f" ] || fail "the bundle lacks $f"
done
[ -x "$b/run-gpu.sh" ] || fail "run-gpu.sh is not executable"
grep -q '^glibc_needed=2\.[0-9]*$' "$b/MANIFEST" || fail "MANIFEST has no glibc_needed"
(cd "$b" && sha256sum --quiet -c SHA256SUMS) || fail "SHA256SUMS does not match the files"

# Every dependency resolves, to the bundle's lib/ or a base library.
base='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil|libstdc\+\+|libgcc_s)\.so'
for f in "$b"/bin/* "$b"/lib/*; do
  LD_LIBRARY_PATH=$b/lib ldd "$f" > "$dir/ldd" 2>&1 || fail "ldd $f failed: $(cat "$dir/ldd")"
  ! grep -q 'not found' "$dir/ldd" || fail "${f#"$b"/} misses a library: $(grep 'not found' "$dir/ldd")"
  while read -r name arrow path _; do
    [ "$arrow" = "=>" ] || continue
    case "$path" in "$b"/lib/*) continue ;; esac
    [[ $name =~ $base ]] || fail "${f#"$b"/} takes $name from $path, outside the bundle"
  done < "$dir/ldd"
done
grep -q 'libgfortran' <(ls "$b/lib") || fail "libgfortran (OpenBLAS's) is not packed"
echo "ok: every program and library loads with lib/ and the base libraries"

# run-gpu.sh from a directory of its own, as on the GPU machine.
ARGS=() # more options for run-gpu.sh
run() { # run EXPECTED_RC ENV... : runs run-gpu.sh; stdout must be its summary.json
  local want=$1 got=0
  shift
  rm -rf "$dir/res"
  (cd "$dir" && env "$@" ROUNDS=1 STEPS=2 WARMUP=1 T_BENCH=300 T_TESTS=300 T_TRAIN=300 \
     "$b/run-gpu.sh" --results "$dir/res" --data "$dir/synth" "${ARGS[@]}") > "$dir/out" 2> "$dir/err" ||
    got=$?
  [ "$got" -eq "$want" ] || fail "run-gpu.sh with $* exited $got, expected $want"
  jq -e 'type == "object"' "$dir/out" > /dev/null || fail "stdout is not one JSON object"
  cmp -s "$dir/out" "$dir/res/summary.json" || fail "stdout differs from summary.json"
  jq -e --argjson rc "$want" '.exit_status == $rc and .status != "passed"
     and (.steps | keys_unsorted) == ["cuda_gpu_tests","memcheck","synccheck","cnn_bench",
                                       "cnn_profile","torch","train"]' "$dir/out" > /dev/null ||
    fail "the summary's status, exit_status or steps are wrong"
}
no_gpu() { # no_gpu REASON_PART ENV...
  local why=$1
  shift
  run 3 "$@"
  jq -e --arg w "$why" '.status == "no_gpu" and (.reason | startswith("no GPU: "))
     and (.reason | contains($w)) and ([.steps[].status] | unique) == ["not_run"]
     and (.figures | length) == 0' "$dir/out" > /dev/null ||
    fail "not a clear 'no GPU' summary with '$why'"
  grep -q "^run-gpu: no_gpu: no GPU: .*$why.* (exit 3)" "$dir/err" || fail "stderr does not say 'no GPU'"
  echo "ok: no GPU ($why): exit 3, $(jq -c .reason "$dir/out")"
}
"$build/bin/cifar_synth" --out "$dir/synth" --train 256 --test 64 --seed 3 > /dev/null
mkdir "$dir/fake"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed because it couldn'"'"'t communicate with the NVIDIA driver."\nexit 9\n' \
  > "$dir/fake/smi-driver-error"
printf '#!/bin/sh\necho "No devices were found"\n' > "$dir/fake/smi-none"
printf '#!/bin/sh\necho "0, Fake GPU of gpu_bundle_test, 580.65, 81559 MiB"\n' > "$dir/fake/smi-gpu"
chmod +x "$dir/fake/"*

no_gpu "nvidia-smi not found" NVIDIA_SMI="$dir/fake/nonexistent"
if ! command -v nvidia-smi > /dev/null 2>&1; then
  no_gpu "nvidia-smi not found" # this machine as it is
fi
no_gpu "driver error: nvidia-smi failed (exit 9): NVIDIA-SMI has failed" NVIDIA_SMI="$dir/fake/smi-driver-error"
no_gpu "nvidia-smi lists no GPU" NVIDIA_SMI="$dir/fake/smi-none"
no_gpu "CUDA_VISIBLE_DEVICES='' hides every device" NVIDIA_SMI="$dir/fake/smi-gpu" CUDA_VISIBLE_DEVICES=

# A GPU that nvidia-smi lists but CUDA cannot use: real steps, real
# failures, each step's reason the sentence saying why.
run 1 NVIDIA_SMI="$dir/fake/smi-gpu" PYTHON=python3
jq -e '.status == "failed" and .gpu.name == "Fake GPU of gpu_bundle_test" and .gpu.count == 1
   and (.reason | startswith("failed steps: cuda_gpu_tests (failed)"))
   and .steps.cuda_gpu_tests.exit == 77
   and (.steps.cuda_gpu_tests.reason | contains("skipped itself (exit 77)"))
   and .steps.cnn_bench.status == "failed" and .steps.cnn_bench.exit != 0
   and (.steps.cnn_bench.reason | startswith("round 1 exited"))
   and .steps.cnn_profile.status == "failed"
   and .steps.train.status == "failed" and .steps.train.exit != 0
   and (.steps.train.reason | test("^psrun exited [0-9]+: \\[w0\\] cifar_worker( 0)?: --device gpu: no GPU: "))
   and (.load_errors | length) == 0
   and ([.steps[] | .status] | all(. != "passed" and . != "not_run"))
   and ([.steps[] | .seconds | type] | unique) == ["number"]' "$dir/out" > /dev/null ||
  fail "the failing steps are not reported as failed, with their reasons"
for t in memcheck synccheck; do
  jq -e --arg t "$t" '.steps[$t].status == "failed" or (.steps[$t].status == "unavailable"
     and (.steps[$t].reason | contains("compute-sanitizer not found")))' "$dir/out" > /dev/null ||
    fail "$t is neither failed nor unavailable with its reason"
done
jq -e '.steps.torch.status == "unavailable" or .steps.torch.status == "failed"' "$dir/out" > /dev/null ||
  fail "the PyTorch step passed on a machine without a GPU"
[ -s "$dir/res/cuda_gpu_tests.log" ] && grep -q 'SKIP' "$dir/res/cuda_gpu_tests.log" ||
  fail "cuda_gpu_tests' log is missing"
grep -q '^run-gpu: failed: failed steps: cuda_gpu_tests (failed), .* (exit 1)' "$dir/err" ||
  fail "stderr does not say what failed"
echo "ok: a listed but unusable GPU: exit 1, $(jq -c '[.steps | to_entries[] | {(.key): .value.status}] | add' "$dir/out")"

# A program that cannot load: psd's libevent made unloadable (and
# SHA256SUMS forgetting it); --only train: the other steps not chosen.
echo "not a library" > "$b/lib/libevent-2.1.so.7"
sed -i '/libevent/d' "$b/SHA256SUMS"
ARGS=(--only train)
run 1 NVIDIA_SMI="$dir/fake/smi-gpu"
ARGS=()
jq -e '.status == "failed" and .steps.train.status == "failed" and .steps.train.exit == null
   and (.steps.train.reason | test("^bin/psd cannot load here:.*libevent-2.1.so.7: file too short"))
   and (.load_errors | length) == 1
   and ([.steps | to_entries[] | select(.key != "train") | .value.reason]
        | all(. == "not chosen (--only train)"))
   and (.reason | contains("not run: cuda_gpu_tests, memcheck"))' "$dir/out" > /dev/null ||
  fail "a program that cannot load does not fail its step with the loader's words"
echo "ok: a program that cannot load fails its step: $(jq -c .steps.train.reason "$dir/out")"

# A damaged program and a bad option: exit 2 before anything runs.
head -c 1000 "$b/bin/cnn_bench" > "$dir/trunc" && cat "$dir/trunc" > "$b/bin/cnn_bench"
run 2 NVIDIA_SMI="$dir/fake/smi-gpu"
jq -e '.status == "error" and (.reason | contains("damaged (bin/cnn_bench: not as in SHA256SUMS)"))
   and ([.steps[].status] | unique) == ["not_run"]' "$dir/out" > /dev/null ||
  fail "a damaged bundle is not reported as such"
rc=0
"$b/run-gpu.sh" --bogus > "$dir/out" 2> "$dir/err" || rc=$?
[ $rc -eq 2 ] && jq -e '.status == "error" and (.reason | contains("--bogus"))' "$dir/out" > /dev/null ||
  fail "a bad option: rc $rc"
echo "ok: a damaged bundle and a bad option exit 2"
