#!/usr/bin/env bash
# One DDP script on two torch.distributed backends, as same-run ratios:
# examples/python/train_ddp.py over gloo (2 processes, torchrun's variables
# set here: Debian's torchrun fails on Python 3.12) against its twin
# train_ddp_psd.py on the "psd" backend (1 ps + 2 workers under psrun
# --local; psd2: 2 ps), for each MODEL. Same data, batch, threads and CPUs (taskset: the
# ps shares them, its cost is psd's); rounds interleaved (gloo then psd,
# reversed the next round). Prints images/s (rank 0's, after the warm-up
# steps) as median [min-max], the ratio psd/gloo of the medians and per
# round, and the largest difference between the two runs' logged global
# losses (every step).
#
#   deploy/bench/ddp_backend.sh DATA_DIR                 (CIFAR-10 binaries)
#   ROUNDS=5 MODELS="cifar resnet18" deploy/bench/ddp_backend.sh ../shared/cifar10
#
# Environment: ROUNDS (3), MODELS ("cifar resnet18"), KINDS ("gloo psd":
# psdK runs K ps tasks, e.g. "gloo psd psd2"), STEPS (50), BATCH (32 per
# worker), THREADS (1 torch thread per process), CPUS (taskset list;
# default all), BIN (build/bin), PYTHON (/usr/bin/python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "${BIN:-$root/build/bin}" && pwd)
data=${1:-${DATA:-}}
[ -n "$data" ] || { echo "usage: $0 DATA_DIR (CIFAR-10 binary files)" >&2; exit 2; }
rounds=${ROUNDS:-3}; steps=${STEPS:-50}; batch=${BATCH:-32}; threads=${THREADS:-1}
models=${MODELS:-cifar resnet18}
kinds=${KINDS:-gloo psd}
cpus=${CPUS:-0-$(($(nproc) - 1))}
py=${PYTHON:-/usr/bin/python3}
export OMP_NUM_THREADS=$threads
ex=$root/examples/python
out=$(mktemp -d); trap 'rm -rf "$out"' EXIT

gloo() { # the ranks of a gloo run, torchrun's variables by hand
  local port pids=() r
  port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      taskset -c "$cpus" "$py" "$ex/train_ddp.py" "$@" >"$out/g$r" 2>"$out/gerr$r" &
    pids+=($!)
  done
  for r in 0 1; do wait "${pids[$r]}" || { tail -20 "$out/gerr$r" >&2; exit 1; }; done
  cat "$out/g0" "$out/g1"
}

run() { # backend model round: appends rank 0's lines, tagged, to $out/runs
  local args=(--data "$data" --model "$2" --steps "$steps" --batch "$batch" --threads "$threads"
              --log-every 1 --warmup 5)
  if [ "$1" = gloo ]; then
    gloo "${args[@]}" >"$out/out"
  else
    local nps=${1#psd}
    nps=${nps:-1}
    env -u PSD_LIBPSCLIENT taskset -c "$cpus" "$bin/psrun" --local -n $((nps + 2)) --ps "$nps" -- \
      "$py" "$ex/train_ddp_psd.py" "${args[@]}" >"$out/out" 2>"$out/err" || {
      echo "psd run failed:" >&2; tail -20 "$out/err" >&2; exit 1; }
  fi
  sed 's/^\[w[0-9]*\] //' "$out/out" | grep '^{' |
    sed "s/^{/{\"kind\":\"$1\",\"model\":\"$2\",\"round\":$3,/" >>"$out/runs"
}

echo "cpus $cpus, $threads torch thread(s) per process, batch $batch per worker, 2 workers," \
     "$steps steps, models: $models" >&2
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for r in $(seq 1 "$rounds"); do
  for m in $models; do
    order=$kinds
    [ $((r % 2)) = 0 ] && order=$(echo "$kinds" | tr ' ' '\n' | tac | tr '\n' ' ')
    for k in $order; do run "$k" "$m" "$r"; done
  done
  echo "round $r of $rounds done" >&2
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
"$py" - "$out/runs" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
med = statistics.median
def fmt(v, f='%.1f'):
    return (f + ' [' + f + '-' + f + ']') % (med(v), min(v), max(v))
kinds = list(dict.fromkeys(r['kind'] for r in runs))
for m in dict.fromkeys(r['model'] for r in runs):
    ips = {k: [r['images_per_s'] for r in runs if r['model'] == m and r['kind'] == k
               and r.get('rank') == 0] for k in kinds}
    print(f"{m}: images/s " + ", ".join(f"{k} {fmt(ips[k])}" for k in kinds))
    for k in kinds:
        if k == 'gloo':
            continue
        per = [p / g for p, g in zip(ips[k], ips['gloo'])]
        print(f"{m}: {k}/gloo {med(ips[k]) / med(ips['gloo']):.3f} (of medians), "
              f"per round {fmt(per, '%.3f')}")
        diff = 0.0
        for rnd in sorted({r['round'] for r in runs}):
            loss = {x: [r['global_loss'] for r in runs if r['model'] == m and r['kind'] == x
                        and r['round'] == rnd and 'global_loss' in r] for x in ('gloo', k)}
            diff = max([diff] + [abs(a - b) for a, b in zip(loss['gloo'], loss[k])])
        print(f"{m}: largest |loss {k} - loss gloo| over every logged step: {diff:.2e}")
PY
