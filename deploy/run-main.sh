#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs the parameter
# server benchmark (1 and 2 workers) against raw TCP on this machine.
# (Until the CIFAR-10 example lands, this is psd's showcase.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh
./build/bin/ps_bench --tcp-baseline --workers 1,2 --sizes 4,1M,64M "$@"
