#!/usr/bin/env bash
# Integration tests of psrun with a real, private Slurm cluster on this
# machine (deploy/slurm/cluster.sh): loopback mode, then network-namespace
# mode. Needs root (the cluster's daemons); prints SKIP otherwise.
# Usage: slurm_test.sh BIN_DIR
set -uo pipefail
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER="$HERE/../deploy/slurm/cluster.sh"
export PS_SLURM_DIR=${PS_SLURM_DIR:-/tmp/ps-slurm-test-$$}
export PS_SLURM_PORT_BASE=${PS_SLURM_PORT_BASE:-17200}
# Overridable, so that two checkouts can run this suite side by side.
export PS_SLURM_NETNS_PREFIX=${PS_SLURM_NETNS_PREFIX:-pst-} PS_SLURM_BRIDGE=${PS_SLURM_BRIDGE:-pstbr0}
export PS_SLURM_SUBNET=${PS_SLURM_SUBNET:-10.77.2}
WORK=$(mktemp -d /tmp/slurm_test.XXXXXX)
chmod 755 "$WORK"
pass=0
fail=0

if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: the Slurm tests start slurmctld/slurmd and need root"
  exit 77
fi

cleanup() {
  bash "$CLUSTER" stop >/dev/null 2>&1 || true
  [ -n "${PS_SLURM_KEEP:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT

ok() { echo "PASS: $1"; pass=$((pass + 1)); }
bad() {
  echo "FAIL: $1"
  [ -n "${2:-}" ] && [ -f "$2" ] && tail -n 30 "$2" | sed 's/^/    /'
  fail=$((fail + 1))
}
# Nothing of ours may survive a job: psd or workers with this marker.
no_leftovers() {
  no_leftovers_of "tiny_worke[r] --steps $1 "
}
# no_leftovers_of PATTERN: no process matching PATTERN (pgrep -f) nor a psd
# of this build is left; names them otherwise.
no_leftovers_of() {
  sleep 1
  if pgrep -f "$1" >/dev/null || pgrep -f "$BIN/ps[d] " >/dev/null; then
    pgrep -af "$1|$BIN/ps[d] "
    return 1
  fi
  return 0
}

# The requeued run has the same job id, and its step the same step id, as
# the run before it: a node where the earlier run's step JOB.0 was still
# ending (its slurmstepd reports the end to slurmctld last) when the new one
# launched had two steps of that name, and the late report was taken for
# the new step's. Prints the node where that happened, if any.
step_overlap() {
  local f
  for f in "$PS_SLURM_DIR"/log/slurmd.n*.log; do
    awk -v j="$1" -v n="$(basename "$f" .log)" '
      index($0, "launch task StepId=" j ".0 ") { if (open) { print n ": step " j ".0 of the requeued run launched while the earlier run'"'"'s was still ending"; exit } open = 1 }
      index($0, "[" j ".0] done with job") { open = 0 }' "$f"
  done
}

# psd outliving the workers, under MUNGE: workers 1 and 2 exit 0 without
# ps_client_finish (2 losses, 1 backup); 30 s after the last worker task
# ended, task 0 asks the running psd (secret and MUNGE) and names them, and
# the step exits 1 before psd's own 60 s. Worker 0 first runs psctl with
# nothing but its environment (PS_SECRET, PS_MUNGE, PS_JOB_ID, PS_STEP_ID,
# PS_MUNGE_SOCKET), which reaches its psd.
outlived_and_psctl() {
  local out=$WORK/outlived.log rc
  local t0=$SECONDS
  TW="$BIN/tiny_worker" PSCTL="$BIN/psctl" timeout 120 srun -N2 -n4 "$BIN/psrun" --ps=1 \
    --backup-workers 1 -- /bin/sh -c '
    case $PS_WORKER_INDEX in
      0) "$PSCTL" stats "${PS_HOSTS%%,*}" >"$0" 2>&1; echo "psctl: $?" >>"$0"
         exec "$TW" --steps 113 ;;
      1) "$TW" --steps 113 --sleep-ms 5 --fail-at-step 20; exit 0 ;;
      2) exec "$TW" --steps 113 --sleep-ms 5 --skip-finish 1 ;;
    esac' "$out.psctl" >"$out" 2>&1
  rc=$?
  local took=$((SECONDS - t0))
  cat "$out.psctl" >>"$out" 2>/dev/null
  if [ $rc -eq 1 ] && [ $took -lt 60 ] &&
     grep -q "did not exit within 30 s after the workers finished: psd never saw w1 (lost), w2 (lost) call ps_client_finish" "$out" &&
     grep -q "^psctl: 0$" "$out.psctl" && grep -q "ps 0 of 1" "$out.psctl" && no_leftovers 113; then
    ok "loopback: psd outliving the workers is named by task 0 (MUNGE) in ${took}s; psctl from a worker's environment"
  else bad "loopback: psd outliving the workers / psctl from the environment (rc $rc, ${took}s)" "$out"; fi
}

# usr1_when JOB PATTERN FILE PID: once FILE has a line matching PATTERN
# (60 s at most), scancel --signal=USR1 the job named JOB; returns the exit
# status of the srun PID.
usr1_when() {
  for _ in $(seq 600); do
    grep -q "$2" "$3" 2>/dev/null && break
    sleep 0.1
  done
  scancel --signal=USR1 "$(squeue -h -n "$1" -o %i | head -1)"
  wait "$4"
}

preemption() {
  local out=$WORK/preempt.log synth=$WORK/synth
  local args="--steps 120 --batch 16 --threads 1 --lr 0.05"
  "$BIN/cifar_synth" --out "$synth" --train 2560 --test 200 >/dev/null || {
    bad "preemption: cifar_synth"; return; }
  # The reference: the same job, never interrupted.
  if ! timeout 300 srun -N2 -n3 "$BIN/psrun" --ps=1 --checkpoint-dir "$WORK/ck.ref" -- \
      "$BIN/cifar_worker" --data "$synth" $args --dump-params "$WORK/ref.bin" \
      >"$WORK/preempt.ref.log" 2>&1; then
    bad "preemption: reference run" "$WORK/preempt.ref.log"; return
  fi
  local job
  job=$(PSD_HOME=$BIN CKPT=$WORK/ck DATA=$synth CKPT_SECS=0 \
    WORKER_ARGS="$args --dump-params $WORK/resumed.bin" \
    sbatch --parsable -N2 -n3 --cpus-per-task=1 -o "$out" \
    "$HERE/../deploy/slurm/train-cpu.sbatch")
  for _ in $(seq 300); do
    grep -q 'w0 step' "$out" 2>/dev/null && break
    sleep 0.2
  done
  scancel --batch --signal=USR1 "$job"
  # The job stops, requeues itself and runs again to the end. Slurm holds
  # a requeued job back (BeginTime) so that its earlier run is over on
  # every node first: a node revokes the job's credential when it ends the
  # run, and refuses a launch whose credential is not newer, to the second,
  # than that revocation ("Killing non-startable batch JobId=N: Job
  # credential revoked"; the job then ends with status 1 and leaves the
  # queue). The test shortens the hold, but only once no slurmstepd of the
  # job is left (it is requeued, so none of a new run can exist) and a
  # second has passed since.
  for _ in $(seq 300); do
    grep -q "requeueing" "$out" 2>/dev/null && break
    sleep 0.2
  done
  local released=0
  for _ in $(seq 900); do
    if [ $released -eq 0 ] && squeue -h -j "$job" -t PD 2>/dev/null | grep -q . &&
       ! pgrep -f "^slurmstepd: \[$job\." >/dev/null; then
      sleep 1.1
      scontrol update JobId="$job" StartTime=now >/dev/null 2>&1 && released=1
    fi
    grep -q '"test_accuracy":[0-9]' "$out" 2>/dev/null &&
      [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
    sleep 0.2
  done
  local stop_step overlap
  stop_step=$(sed -n 's/.*checkpointed step \([0-9]*\);.*/\1/p' "$out" | head -1)
  overlap=$(step_overlap "$job")
  [ -n "$overlap" ] && echo "    $overlap"
  if [ -z "$overlap" ] && grep -q "stopped after a checkpoint" "$out" && grep -q "requeueing" "$out" &&
     grep -q "resuming at step $stop_step\$" "$out" && [ -n "$stop_step" ] &&
     cmp -s "$WORK/ref.bin" "$WORK/resumed.bin" && no_leftovers 0 &&
     ! pgrep -f "cifar_worke[r] --data $synth" >/dev/null; then
    ok "loopback: SIGUSR1 to the batch shell: checkpoint at step $stop_step, exit 75, requeue, resumed run equals the uninterrupted one"
  else
    scontrol show job "$job" 2>&1 | grep -E "JobState|Time=|Restarts" | sed 's/^/    /'
    grep -h "JobId=$job[^0-9]" "$PS_SLURM_DIR/log/slurmctld.log" | sed 's/^/    slurmctld: /'
    scancel "$job" 2>/dev/null
    bad "loopback: preemption and requeue (stopped at '${stop_step}')" "$out"
  fi

  # scancel --signal=USR1 (every task of the job) on an srun job, then the
  # same srun again.
  out=$WORK/preempt2.log
  timeout 300 srun -J psd-preempt2 -N2 -n3 "$BIN/psrun" --ps=1 --checkpoint-dir "$WORK/ck2" -- \
    "$BIN/cifar_worker" --data "$synth" $args --dump-params "$WORK/resumed2.bin" >"$out" 2>&1 &
  local rc1
  usr1_when psd-preempt2 'w0 step' "$out" $!
  rc1=$?
  timeout 300 srun -J psd-preempt2 -N2 -n3 "$BIN/psrun" --ps=1 --checkpoint-dir "$WORK/ck2" -- \
    "$BIN/cifar_worker" --data "$synth" $args --dump-params "$WORK/resumed2.bin" >>"$out" 2>&1
  local rc2=$?
  stop_step=$(sed -n 's/.*checkpointed step \([0-9]*\);.*/\1/p' "$out" | head -1)
  if [ $rc1 -eq 75 ] && [ $rc2 -eq 0 ] && [ -n "$stop_step" ] &&
     grep -q "resuming at step $stop_step\$" "$out" &&
     cmp -s "$WORK/ref.bin" "$WORK/resumed2.bin" && no_leftovers 0; then
    ok "loopback: scancel --signal=USR1: exit 75 at step $stop_step, srun again resumes, parameters equal"
  else bad "loopback: scancel --signal=USR1 (exit $rc1 then $rc2)" "$out"; fi
}

# The workers' torchrun variables: every worker prints a "torchenv" line
# and worker 0 listens on MASTER_PORT (as torch.distributed's TCPStore does:
# all interfaces) until every other worker has connected to
# MASTER_ADDR:MASTER_PORT, across nodes in netns mode. Then the command.
write_torchenv() {
  cat >"$WORK/torchenv.py" <<'EOP'
import os, socket, sys, time
n, rank, port = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
if rank == 0:
    s = socket.socket()
    s.bind(("", port))
    s.listen(64)
    s.settimeout(60)
    for _ in range(n - 1):
        s.accept()[0].close()
    print("torchenv-store w0 accepted %d" % (n - 1), flush=True)
    sys.exit(0)
for _ in range(600):
    try:
        socket.create_connection((os.environ["MASTER_ADDR"], port), 1).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("w%d cannot reach MASTER_ADDR:MASTER_PORT %s:%d" % (rank, os.environ["MASTER_ADDR"], port))
EOP
  cat >"$WORK/torchenv.sh" <<EOS
#!/bin/sh
echo "torchenv w\$PS_WORKER_INDEX node=\$SLURMD_NODENAME RANK=\$RANK WORLD_SIZE=\$WORLD_SIZE LOCAL_RANK=\$LOCAL_RANK LOCAL_WORLD_SIZE=\$LOCAL_WORLD_SIZE PS_LOCAL_RANK=\$PS_LOCAL_RANK MASTER=\$MASTER_ADDR:\$MASTER_PORT"
/usr/bin/python3 "$WORK/torchenv.py" || exit 1
exec "\$@"
EOS
  chmod 755 "$WORK/torchenv.sh"
}

# check_torch_env FILE N: the N workers' "torchenv" lines in FILE keep
# torchrun's contract: RANK is the worker index, WORLD_SIZE N, LOCAL_RANK
# (and PS_LOCAL_RANK) 0..k-1 over the k workers of each node, ps tasks not
# counted, LOCAL_WORLD_SIZE k, one MASTER_ADDR:MASTER_PORT everywhere, and
# MASTER_ADDR the address (NodeAddr) of worker 0's node. Prints what is
# wrong and fails otherwise.
check_torch_env() {
  local file=$1 n=$2 node0 addr0
  node0=$(sed -n 's/.*torchenv w0 node=\([^ ]*\) .*/\1/p' "$file" | head -1)
  addr0=$(scontrol show node "$node0" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  grep -o 'torchenv w[0-9].*' "$file" | awk -v n="$n" -v addr0="$addr0" '
    { delete v
      for (i = 3; i <= NF; i++) { k = substr($i, 1, index($i, "=") - 1); v[k] = substr($i, length(k) + 2) }
      w = substr($2, 2); lines++; node = v["node"]
      if (v["RANK"] != w || v["WORLD_SIZE"] != n) bad = bad " w" w ": RANK=" v["RANK"] " WORLD_SIZE=" v["WORLD_SIZE"] ";"
      if (v["LOCAL_RANK"] == "" || v["PS_LOCAL_RANK"] != v["LOCAL_RANK"] || v["LOCAL_RANK"] + 0 >= v["LOCAL_WORLD_SIZE"] + 0)
        bad = bad " w" w ": LOCAL_RANK=" v["LOCAL_RANK"] " PS_LOCAL_RANK=" v["PS_LOCAL_RANK"] " LOCAL_WORLD_SIZE=" v["LOCAL_WORLD_SIZE"] ";"
      if (seen[node, v["LOCAL_RANK"]]++) bad = bad " LOCAL_RANK " v["LOCAL_RANK"] " twice on " node ";"
      if (!(node in size)) size[node] = v["LOCAL_WORLD_SIZE"]
      if (size[node] != v["LOCAL_WORLD_SIZE"]) bad = bad " " node ": LOCAL_WORLD_SIZE " size[node] " and " v["LOCAL_WORLD_SIZE"] ";"
      count[node]++
      if (lines == 1) master = v["MASTER"]
      if (v["MASTER"] != master) bad = bad " w" w ": MASTER " v["MASTER"] ", not " master ";" }
    END {
      if (lines != n) bad = bad " " lines + 0 " torchenv lines, not " n ";"
      for (node in count) if (count[node] != size[node]) bad = bad " " node ": " count[node] " workers but LOCAL_WORLD_SIZE=" size[node] ";"
      addr = master; sub(/:[0-9]+$/, "", addr)
      if (addr0 == "" || addr != addr0 || master !~ /:[0-9]+$/) bad = bad " MASTER " master " is not on worker 0 node address " addr0 ";"
      if (bad != "") { print "    torchrun variables:" bad; exit 1 } }'
}

# srun -N2 -n4 on n1,n2 (n1: ps0 and w0; n2: w1 and w2): the workers'
# torchrun variables (check_torch_env), worker 0 reachable at
# MASTER_ADDR:MASTER_PORT from the other node, and psrun's values over the
# stale ones in the user's environment.
torch_env_job() {
  local mode=${1:-loopback} out rc
  out=$WORK/$mode.torchenv.log
  write_torchenv
  RANK=99 WORLD_SIZE=99 LOCAL_RANK=99 LOCAL_WORLD_SIZE=99 MASTER_ADDR=192.0.2.1 MASTER_PORT=1 \
    timeout 120 srun -N2 -n4 -w n1,n2 --ntasks-per-node=2 "$BIN/psrun" --ps=1 -- \
    "$WORK/torchenv.sh" "$BIN/tiny_worker" --steps 112 >"$out" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && check_torch_env "$out" 3 && grep -q "torchenv-store w0 accepted 2" "$out" &&
     grep -q "torchenv w2 node=n2 RANK=2 WORLD_SIZE=3 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 " "$out" &&
     grep -q "torchenv w0 node=n1 RANK=0 WORLD_SIZE=3 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 " "$out" &&
     [ "$(grep -c '"steps":112' "$out")" -eq 3 ] && no_leftovers 112; then
    ok "$mode: every worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and worker 0's MASTER_ADDR:MASTER_PORT, reachable from the other node"
  else bad "$mode: torchrun variables (rc $rc)" "$out"; fi
}

python_torch_job() {
  local out=$WORK/python.log
  if ! /usr/bin/python3 -c 'import torch, numpy' 2>/dev/null; then
    echo "SKIP: loopback: the PyTorch example (python3-torch or python3-numpy not installed)"
    return
  fi
  "$BIN/cifar_synth" --out "$WORK/pysynth" --train 640 --test 100 --seed 4 >/dev/null
  if timeout 180 srun -N2 -n3 "$BIN/psrun" --ps=1 -- /usr/bin/python3 \
      "$HERE/../examples/python/cifar10_torch.py" --data "$WORK/pysynth" --steps 6 --batch 16 \
      >"$out" 2>&1 &&
     [ "$(grep -c '"steps": *6' "$out")" -eq 2 ] && no_leftovers_of "cifar10_torc[h]\.py"; then
    ok "loopback: srun psrun --ps=1 python3 examples/python/cifar10_torch.py trains and exits 0"
  else bad "loopback: the PyTorch example under Slurm" "$out"; fi
  # A plain DDP script on the psd backend, ranks on two nodes: every rank
  # ends with the same parameters (DDP's buckets averaged through psd).
  out=$WORK/python_ddp.log
  if timeout 180 srun -N2 -n4 "$BIN/psrun" --ps=1 -- /usr/bin/python3 \
      "$HERE/../examples/python/train_ddp_psd.py" --synthetic 256 --model small --steps 6 \
      --batch 16 --warmup 1 --log-every 1 >"$out" 2>&1 &&
     [ "$(grep -c '"backend": "psd", "steps": 6' "$out")" -eq 3 ] &&
     [ "$(grep -o '"param_checksum": [-0-9.e]*' "$out" | sort -u | wc -l)" -eq 1 ] &&
     no_leftovers_of "train_ddp_ps[d]\.py"; then
    ok "loopback: srun -N2 -n4 psrun --ps=1 python3 train_ddp_psd.py: DDP on the psd backend, 3 ranks end equal"
  else bad "loopback: the DDP script on the psd backend under Slurm" "$out"; fi
  ddp_preemption
}

# A DDP job with psd.torch.Checkpoint, ranks on two nodes: scancel
# --signal=USR1 stops it with exit 75 after its state is saved; the same
# srun again resumes, and the final parameters equal an uninterrupted run's.
ddp_preemption() {
  local out=$WORK/ddp_preempt.log w="$HERE/../python/tests/c10d_worker.py" rc1 rc2
  local run=(srun -J psd-ddp-preempt -N2 -n3 "$BIN/psrun" --ps=1)
  timeout 180 "${run[@]}" --checkpoint-dir "$WORK/ck-ddp-ref" -- /usr/bin/python3 "$w" \
    preempt "$WORK/ddp_ref.pt" 80 >"$out.ref" 2>&1
  timeout 180 "${run[@]}" --checkpoint-dir "$WORK/ck-ddp" -- /usr/bin/python3 "$w" \
    preempt "$WORK/ddp_out.pt" 80 >"$out" 2>&1 &
  usr1_when psd-ddp-preempt 'step 9$' "$out" $!
  rc1=$?
  timeout 180 "${run[@]}" --checkpoint-dir "$WORK/ck-ddp" -- /usr/bin/python3 "$w" \
    preempt "$WORK/ddp_out.pt" 80 >>"$out" 2>&1
  rc2=$?
  if [ $rc1 -eq 75 ] && [ $rc2 -eq 0 ] && grep -q "psd.torch.Checkpoint: resuming at step" "$out" &&
     grep -q "stopped on request after step" "$out" &&
     /usr/bin/python3 -c 'import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
sys.exit(not (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)))' \
       "$WORK/ddp_ref.pt" "$WORK/ddp_out.pt" && no_leftovers_of "c10d_worke[r]\.py"; then
    ok "loopback: DDP with psd.torch.Checkpoint: scancel --signal=USR1 exits 75, srun again resumes, parameters bit-identical"
  else bad "loopback: DDP preemption under Slurm (exit $rc1 then $rc2)" "$out"; fi
}

scenarios() {
  local mode=$1 out
  cd "$WORK" || exit 1

  # 1. Eight tasks on four nodes: 2 ps + 6 workers train and exit 0.
  out=$WORK/$mode.basic.log
  if timeout 120 srun -N4 -n8 --ntasks-per-node=2 "$BIN/psrun" --ps=2 -- \
      "$BIN/tiny_worker" --steps 101 >"$out" 2>&1 &&
     [ "$(grep -c '"steps":101' "$out")" -eq 6 ] &&
     ! grep -q '"accuracy":0\.[0-8]' "$out" &&
     grep -q "psd telemetry summary: ps0 of 2, 6 workers, 101 steps" "$out" &&
     [ "$(grep -c '^w[0-5]\*\? ' "$out")" -eq 6 ]; then
    ok "$mode: srun -N4 -n8 psrun --ps=2 trains and exits 0; ps0 prints the telemetry summary"
  else bad "$mode: srun -N4 -n8 psrun --ps=2" "$out"; fi

  # 2. PMI-2 carries the rendezvous address.
  out=$WORK/$mode.pmi2.log
  if timeout 120 srun -N4 -n8 --ntasks-per-node=2 --mpi=pmi2 "$BIN/psrun" --ps=2 -- \
      "$BIN/tiny_worker" --steps 102 >"$out" 2>&1 &&
     grep -q "(PMI-2)" "$out" && [ "$(grep -c '"steps":102' "$out")" -eq 6 ]; then
    ok "$mode: --mpi=pmi2"
  else bad "$mode: --mpi=pmi2" "$out"; fi

  # 3. A worker that exits 1 ends the step promptly, non-zero, nothing left.
  out=$WORK/$mode.fail.log
  local t0=$SECONDS
  timeout 120 srun -N2 -n4 "$BIN/psrun" --ps=1 -- \
    "$BIN/tiny_worker" --steps 103 --sleep-ms 20 --fail-at-step 10 >"$out" 2>&1
  local rc=$? took=$((SECONDS - t0))
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 30 ] &&
     grep -q "exited with status 1; stopping every task" "$out" && no_leftovers 103; then
    ok "$mode: a failing worker stops the step (exit $rc in ${took}s), no process left"
  else bad "$mode: failing worker (rc $rc, ${took}s)" "$out"; fi

  # 4. scancel --signal=TERM shuts a running job down cleanly.
  out=$WORK/$mode.term.log
  cat >"$WORK/term.sh" <<EOS
#!/bin/bash
srun "$BIN/psrun" --ps=1 -- "$BIN/tiny_worker" --steps 104 --sleep-ms 50
EOS
  local job
  job=$(sbatch --parsable -N2 -n3 -o "$out" "$WORK/term.sh")
  for _ in $(seq 100); do
    grep -q "parameter servers:" "$out" 2>/dev/null && break
    sleep 0.2
  done
  sleep 1
  scancel --signal=TERM "$job"
  for _ in $(seq 100); do
    [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
    sleep 0.2
  done
  if [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && grep -q "shutting down" "$out" &&
     no_leftovers 104; then
    ok "$mode: scancel --signal=TERM ends the job cleanly"
  else
    scancel "$job" 2>/dev/null
    bad "$mode: scancel --signal=TERM" "$out"
  fi

  # 5. Two jobs on the same nodes at once do not collide.
  timeout 120 srun -N2 -n4 "$BIN/psrun" --ps=1 -- "$BIN/tiny_worker" --steps 105 \
    >"$WORK/$mode.j1.log" 2>&1 &
  local p1=$!
  timeout 120 srun -N2 -n4 "$BIN/psrun" --ps=1 -- "$BIN/tiny_worker" --steps 106 \
    >"$WORK/$mode.j2.log" 2>&1 &
  local p2=$!
  wait $p1; local r1=$?
  wait $p2; local r2=$?
  if [ $r1 -eq 0 ] && [ $r2 -eq 0 ] && [ "$(grep -c '"steps":105' "$WORK/$mode.j1.log")" -eq 3 ] &&
     [ "$(grep -c '"steps":106' "$WORK/$mode.j2.log")" -eq 3 ]; then
    ok "$mode: two jobs at once"
  else bad "$mode: two jobs at once ($r1, $r2)" "$WORK/$mode.j2.log"; fi

  # 6. Heterogeneous job: ps tasks on the first component.
  out=$WORK/$mode.het.log
  if timeout 120 srun -N1 -n2 : -N2 -n4 "$BIN/psrun" --ps=2 -- \
      "$BIN/tiny_worker" --steps 107 >"$out" 2>&1 &&
     [ "$(grep -c '"steps":107' "$out")" -eq 4 ] &&
     grep -q "ps tasks: ps0=rank 0 on n1, ps1=rank 1 on n1" "$out"; then
    ok "$mode: heterogeneous job, ps on the first component"
  else bad "$mode: heterogeneous job" "$out"; fi

  # 7. A ps step of its own, and a worker step started later in the job,
  # whose workers get torchrun's variables too (worker 0 of the step is
  # the master; check_torch_env).
  out=$WORK/$mode.steps.log
  mkdir -p "$WORK/rdv.$mode"
  write_torchenv
  cat >"$WORK/steps.sh" <<EOS
#!/bin/bash
srun --exact --mem=0 -n2 -c1 "$BIN/psrun" --role=ps --rendezvous "$WORK/rdv.$mode" &
ps=\$!
srun --exact --mem=0 -n3 -c1 "$BIN/psrun" --role=worker --rendezvous "$WORK/rdv.$mode" \
  "$WORK/torchenv.sh" "$BIN/tiny_worker" --steps 108
w=\$?
wait \$ps
echo "steps: worker \$w ps \$?"
EOS
  if timeout 120 sbatch --wait -N2 -n6 -o "$out" "$WORK/steps.sh" >/dev/null &&
     grep -q "steps: worker 0 ps 0" "$out" && [ "$(grep -c '"steps":108' "$out")" -eq 3 ] &&
     check_torch_env "$out" 3 && grep -q "torchenv-store w0 accepted 2" "$out"; then
    ok "$mode: separate ps step and worker step (torchrun's variables too)"
  else bad "$mode: separate ps and worker steps" "$out"; fi

  # 7b. torchrun's variables in an ordinary step, across two nodes.
  torch_env_job "$mode"

  # 8. A rendezvous port held by a stranger (nobody) that answers like task
  # 0: task 0 reports the port in use, the members refuse the stranger,
  # nothing starts.
  out=$WORK/$mode.busy.log
  local port=$((PS_SLURM_PORT_BASE + 90))
  local inns=()
  # In netns mode task 0's node n1 has a network of its own: block it there.
  [ "$mode" = netns ] && inns=(nsenter "--net=/var/run/netns/${PS_SLURM_NETNS_PREFIX}n1")
  # (The system's python: the caller's PATH may name one nobody cannot read.)
  "${inns[@]}" setpriv --reuid=nobody --regid=nogroup --clear-groups /usr/bin/python3 -c "import socket,time
s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('0.0.0.0', $port)); s.listen(8)
while True:
    c,_=s.accept(); c.sendall(b'RDV PSRUN2 munge\n'); c.recv(4096)
    c.sendall(b'ROLE worker 0 1 1 MUNGE:forged:\n')" &
  local blocker=$!
  sleep 0.5
  timeout 60 srun -N2 -n3 -w n1,n2 "$BIN/psrun" --ps=1 --rendezvous-port $port --connect-timeout 10 -- \
    "$BIN/tiny_worker" --steps 109 >"$out" 2>&1
  rc=$?
  kill $blocker 2>/dev/null
  wait $blocker 2>/dev/null
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "another process holds it" "$out" &&
     grep -q "did not prove itself, so this task does not trust it" "$out" &&
     ! grep -q '"steps":109' "$out" && no_leftovers 109; then
    ok "$mode: a stranger holding the rendezvous port is reported and refused (exit $rc)"
  else bad "$mode: stranger on the rendezvous port (rc $rc)" "$out"; fi

  # 9. A forged check-in (nobody, claiming rank 1 with a made-up MUNGE
  # credential) and two silent connections, all before the real tasks:
  # refused and logged, the job trains and exits 0. Rank 2 starts 3 s late,
  # so the forger is surely heard while task 0 is still taking check-ins.
  out=$WORK/$mode.forged.log
  port=$((PS_SLURM_PORT_BASE + 91))
  local n1addr
  n1addr=$(scontrol show node n1 | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
  "${inns[@]}" setpriv --reuid=nobody --regid=nogroup --clear-groups bash -c "
for i in \$(seq 400); do exec 3<>/dev/tcp/$n1addr/$port && break; sleep 0.05; done 2>/dev/null
exec 4<>/dev/tcp/$n1addr/$port 5<>/dev/tcp/$n1addr/$port
read -t 10 l <&5; echo \"forger greeted: \$l\"
echo \"HELLO PSRUN2 \$(squeue -h -o %i -n psd-forged | head -1) 0 65534 3 1 n1 0 \$(printf %064d 1) MUNGE:forged:\" >&5
read -t 10 l <&5; echo \"forger answered: \$l\"; sleep 20" >"$out.forger" 2>&1 &
  local forger=$!
  local start=$SECONDS
  timeout 120 srun -J psd-forged -N2 -n3 -w n1,n2 bash -c '[ "$SLURM_PROCID" = 2 ] && sleep 3
    exec "$0" "$@"' "$BIN/psrun" --ps=1 --rendezvous-port $port \
    --connect-timeout 20 -- "$BIN/tiny_worker" --steps 110 >"$out" 2>&1
  rc=$?
  local took=$((SECONDS - start))
  kill $forger 2>/dev/null
  wait $forger 2>/dev/null
  cat "$out.forger" >>"$out"
  if [ $rc -eq 0 ] && grep -q "forger answered: REJECT" "$out" &&
     grep -q "refused a check-in from" "$out" && [ "$(grep -c '"steps":110' "$out")" -eq 2 ] &&
     [ $took -lt 10 ] && no_leftovers 110; then
    ok "$mode: a forged check-in is refused, silent connections cost nothing (${took}s)"
  else bad "$mode: forged check-in (rc $rc, ${took}s)" "$out"; fi

  # 10a. psctl reaches a running step with the line task 0 prints (its
  # node is this machine in loopback mode); the credential is gone after.
  if [ "$mode" = loopback ]; then
    out=$WORK/$mode.psctl.log
    timeout 120 srun -N2 -n3 "$BIN/psrun" --ps=1 -- "$BIN/tiny_worker" --steps 111 \
      --sleep-ms 50 >"$out" 2>&1 &
    local sp=$! line="" cred prc
    for _ in $(seq 300); do
      line=$(grep -o 'psctl stats .*' "$out" 2>/dev/null | head -1)
      [ -n "$line" ] && break
      sleep 0.1
    done
    cred=${line##*--secret-file }
    # shellcheck disable=SC2086 # the printed line, split into its words
    "$BIN/"$line >"$out.psctl" 2>&1
    prc=$?
    wait $sp
    rc=$?
    cat "$out.psctl" >>"$out"
    if [ -n "$line" ] && [ $prc -eq 0 ] && grep -q "ps0 at .*ps 0 of 1" "$out.psctl" &&
       [ $rc -eq 0 ] && [ ! -e "$cred" ]; then
      ok "$mode: the psctl line psrun prints reaches the step (MUNGE, --job), credential removed"
    else bad "$mode: psctl line (psctl $prc, srun $rc, '$line')" "$out"; fi
  fi

  # 10b. psd outliving the workers, and psctl inside the step (loopback).
  if [ "$mode" = loopback ]; then
    outlived_and_psctl
  fi

  # 10c. The PyTorch example under Slurm (loopback): one srun line, two
  # Python workers through psd.torch, each exits 0 with its summary line.
  if [ "$mode" = loopback ]; then
    python_torch_job
  fi

  # 10. Preemption (loopback only: it is slow). The real template
  # deploy/slurm/train-cpu.sbatch trains the CIFAR-10 example; SIGUSR1 to its
  # batch shell (what --signal=B:USR1@T sends) makes every ps checkpoint one
  # step, every task exit 75 and the script requeue the job, which resumes
  # there and ends with the parameters of an uninterrupted run, bit for bit.
  if [ "$mode" = loopback ]; then
    preemption
  fi

  # 9. --addr picks the network (netns: the namespaces' subnet).
  if [ "$mode" = netns ]; then
    out=$WORK/$mode.addr.log
    if timeout 120 srun -N2 -n3 "$BIN/psrun" --ps=1 --addr "$PS_SLURM_SUBNET.0/24" -- \
        "$BIN/tiny_worker" --steps 110 >"$out" 2>&1 &&
       grep -q "rendezvous on $PS_SLURM_SUBNET\." "$out" &&
       grep -q "parameter servers: $PS_SLURM_SUBNET\." "$out"; then
      ok "$mode: --addr chooses the network"
    else bad "$mode: --addr" "$out"; fi
  fi
}

# PS_SLURM_ONLY=preemption (or outlived_and_psctl) runs just that scenario
# (loopback), for debugging.
modes="loopback netns"
[ -n "${PS_SLURM_ONLY:-}" ] && modes=loopback
for mode in $modes; do
  flag=""
  [ $mode = netns ] && flag="--netns"
  if ! bash "$CLUSTER" start $flag >"$WORK/cluster.$mode.log" 2>&1; then
    bad "$mode: cluster start" "$WORK/cluster.$mode.log"
    continue
  fi
  eval "$(bash "$CLUSTER" env)"
  # netns: the emulated nodes are hosts of their own (a task elsewhere
  # cannot use a ps's shared memory), so a forced PS_TRANSPORT=shm (the
  # whole suite run that way) is auto here: shared memory where a worker
  # shares a node with a ps, TCP elsewhere.
  [ $mode = netns ] && [ "${PS_TRANSPORT:-}" = shm ] && export PS_TRANSPORT=auto
  if [ -n "${PS_SLURM_ONLY:-}" ]; then cd "$WORK" && "$PS_SLURM_ONLY"; else scenarios $mode; fi
  bash "$CLUSTER" stop >/dev/null 2>&1
done

echo "slurm: $pass passed, $fail failed"
[ $fail -eq 0 ]
