#!/usr/bin/env bash
# The main job: installs what is missing, builds, and trains the CIFAR-10
# CNN on this machine with 1 parameter server and 2 workers (psrun --local),
# 2 x 64 images per step (global batch 128), learning rate 0.1.
#
#   bash deploy/run-main.sh [DATA_DIR] [cifar_worker options...]
#
# Data: DATA_DIR if given; else the first of ./data/cifar-10-batches-bin
# (examples/cifar10/download.sh puts it there), ../shared/cifar10,
# ~/data/cifar-10-batches-bin; else a synthetic data set in the same format
# (made by cifar_synth), and it says so. EPOCHS (default 1) sets the length.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/build.sh >/dev/null

data=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  data=$1
  shift
fi
if [ -z "$data" ]; then
  for d in data/cifar-10-batches-bin ../shared/cifar10 "$HOME/data/cifar-10-batches-bin"; do
    if [ -f "$d/data_batch_1.bin" ]; then
      data=$d
      break
    fi
  done
fi
if [ -z "$data" ]; then
  echo "run-main: no CIFAR-10 found (looked in ./data/cifar-10-batches-bin, ../shared/cifar10," \
       "~/data/cifar-10-batches-bin); training on SYNTHETIC data instead." \
       "Get the real data with: bash examples/cifar10/download.sh data" >&2
  build/bin/cifar_synth --out build/synth-cifar10 --train 10000 --test 2000 >&2
  data=build/synth-cifar10
fi
echo "run-main: training on $data" >&2
exec build/bin/psrun --local -n 3 --ps 1 -- build/bin/cifar_worker --data "$data" \
  --epochs "${EPOCHS:-1}" --batch 64 --lr 0.1 "$@"
