#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
(cd build && ctest --output-on-failure -j"$(nproc)" --timeout 600)

# The same suite again under AddressSanitizer + UndefinedBehaviorSanitizer
# (psd processes started by the tests are sanitized too).
cmake -S . -B build-asan -DPS_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build-asan -j"$(nproc)"
(cd build-asan && ctest --output-on-failure -j"$(nproc)" --timeout 600)
