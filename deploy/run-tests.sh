#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, runs ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 600
