#!/usr/bin/env bash
# ps_scale.sh - scaling of psd past one machine, by emulation. Every ps task
# and every worker gets an emulated host of its own: a network namespace
# joined to one bridge by a veth pair, each link rate-limited in both
# directions with tc tbf (iproute2). psd and synthetic workers
# (examples/ps_scale/scale_worker: a real model's variables, a fixed compute
# time per step) run inside them; the script creates and removes everything
# itself, also on Ctrl-C or failure. Addresses only inside 10.77.0.0/24.
#
#   sudo deploy/scale/ps_scale.sh [--bin DIR] [--rate MBIT] [--model cifar|resnet50]
#        [--scale K] [--compute-ms MS] [--workers "1 2 4 8"] [--ps "1 2 4"]
#        [--steps N] [--slice-bytes B] [--queue-ms MS] [--json FILE]
#        [--psd-args "ARGS"] [--baseline "ARGS"] [--keep DIR]
#        [--wire-dtype f32|bf16|fp16] [--vs-dtype bf16|fp16|f32]
#   deploy/scale/ps_scale.sh --smoke [--bin DIR]   # 1 ps + 1 worker, seconds; 77 if
#                                                  # network namespaces are not allowed
#
# For each ps count P and worker count W it prints the step time, the
# scaling efficiency (throughput / (W x the 1-worker throughput at the same
# P)), and the link bound: the bytes through the busiest link per step
# (a worker's link carries the model each way; ps p's link carries W times
# its shard each way) over the link rate, plus the compute time. Method and
# results: docs/scaling.md. --psd-args passes options to every psd;
# --baseline runs every configuration a second time with these psd options
# instead (e.g. "--pace-ahead 0") and adds its step time and the ratio, so
# both are measured in the same run on the same links. --keep DIR keeps each
# run's logs and telemetry (workers' and psd's JSON lines) there.
# Every task is an emulated host of its own, so tensors go over TCP
# (--transport tcp, PS_TRANSPORT=tcp: the emulated hosts share this
# machine's boot id, and a worker would try the shared-memory socket of a
# ps in another namespace before falling back). --wire-dtype sets the
# workers' PS_WIRE_DTYPE (16-bit gradients and
# parameters on the wire; the link columns still count float32 model
# bytes); --vs-dtype D runs every configuration a second time with the
# workers at D and adds its step time and D's time over the main run's
# (the 16-bit target: <= 0.6 on link-bound rows).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin="$here/../../build/bin" rate=1000 model=cifar scale=1 compute_ms=100
workers_list="1 2 4 8" ps_list="1 2 4" steps=20 json="" smoke=0 slice=65536 queue_ms=100
psd_args="" baseline="" keep="" wire=f32 vs_dtype=""
die() { echo "ps_scale: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --scale) scale=$2; shift 2 ;;
    --compute-ms) compute_ms=$2; shift 2 ;;
    --workers) workers_list=$2; shift 2 ;;
    --ps) ps_list=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --json) json=$2; shift 2 ;;
    --slice-bytes) slice=$2; shift 2 ;;
    --queue-ms) queue_ms=$2; shift 2 ;;
    --psd-args) psd_args=$2; shift 2 ;;
    --baseline) baseline=$2; shift 2 ;;
    --keep) keep=$2; shift 2 ;;
    --wire-dtype) wire=$2; shift 2 ;;
    --vs-dtype) vs_dtype=$2; shift 2 ;;
    --smoke) smoke=1; shift ;;
    -h|--help) sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
for v in rate scale compute_ms steps slice queue_ms; do
  [[ "${!v}" =~ ^[0-9]+$ ]] && [ "${!v}" -ge 0 ] || die "--${v//_/-} must be a whole number, got '${!v}'"
done
[ "$rate" -ge 1 ] || die "--rate must be at least 1 Mbit/s"
[ "$model" = cifar ] || [ "$model" = resnet50 ] || die "--model must be cifar or resnet50"
for d in "$wire" ${vs_dtype:+"$vs_dtype"}; do
  case "$d" in f32|bf16|fp16) ;; *) die "wire dtypes are f32, bf16 or fp16, got '$d'" ;; esac
done
for b in psd scale_worker; do [ -x "$bin/$b" ] || die "$bin/$b not found (build first, or --bin DIR)"; done
if [ "$smoke" = 1 ]; then
  workers_list=1 ps_list=1 steps=3 scale=64 compute_ms=1 rate=100
fi

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || { [ "$smoke" = 1 ] && skip "network namespaces need root"; die "run as root (network namespaces, tc)"; }
command -v ip >/dev/null && command -v tc >/dev/null || { [ "$smoke" = 1 ] && skip "iproute2 (ip, tc) is missing"; die "install iproute2"; }

tag="pss$$"              # every name this run creates carries it
tag=${tag:0:9}           # interface names have 15 characters at most
net=10.77.0
maxp=0; for p in $ps_list; do [ "$p" -gt "$maxp" ] && maxp=$p; done
maxw=0; for w in $workers_list; do [ "$w" -gt "$maxw" ] && maxw=$w; done
nhosts=$((maxp + maxw))
[ "$nhosts" -le 200 ] || die "at most 200 emulated hosts"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ps_scale.XXXXXX")
pids=()
made_bridge=0
hosts=()

teardown() {
  set +e
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  for h in "${hosts[@]}"; do
    ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$h" 2>/dev/null
  done
  [ "$made_bridge" = 1 ] && ip link del "${tag}br" 2>/dev/null
  [ -n "$keep" ] && mkdir -p "$keep" && cp -r "$tmp"/p* "$keep"/ 2>/dev/null
  rm -rf "$tmp"
}
trap teardown EXIT
trap 'echo "ps_scale: interrupted; cleaning up" >&2; exit 130' INT TERM

# Emulated host i: namespace ${tag}h$i, address $net.(10+i), its link
# limited to $rate Mbit/s each way (tbf on both ends of the veth pair).
burst=$(( rate * 1000000 / 8 / 250 + 65536 )) # one 4 ms timer tick of data, plus a TSO segment
add_host() {
  local i=$1 h="${tag}h$1" a="${tag}a$1" b="${tag}b$1"
  ip netns add "$h" || return 1
  hosts+=("$h")
  ip link add "$a" type veth peer name "$b" || return 1
  ip link set "$a" netns "$h" || return 1
  ip link set "$b" master "${tag}br" up || return 1
  ip -n "$h" addr add "$net.$((10 + i))/24" dev "$a" || return 1
  ip -n "$h" link set "$a" up || return 1
  ip -n "$h" link set lo up || return 1
  # Clusters tuned for training keep the congestion window across the compute
  # phase; without this every step restarts TCP slow start after the idle.
  ip netns exec "$h" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0 2>/dev/null || true
  ip netns exec "$h" tc qdisc add dev "$a" root tbf rate "${rate}mbit" burst "$burst" latency "$queue_ms"ms || return 1
  tc qdisc add dev "$b" root tbf rate "${rate}mbit" burst "$burst" latency "$queue_ms"ms || return 1
}
if ! ip link add "${tag}br" type bridge 2>/dev/null; then
  [ "$smoke" = 1 ] && skip "cannot create a bridge here (no CAP_NET_ADMIN?)"
  die "cannot create a bridge"
fi
made_bridge=1
ip link set "${tag}br" up
for ((i = 0; i < nhosts; i++)); do
  if ! add_host "$i" 2>"$tmp/ip.err"; then
    [ "$smoke" = 1 ] && skip "network namespaces or tc not permitted: $(head -1 "$tmp/ip.err")"
    die "setting up host $i failed: $(cat "$tmp/ip.err")"
  fi
done
secret=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')

# One configuration: P ps on hosts 0..P-1, W workers on hosts maxp..maxp+W-1,
# psd given the options in $3 (word-split), its files under p<P>w<W>$4, the
# workers' wire dtype $5 (default: --wire-dtype).
# Prints "step_ms bytes_per_ps_max model_bytes".
run_one() {
  local P=$1 W=$2 extra=$3 hostsv="" i dt=${5:-$wire}
  local run="$tmp/p${P}w${W}$4"
  mkdir -p "$run"
  pids=()
  for ((i = 0; i < P; i++)); do
    PSD_SECRET=$secret ip netns exec "${tag}h$i" "$bin/psd" --host "$net.$((10 + i))" --port 7000 \
      --port-file "$run/port$i" --ps-index "$i" --num-ps "$P" --workers "$W" --log-level warn \
      --telemetry "$run/tel.ps$i" --startup-timeout 120 --transport tcp $extra \
      > "$run/ps$i.log" 2>&1 &
    pids+=($!)
    hostsv+="${hostsv:+,}$net.$((10 + i)):7000"
  done
  for ((i = 0; i < P; i++)); do
    for _ in $(seq 100); do [ -s "$run/port$i" ] && break; sleep 0.05; done
    [ -s "$run/port$i" ] || { cat "$run/ps$i.log" >&2; die "psd $i did not start"; }
  done
  local wp=()
  for ((i = 0; i < W; i++)); do
    PS_HOSTS=$hostsv PS_WORKER_INDEX=$i PS_NUM_WORKERS=$W PS_SECRET=$secret \
      PS_TELEMETRY="$run/tel.w$i" PS_CONNECT_TIMEOUT_MS=30000 PS_MAX_SLICE_BYTES=$slice \
      PS_WIRE_DTYPE=$dt PS_TRANSPORT=tcp \
      ip netns exec "${tag}h$((maxp + i))" "$bin/scale_worker" --model "$model" --scale "$scale" \
      --compute-ms "$compute_ms" --steps "$steps" > "$run/w$i.out" 2> "$run/w$i.err" &
    wp+=($!)
    pids+=($!)
  done
  local failed=0
  for p in "${wp[@]}"; do wait "$p" || failed=1; done
  for ((i = 0; i < P; i++)); do wait "${pids[$i]}" || failed=1; done
  pids=()
  if [ "$failed" = 1 ]; then
    tail -n 5 "$run"/*.err "$run"/*.log >&2
    die "P=$P W=$W failed (logs above)"
  fi
  # The slowest worker's mean step (they run in lock step), the largest
  # shard's bytes per step (from worker 0's telemetry), the model's bytes.
  local step bytes
  step=$(sed -n 's/.*"mean_step_ms":\([0-9.]*\).*/\1/p' "$run"/w*.out | sort -g | tail -1)
  bytes=$(tail -1 "$run/tel.w0" | sed 's/.*"push_bytes":\[\([0-9,]*\)\].*/\1/' | tr ',' '\n' | sort -n | tail -1)
  echo "$step $bytes $(sed -n 's/.*"bytes":\([0-9]*\).*/\1/p' "$run/w0.out")"
}

if [ "$smoke" = 1 ]; then
  read -r step bytes mb < <(run_one 1 1 "$psd_args" "")
  echo "ok: 1 ps + 1 worker across namespaces with ${rate} Mbit/s links: step ${step} ms, $mb model bytes"
  exit 0
fi

printf "model %s / %s, compute %s ms per step, links %s Mbit/s each way, %s steps per run, %s-byte slices, wire %s%s\n" \
  "$model" "$scale" "$compute_ms" "$rate" "$steps" "$slice" "$wire" "${psd_args:+, psd $psd_args}"
[ -n "$vs_dtype" ] && echo "vs: the same runs with workers at $vs_dtype (vs_ms; vs = vs_ms / step_ms)"
[ -n "$baseline" ] && echo "baseline: the same runs with psd $baseline (base_ms; gain = base_ms / step_ms)"
printf "%3s %3s %10s %12s %6s %12s %10s %9s %8s %-19s%s%s\n" ps wkrs step_ms speedup "eff" \
  "busiest_MB" link_ms bound_ms "of_bnd" target "${baseline:+   base_ms   gain}" \
  "${vs_dtype:+     vs_ms     vs}"
[ -n "$json" ] && : > "$json"
for P in $ps_list; do
  s1=""
  for W in $workers_list; do
    read -r step bytes mb < <(run_one "$P" "$W" "$psd_args" "")
    base=0
    [ -n "$baseline" ] && read -r base _ _ < <(run_one "$P" "$W" "$baseline" "-base")
    vs=0
    [ -n "$vs_dtype" ] && read -r vs _ _ < <(run_one "$P" "$W" "$psd_args" "-$vs_dtype" "$vs_dtype")
    [ -n "$s1" ] || s1=$step
    awk -v P="$P" -v W="$W" -v step="$step" -v s1="$s1" -v shard="$bytes" -v mb="$mb" \
        -v rate="$rate" -v c="$compute_ms" -v json="$json" -v model="$model" -v scale="$scale" \
        -v base="$base" -v vs="$vs" -v wire="$wire" -v vsd="$vs_dtype" '
      BEGIN {
        busiest = W * shard > mb ? W * shard : mb
        link = busiest * 8 / (rate * 1e6) * 1e3
        bound = c + link
        eff = s1 / step               # (W/step) / (W x 1/s1)
        ofb = bound / step
        allow = bound <= s1 / 0.9     # the links permit >= 90% efficiency
        ok = allow ? (eff >= 0.9) : (ofb >= 0.9)
        tgt = (allow ? "eff>=90%: " : "bound>=90%: ") (ok ? "met" : "MISSED")
        printf "%3d %3d %10.1f %12.2f %5.0f%% %12.2f %10.1f %9.1f %7.0f%% %-19s",
               P, W, step, W * s1 / step, 100 * eff, busiest / 1e6, link, bound, 100 * ofb, tgt
        if (base > 0) printf " %9.1f %5.2fx", base, base / step
        if (vs > 0) printf " %9.1f %5.2fx", vs, vs / step
        printf "\n"
        if (json != "")
          printf "{\"model\":\"%s\",\"scale\":%d,\"ps\":%d,\"workers\":%d,\"rate_mbit\":%d," \
                 "\"compute_ms\":%d,\"step_ms\":%.2f,\"efficiency\":%.4f,\"busiest_bytes\":%d," \
                 "\"link_ms\":%.2f,\"bound_ms\":%.2f,\"of_bound\":%.4f,\"target_met\":%s," \
                 "\"baseline_step_ms\":%.2f,\"wire_dtype\":\"%s\",\"vs_dtype\":\"%s\"," \
                 "\"vs_step_ms\":%.2f}\n",
                 model, scale, P, W, rate, c, step, eff, busiest, link, bound, ofb,
                 ok ? "true" : "false", base, wire, vsd, vs >> json
      }'
  done
done
