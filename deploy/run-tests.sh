#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Warnings are errors in every build this script makes.
bash deploy/build.sh -DPS_WERROR=ON
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 600)

# The same suite with every worker forced onto the shared-memory transport
# (PS_TRANSPORT=shm, docs/protocol.md §1a): a worker that cannot use it
# fails instead of quietly taking TCP. Tests of TCP itself (pacing, the
# *_tcp runs, emulated hosts) set their transport in their configuration.
(cd build && PS_TRANSPORT=shm ctest --output-on-failure -j"$(nproc)" --timeout 600)

# The daemon and the library alone: no psrun, no examples, so neither
# libslurm, libpmi2 nor OpenBLAS is looked for; psd must not link them and
# libpsclient.so must export only the ps_ API (tests/link_test.sh).
cmake -S . -B build-min -DPS_BUILD_PSRUN=OFF -DPS_BUILD_EXAMPLES=OFF -DPS_BUILD_TESTS=OFF \
  -DPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-min -j"$(nproc)"
bash tests/link_test.sh build-min/lib/libpsclient.so build-min/bin/psd

# The same suite again under AddressSanitizer + UndefinedBehaviorSanitizer
# (psd processes started by the tests are sanitized too). The CUDA backend
# is left out of this build and the fuzz build (cmake/Cuda.cmake says why);
# its kernel bodies still run on the CPU there (example_tests cuda_ops).
cmake -S . -B build-asan -DPS_SANITIZE=ON -DPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-asan -j"$(nproc)"
(cd build-asan && ctest --output-on-failure -j"$(nproc)" --timeout 600)

# libFuzzer targets (tests/fuzz, see its README): clang with the fuzzer
# runtime, every library instrumented, each target fuzzed for 60 s from its
# seed corpus. The whole stage stays under ~5 minutes on 2 cores.
fuzz_probe() {
  printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n);\n%s\n' \
    'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }' |
    clang -fsanitize=fuzzer,address,undefined -x c - -o /dev/null >/dev/null 2>&1
}
if ! command -v clang >/dev/null 2>&1 || ! fuzz_probe; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  command -v clang >/dev/null 2>&1 || {
    echo "fuzz: installing clang"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends clang >/dev/null
  }
  clang_major=$(clang --version | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' | head -1)
  echo "fuzz: installing libclang-rt-${clang_major}-dev (libFuzzer)"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "libclang-rt-${clang_major}-dev" >/dev/null
fi
CC=clang cmake -S . -B build-fuzz -DPS_FUZZ=ON -DPS_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz
bash tests/fuzz/run.sh build-fuzz 60
