#!/usr/bin/env bash
# Installs missing dependencies and builds everything into build/bin.
# Extra arguments go to cmake's configure step (e.g. -DPS_WERROR=ON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
cmake --build build -j"$(nproc)"
