#!/usr/bin/env bash
# smoke.sh - smoke test of deploy/slurm/cluster.sh: start the private Slurm cluster (loopback
# mode, then --netns mode where network namespaces can be created), run a few jobs, stop it and
# check nothing of it is left.  Exit 0 only if every check passes.  Needs root.
#
# Runs with its own directory, ports and namespace names (PS_SLURM_* below, overridable), so it
# does not disturb a cluster started with cluster.sh's defaults.
# Every Slurm command is wrapped in `timeout`: a request the cluster cannot satisfy waits forever.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cluster="$here/cluster.sh"

export PS_SLURM_DIR=${PS_SLURM_DIR:-/tmp/ps-slurm-smoke-$UID}
export PS_SLURM_PORT_BASE=${PS_SLURM_PORT_BASE:-17100}
export PS_SLURM_NETNS_PREFIX=${PS_SLURM_NETNS_PREFIX:-psds-}
export PS_SLURM_BRIDGE=${PS_SLURM_BRIDGE:-psdsbr0}
export PS_SLURM_SUBNET=${PS_SLURM_SUBNET:-10.77.1}
D=$PS_SLURM_DIR
T=60 # per-command timeout, seconds

passed=0
failed=0
skipped=0
ok() {
    echo "PASS: $*"
    passed=$((passed + 1))
}
bad() {
    echo "FAIL: $*"
    failed=$((failed + 1))
}
skip() {
    echo "SKIP: $*"
    skipped=$((skipped + 1))
}
show() {
    local line
    while IFS= read -r line; do echo "    | $line"; done <<<"$1"
}

cleanup() { bash "$cluster" stop >/dev/null 2>&1 || true; }
trap cleanup EXIT

# processes of this cluster still alive (same markers as cluster.sh: $D in the command line or
# environment, or an open file inside $D)
leftovers() {
    local p comm
    for p in /proc/[0-9]*; do
        read -r comm 2>/dev/null <"$p/comm" || continue
        case $comm in
        slurm* | munge*) ;;
        *) continue ;;
        esac
        if tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$D/" ||
            tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qxF "PS_SLURM_CLUSTER_DIR=$D" ||
            find "$p/fd" -maxdepth 1 -lname "$D/*" 2>/dev/null | grep -q .; then
            echo "${p#/proc/} $comm"
        fi
    done
}

if [[ $EUID -ne 0 ]]; then
    echo "smoke.sh: needs root (slurmd and namespaces); run it with sudo" >&2
    exit 1
fi
bash "$cluster" install

# PMI-2 test program (optional: needs a C compiler)
pmi2bin=""
mkdir -p "$D/smoke"
if command -v cc >/dev/null 2>&1; then
    if cc -O1 -o "$D/smoke/pmi2check" "$here/pmi2check.c" -lpmi2 2>"$D/smoke/cc.err"; then
        pmi2bin="$D/smoke/pmi2check"
    else
        bad "compile pmi2check.c: $(cat "$D/smoke/cc.err")"
    fi
fi
cat >"$D/smoke/job.sh" <<'EOF'
#!/bin/sh
echo "batch on $(hostname) nodes=$SLURM_JOB_NUM_NODES"
srun -n2 --ntasks-per-node=1 hostname
EOF
chmod +x "$D/smoke/job.sh"

run_mode() {
    local mode=$1 t0 out err rc
    shift
    echo "=== mode $mode"
    t0=$SECONDS
    if ! bash "$cluster" start "$@"; then
        bad "[$mode] cluster.sh start $*"
        return 0
    fi
    ok "[$mode] start ($((SECONDS - t0))s)"
    eval "$(bash "$cluster" env)"
    bash "$cluster" status >/dev/null || bad "[$mode] status reports not running"

    # 1. 8 tasks over 4 nodes; hostname in a task is the node's name
    out=$(timeout "$T" srun -N4 -n8 hostname 2>&1) && rc=0 || rc=$?
    if [[ $rc -eq 0 && $(wc -l <<<"$out") -eq 8 &&
        $(sort -u <<<"$out" | tr '\n' ' ') == "n1 n2 n3 n4 " ]]; then
        ok "[$mode] srun -N4 -n8 hostname ($(sort <<<"$out" | uniq -c | awk '{printf "%s:%s ", $2, $1}'))"
    else
        bad "[$mode] srun -N4 -n8 hostname (rc=$rc)"
        show "$out"
    fi
    # 1b. exactly two per node (plain -N4 -n8 fills n1 first: 4,2,1,1 with CPUs=4)
    out=$(timeout "$T" srun -N4 -n8 --ntasks-per-node=2 hostname 2>&1) && rc=0 || rc=$?
    if [[ $rc -eq 0 && $(sort <<<"$out" | uniq -c | awk '{printf "%s:%s ", $2, $1}') == "n1:2 n2:2 n3:2 n4:2 " ]]; then
        ok "[$mode] srun -N4 -n8 --ntasks-per-node=2 hostname: n1..n4 twice each"
    else
        bad "[$mode] srun -N4 -n8 --ntasks-per-node=2 hostname (rc=$rc)"
        show "$out"
    fi

    # 2. PMI-2 environment
    out=$(timeout "$T" srun -N2 -n2 --mpi=pmi2 env 2>&1 | grep PMI) && rc=0 || rc=$?
    if [[ $rc -eq 0 ]] && grep -qx 'PMI_RANK=0' <<<"$out" && grep -qx 'PMI_RANK=1' <<<"$out" &&
        [[ $(grep -cx 'PMI_SIZE=2' <<<"$out") -eq 2 && $(grep -c '^PMI_FD=' <<<"$out") -eq 2 ]]; then
        ok "[$mode] srun -N2 -n2 --mpi=pmi2 env: $(sort -u <<<"$out" | tr '\n' ' ')"
    else
        bad "[$mode] srun -N2 -n2 --mpi=pmi2 env | grep PMI (rc=$rc)"
        show "$out"
    fi
    # 2b. PMI-2 key exchange across nodes
    if [[ -n $pmi2bin ]]; then
        out=$(timeout "$T" srun -N2 -n4 --mpi=pmi2 "$pmi2bin" 2>&1) && rc=0 || rc=$?
        if [[ $rc -eq 0 && $(grep -c '^pmi2 ok .*size=4' <<<"$out") -eq 4 ]]; then
            ok "[$mode] PMI-2 put/fence/get over 2 nodes, 4 ranks"
        else
            bad "[$mode] srun -N2 -n4 --mpi=pmi2 pmi2check (rc=$rc)"
            show "$out"
        fi
    else
        skip "[$mode] PMI-2 key exchange (no C compiler)"
    fi

    # 3. heterogeneous job
    err="$D/smoke/het.err"
    out=$(timeout "$T" srun -N1 -n1 hostname : -N2 -n2 hostname 2>"$err") && rc=0 || rc=$?
    if [[ $rc -eq 0 && $(grep -cx 'n[1-4]' <<<"$out") -eq 3 && $(wc -l <<<"$out") -eq 3 ]]; then
        ok "[$mode] heterogeneous srun -N1 -n1 hostname : -N2 -n2 hostname ($(tr '\n' ' ' <<<"$out"))"
    else
        bad "[$mode] heterogeneous srun (rc=$rc)"
        show "$out"
        show "$(cat "$err")"
    fi

    # 4. batch job
    rm -f "$D/smoke/job.out"
    out=$(cd "$D/smoke" && timeout "$T" sbatch --wait -N2 -o "$D/smoke/job.out" "$D/smoke/job.sh" 2>&1) && rc=0 || rc=$?
    if [[ $rc -eq 0 ]] && grep -q '^batch on n[1-4] nodes=2$' "$D/smoke/job.out" &&
        [[ $(grep -cx 'n[1-4]' "$D/smoke/job.out") -eq 2 ]]; then
        ok "[$mode] sbatch --wait ($(tr '\n' ' ' <"$D/smoke/job.out"))"
    else
        bad "[$mode] sbatch --wait (rc=$rc)"
        show "$out"
        show "$(cat "$D/smoke/job.out" 2>/dev/null)"
    fi

    # 5. stop with a job still running: nothing of the cluster may remain
    timeout "$T" srun -N4 -n4 sleep 300 >/dev/null 2>&1 &
    local srun_pid=$! i
    for ((i = 0; i < 50; i++)); do
        [[ -n $(timeout 10 squeue -h -t R -o %A 2>/dev/null) ]] && break
        sleep 0.1
    done
    t0=$SECONDS
    if bash "$cluster" stop; then
        ok "[$mode] stop with a running job ($((SECONDS - t0))s)"
    else
        bad "[$mode] cluster.sh stop"
    fi
    wait "$srun_pid" 2>/dev/null || true
    out=$(leftovers)
    if [[ -z $out ]]; then
        ok "[$mode] no slurm/munge process of the cluster left"
    else
        bad "[$mode] processes left after stop"
        show "$out"
    fi
    if [[ $mode == netns ]]; then
        out=$(
            ip netns list | grep "^$PS_SLURM_NETNS_PREFIX" || true
            ip -br link show | grep "^$PS_SLURM_BRIDGE" || true
        )
        if [[ -z $out ]]; then
            ok "[$mode] namespaces, veths and bridge removed"
        else
            bad "[$mode] network leftovers"
            show "$out"
        fi
    fi
    if bash "$cluster" stop && ! bash "$cluster" status >/dev/null 2>&1; then
        ok "[$mode] second stop is a no-op; status says not running"
    else
        bad "[$mode] second stop / status"
    fi
}

t_all=$SECONDS
run_mode loopback

probe="${PS_SLURM_NETNS_PREFIX}probe$$"
if ip netns add "$probe" 2>/dev/null; then
    ip netns del "$probe"
    run_mode netns --netns
else
    skip "[netns] cannot create network namespaces here (no CAP_NET_ADMIN)"
    if bash "$cluster" start --netns >/dev/null 2>&1; then
        bad "[netns] start --netns succeeded although namespaces cannot be created"
    else
        ok "[netns] start --netns fails cleanly without CAP_NET_ADMIN"
    fi
fi

echo "smoke: $((SECONDS - t_all))s"
echo "smoke: $passed passed, $failed failed, $skipped skipped"
[[ $failed -eq 0 ]]
