#!/usr/bin/env bash
# cluster.sh - a private, throw-away Slurm cluster on this one machine, for tests.
#
# Usage:
#   deploy/slurm/cluster.sh install          install Debian's Slurm/munge packages if missing
#   deploy/slurm/cluster.sh start [--netns]  start munged, slurmctld and 4 slurmd (nodes n1..n4)
#   deploy/slurm/cluster.sh env              print `export SLURM_CONF=...` lines; use: eval "$(cluster.sh env)"
#   deploy/slurm/cluster.sh status           show daemons and node states (exit 0 if running, 3 if not)
#   deploy/slurm/cluster.sh stop             cancel all jobs, stop every daemon, remove namespaces (idempotent)
#
# Everything (slurm.conf, logs, spool, state, pid files, munge key and socket) lives in
# $PS_SLURM_DIR (default /tmp/ps-slurm-$UID); the system's /etc/slurm and /etc/munge are never
# read or written, and no system service is started.  Two clusters can run side by side when they
# use different PS_SLURM_DIR and PS_SLURM_PORT_BASE (and, for --netns, PS_SLURM_NETNS_PREFIX,
# PS_SLURM_BRIDGE and PS_SLURM_SUBNET).
#
# Environment:
#   PS_SLURM_DIR           state directory                      (/tmp/ps-slurm-$UID; under sudo
#                                                               the invoking user's UID)
#   PS_SLURM_PORT_BASE     slurmctld port; slurmd nI uses base+I (17000)
#   PS_SLURM_CPUS          CPUs advertised per node             (4)
#   PS_SLURM_READY_TIMEOUT seconds to wait for all nodes idle   (30)
#   PS_SLURM_NETNS_PREFIX  --netns: namespace names PREFIXnI    (psd-)
#   PS_SLURM_BRIDGE        --netns: bridge name (<= 12 chars)   (psdbr0)
#   PS_SLURM_SUBNET        --netns: first three octets of a private /24; the bridge (controller)
#                          is SUBNET.1, node nI is SUBNET.1I    (10.77.0)
#
# Modes:
#   default   every slurmd listens on 127.0.0.1 (ports base+1..base+4) and runs in its own UTS
#             namespace (`unshare --uts`) whose hostname is the node name, so `hostname` in a task
#             prints n1..n4.
#   --netns   every slurmd (and its tasks) runs in its own network namespace PREFIXnI with its own
#             address SUBNET.1I on a bridge created here, plus its own UTS and mount namespace
#             with a private /etc/hosts.  slurmctld stays in the host namespace and is reached on
#             the bridge address SUBNET.1.  Needs CAP_NET_ADMIN.  The namespaces are entered with
#             nsenter rather than `ip netns exec`, because the latter remounts /sys and slurmd 22.05
#             then refuses to start for lack of a cgroup filesystem.
#
# IMPORTANT for callers: a request larger than the cluster (e.g. `srun -N5`, or more tasks than
# 4 nodes x PS_SLURM_CPUS CPUs) is not rejected; it waits in the queue forever.  Always wrap test
# commands in `timeout`, e.g. `timeout 60 srun -N4 -n8 hostname`.
#
# Every Slurm client command needs SLURM_CONF in its environment (see `cluster.sh env`).
set -euo pipefail

readonly PACKAGES=(slurmctld slurmd slurm-client munge libslurm-dev libpmi2-0-dev)
readonly NODES=(n1 n2 n3 n4)

# Under sudo the default directory is the invoking user's, so that `sudo cluster.sh start` and a
# plain `cluster.sh env` agree.
D=${PS_SLURM_DIR:-/tmp/ps-slurm-${SUDO_UID:-$UID}}
BASE=${PS_SLURM_PORT_BASE:-17000}
CPUS=${PS_SLURM_CPUS:-4}
READY_TIMEOUT=${PS_SLURM_READY_TIMEOUT:-30}
NS_PREFIX=${PS_SLURM_NETNS_PREFIX:-psd-}
BRIDGE=${PS_SLURM_BRIDGE:-psdbr0}
SUBNET=${PS_SLURM_SUBNET:-10.77.0}

CONF="$D/etc/slurm.conf"
MUNGE_SOCK="$D/munge-sock/munge.socket"

die() {
    echo "cluster.sh: error: $*" >&2
    exit 1
}

note() {
    echo "cluster.sh: $*" >&2
}

as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "need root (or sudo) to run: $*"
    fi
}

# ---------------------------------------------------------------------------------------------
# install

missing_packages() {
    local p st
    for p in "${PACKAGES[@]}"; do
        st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
        if [[ $st != "install ok installed" ]]; then
            echo "$p"
        fi
    done
}

cmd_install() {
    local missing
    mapfile -t missing < <(missing_packages)
    if [[ ${#missing[@]} -eq 0 ]]; then
        note "all packages installed: ${PACKAGES[*]}"
        return 0
    fi
    note "installing: ${missing[*]}"
    # --no-install-recommends: otherwise apt pulls ~40 more packages.
    if ! as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"; then
        note "install failed; running apt-get update and retrying"
        as_root apt-get update
        as_root env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y --no-install-recommends "${missing[@]}"
    fi
}

# ---------------------------------------------------------------------------------------------
# helpers on processes we started

# pid_is_ours PIDFILE: the recorded PID is alive and its command line mentions our directory.
pid_is_ours() {
    local pidfile=$1 pid
    [[ -f $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$D/" || return 1
    echo "$pid"
}

# proc_alive PID: the process exists and is not a zombie (our init may reap late).
proc_alive() {
    local state
    state=$(sed -E 's/.*\) ([A-Za-z]).*/\1/' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $state && $state != Z ]]
}

# pid_alive PIDFILE: the recorded process is alive.  (Used right after start, when the command
# line may still be changing: nsenter -> unshare -> sh -> slurmd.)
pid_alive() {
    local pid
    [[ -f $1 ]] || return 1
    pid=$(<"$1")
    [[ $pid =~ ^[0-9]+$ ]] && proc_alive "$pid"
}

# stop_pidfiles TIMEOUT PIDFILE...: TERM the processes, wait up to TIMEOUT s, then KILL.
stop_pidfiles() {
    local timeout=$1
    shift
    local f pid pids=() i
    for f in "$@"; do
        if pid=$(pid_is_ours "$f"); then
            pids+=("$pid")
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    if [[ ${#pids[@]} -gt 0 ]]; then
        for ((i = 0; i < timeout * 10; i++)); do
            local alive=0
            for pid in "${pids[@]}"; do
                if proc_alive "$pid"; then alive=1; fi
            done
            [[ $alive -eq 0 ]] && break
            sleep 0.1
        done
        for pid in "${pids[@]}"; do
            if proc_alive "$pid"; then
                note "process $pid did not exit on TERM; sending KILL"
                kill -KILL "$pid" 2>/dev/null || true
            fi
        done
    fi
    rm -f "$@"
}

# PIDs of slurm*/munged processes (slurmstepd above all) that belong to this cluster: the
# daemons we start carry PS_SLURM_CLUSTER_DIR=$D in their environment or $D in their command line;
# slurmstepd (whose environment is cleared) and slurmscriptd hold a log file inside $D open.
cluster_stray_pids() {
    local p pid comm
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        read -r comm 2>/dev/null <"$p/comm" || continue
        case $comm in
        slurm* | munged) ;;
        *) continue ;;
        esac
        if tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qxF "PS_SLURM_CLUSTER_DIR=$D" ||
            tr '\0' ' ' 2>/dev/null <"$p/cmdline" | grep -qF -- "$D/" ||
            find "$p/fd" -maxdepth 1 -lname "$D/*" 2>/dev/null | grep -q .; then
            echo "$pid"
        fi
    done
}

log_tails() {
    local f
    for f in "$D"/log/*; do
        [[ -f $f ]] || continue
        echo "----- tail $f" >&2
        tail -n 15 "$f" >&2 || true
    done
}

slurm_env() {
    env SLURM_CONF="$CONF" "$@"
}

# ---------------------------------------------------------------------------------------------
# configuration

write_munge_key() {
    local key="$D/munge/munge.key"
    [[ -s $key ]] && return 0
    (
        umask 077
        dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
    )
    chmod 0400 "$key"
}

write_slurm_conf() {
    local mode=$1 ctl_addr node_addr_line
    if [[ $mode == netns ]]; then
        ctl_addr="$SUBNET.1"
        node_addr_line="NodeName=n[1-4] NodeAddr=$SUBNET.[11-14] Port=$((BASE + 1))-$((BASE + 4)) CPUs=$CPUS State=UNKNOWN"
    else
        ctl_addr=127.0.0.1
        node_addr_line="NodeName=n[1-4] NodeAddr=127.0.0.1 Port=$((BASE + 1))-$((BASE + 4)) CPUs=$CPUS State=UNKNOWN"
    fi
    # slurmctld only accepts running on a host named in SlurmctldHost; we start it in its own UTS
    # namespace whose hostname is `psdctl`.
    cat >"$CONF" <<EOF
# Generated by deploy/slurm/cluster.sh ($mode mode); do not edit, it is rewritten on start.
ClusterName=psdtest
SlurmctldHost=psdctl($ctl_addr)
SlurmctldPort=$BASE
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$D/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
MailProg=/bin/true
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=2
InactiveLimit=0
MinJobAge=2
MessageTimeout=10
$node_addr_line
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP
EOF
    : >"$D/etc/plugstack.conf"
    # cgroup.conf is looked up next to slurm.conf; keep slurmd off the system's cgroups.
    cat >"$D/etc/cgroup.conf" <<EOF
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
EOF
}

# ---------------------------------------------------------------------------------------------
# network namespaces (--netns)

netns_setup() {
    local i n ns veth
    if [[ $EUID -ne 0 ]]; then
        die "start --netns needs root (CAP_NET_ADMIN) to create network namespaces"
    fi
    ((${#BRIDGE} <= 12)) || die "PS_SLURM_BRIDGE '$BRIDGE' too long (max 12 chars)"
    if ip link show "$BRIDGE" >/dev/null 2>&1; then
        die "bridge $BRIDGE already exists (another cluster? set PS_SLURM_BRIDGE/PS_SLURM_SUBNET, or run stop)"
    fi
    for n in "${NODES[@]}"; do
        if [[ -e /var/run/netns/$NS_PREFIX$n ]]; then
            die "network namespace $NS_PREFIX$n already exists (another cluster? set PS_SLURM_NETNS_PREFIX, or run stop)"
        fi
    done
    if ! ip link add "$BRIDGE" type bridge 2>"$D/log/netns.err"; then
        die "cannot create bridge $BRIDGE (no CAP_NET_ADMIN?): $(cat "$D/log/netns.err")"
    fi
    echo "$BRIDGE" >"$D/netns/bridge"
    ip addr add "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 psdctl"
    } >"$D/netns/hosts"
    for i in 1 2 3 4; do
        n=n$i
        ns=$NS_PREFIX$n
        veth=${BRIDGE}v$i
        echo "$SUBNET.1$i $n" >>"$D/netns/hosts"
        if ! ip netns add "$ns" 2>"$D/log/netns.err"; then
            die "cannot create network namespace $ns (no CAP_NET_ADMIN?): $(cat "$D/log/netns.err")"
        fi
        echo "$ns" >>"$D/netns/namespaces"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        echo "$veth" >>"$D/netns/veths"
        ip link set "$veth" master "$BRIDGE" up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$SUBNET.1$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    chmod 0644 "$D/netns/hosts"
}

netns_teardown() {
    local x
    if [[ -f $D/netns/namespaces ]]; then
        while read -r x; do
            if [[ -n $x ]]; then ip netns del "$x" 2>/dev/null || true; fi
        done <"$D/netns/namespaces"
    fi
    if [[ -f $D/netns/veths ]]; then
        while read -r x; do
            if [[ -n $x ]]; then ip link del "$x" 2>/dev/null || true; fi
        done <"$D/netns/veths"
    fi
    if [[ -f $D/netns/bridge ]]; then
        ip link del "$(<"$D/netns/bridge")" 2>/dev/null || true
    fi
    rm -f "$D/netns/namespaces" "$D/netns/veths" "$D/netns/bridge"
}

# ---------------------------------------------------------------------------------------------
# start

prepare_dir() {
    if [[ -e $D && ! -O $D ]]; then
        die "$D exists and is not owned by $(id -un); set PS_SLURM_DIR"
    fi
    mkdir -p "$D"
    chmod 0755 "$D"
    # Fresh run-time state every start; keep nothing from a previous cluster but the munge key.
    rm -rf "${D:?}/state" "${D:?}/spool" "${D:?}/run" "${D:?}/pids" "${D:?}/log" "${D:?}/etc" \
        "${D:?}/munge-sock"
    mkdir -p "$D/etc" "$D/state" "$D/run" "$D/pids" "$D/log" "$D/netns" "$D/munge" "$D/munge-sock"
    for n in "${NODES[@]}"; do mkdir -p "$D/spool/$n"; done
    chmod 0700 "$D/munge"
    chmod 0711 "$D/munge-sock"
    rm -f "$D/munge/munged.pid"
}

start_munged() {
    local force=() i
    [[ $EUID -eq 0 ]] && force=(--force)
    write_munge_key
    # munged daemonizes itself; its PID is in --pid-file.
    PS_SLURM_CLUSTER_DIR="$D" munged "${force[@]}" \
        --socket="$MUNGE_SOCK" \
        --key-file="$D/munge/munge.key" \
        --pid-file="$D/munge/munged.pid" \
        --log-file="$D/log/munged.log" \
        --seed-file="$D/munge/munged.seed" \
        >"$D/log/munged.out" 2>&1 ||
        {
            cat "$D/log/munged.out" >&2
            die "munged failed to start"
        }
    for ((i = 0; i < 50; i++)); do
        [[ -S $MUNGE_SOCK ]] && [[ -s $D/munge/munged.pid ]] && break
        sleep 0.1
    done
    [[ -S $MUNGE_SOCK ]] || {
        log_tails
        die "munged socket $MUNGE_SOCK did not appear"
    }
    cp "$D/munge/munged.pid" "$D/pids/munged.pid"
    if ! munge -n --socket="$MUNGE_SOCK" | unmunge --socket="$MUNGE_SOCK" >/dev/null; then
        log_tails
        die "munge round trip through $MUNGE_SOCK failed"
    fi
}

start_slurmctld() {
    # shellcheck disable=SC2016 # $1 is expanded by the inner sh
    # Own UTS namespace with hostname psdctl: slurmctld refuses to run unless its hostname is the
    # one in SlurmctldHost.  unshare (no --fork) and sh exec, so $! is slurmctld's PID.
    PS_SLURM_CLUSTER_DIR="$D" SLURM_CONF="$CONF" \
        unshare --uts sh -c 'hostname psdctl && exec slurmctld -D -c -f "$1"' sh "$CONF" \
        </dev/null >"$D/log/slurmctld.out" 2>&1 &
    echo $! >"$D/pids/slurmctld.pid"
}

start_slurmd() {
    local mode=$1 i n
    for i in 1 2 3 4; do
        n=n$i
        # shellcheck disable=SC2016 # $1.. are expanded by the inner sh
        if [[ $mode == netns ]]; then
            PS_SLURM_CLUSTER_DIR="$D" SLURM_CONF="$CONF" \
                nsenter --net="/var/run/netns/$NS_PREFIX$n" \
                unshare --uts --mount sh -c \
                'mount --bind "$3" /etc/hosts && hostname "$1" && exec slurmd -D -N "$1" -f "$2"' \
                sh "$n" "$CONF" "$D/netns/hosts" \
                </dev/null >"$D/log/slurmd.$n.out" 2>&1 &
        else
            PS_SLURM_CLUSTER_DIR="$D" SLURM_CONF="$CONF" \
                unshare --uts sh -c 'hostname "$1" && exec slurmd -D -N "$1" -f "$2"' \
                sh "$n" "$CONF" \
                </dev/null >"$D/log/slurmd.$n.out" 2>&1 &
        fi
        echo $! >"$D/pids/slurmd.$n.pid"
    done
}

wait_ready() {
    local deadline=$((SECONDS + READY_TIMEOUT)) idle f
    while ((SECONDS < deadline)); do
        for f in "$D"/pids/*.pid; do
            if ! pid_alive "$f"; then
                log_tails
                die "$(basename "$f" .pid) exited during start-up (logs above)"
            fi
        done
        idle=$(slurm_env sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle"' | sort -u | wc -l) || idle=0
        if [[ $idle -eq ${#NODES[@]} ]]; then
            return 0
        fi
        sleep 0.3
    done
    echo "sinfo:" >&2
    slurm_env sinfo -N -o '%N %T %E' >&2 || true
    log_tails
    die "nodes not idle after ${READY_TIMEOUT}s (logs above)"
}

cmd_start() {
    local mode=loopback
    while [[ $# -gt 0 ]]; do
        case $1 in
        --netns) mode=netns ;;
        *) die "start: unknown option $1" ;;
        esac
        shift
    done
    [[ $EUID -eq 0 ]] || die "start needs root (slurmd, UTS/network namespaces); run it with sudo"
    if [[ -n $(missing_packages) ]]; then
        cmd_install
    fi
    if [[ -f $D/mode ]] || compgen -G "$D/pids/*.pid" >/dev/null || compgen -G "$D/netns/[bnv]*" >/dev/null; then
        note "stopping the previous cluster in $D"
        cmd_stop
    fi
    local t0=$SECONDS
    prepare_dir
    # whatever fails from here on: take down what was already started
    trap 'note "start failed; cleaning up"; cmd_stop >/dev/null 2>&1 || true' EXIT
    echo "$mode" >"$D/mode"
    write_slurm_conf "$mode"
    if [[ $mode == netns ]]; then
        netns_setup
    fi
    start_munged
    start_slurmctld
    # give slurmctld a moment to bind before slurmd registers (slurmd retries anyway)
    sleep 0.5
    start_slurmd "$mode"
    wait_ready
    trap - EXIT
    note "cluster up ($mode, $D, slurmctld port $BASE) in $((SECONDS - t0))s"
}

# ---------------------------------------------------------------------------------------------
# stop

cancel_all_jobs() {
    local ids i
    pid_is_ours "$D/pids/slurmctld.pid" >/dev/null || return 0
    ids=$(slurm_env timeout 10 squeue -h -o %A 2>/dev/null || true)
    [[ -z $ids ]] && return 0
    # shellcheck disable=SC2086 # word splitting of the job id list is intended
    slurm_env timeout 10 scancel $ids 2>/dev/null || true
    # slurmstepd ignores SIGTERM and would outlive a killed slurmd: wait until the jobs are gone.
    for ((i = 0; i < 60; i++)); do
        ids=$(slurm_env timeout 10 squeue -h -o %A 2>/dev/null || true)
        [[ -z $ids ]] && return 0
        sleep 0.25
    done
    note "jobs still listed after cancel: $ids"
}

cmd_stop() {
    [[ -d $D ]] || return 0
    if [[ $EUID -ne 0 ]] && compgen -G "$D/pids/*.pid" >/dev/null; then
        die "stop needs root (the daemons run as root); run it with sudo"
    fi
    cancel_all_jobs
    # slurmd and slurmctld together (each takes ~2 s to exit on TERM), munged last: the others
    # need it until they are gone.
    stop_pidfiles 10 "$D"/pids/slurm*.pid
    # leftover slurmstepd (or daemons whose PID file got lost) of this cluster
    local pid comm
    for pid in $(cluster_stray_pids); do
        read -r comm 2>/dev/null <"/proc/$pid/comm" || continue
        [[ $comm == munged ]] && continue
        note "killing leftover $comm (pid $pid)"
        kill -KILL "$pid" 2>/dev/null || true
    done
    # munged: the PID we recorded, else the one munged wrote (start died before recording it)
    if [[ ! -f $D/pids/munged.pid && -f $D/munge/munged.pid ]]; then
        cp "$D/munge/munged.pid" "$D/pids/munged.pid"
    fi
    stop_pidfiles 5 "$D/pids/munged.pid"
    for pid in $(cluster_stray_pids); do
        note "killing leftover pid $pid"
        kill -KILL "$pid" 2>/dev/null || true
    done
    netns_teardown
    rm -f "$D/mode" "$MUNGE_SOCK"
}

# ---------------------------------------------------------------------------------------------
# env / status

cmd_env() {
    printf 'export PS_SLURM_DIR=%q\n' "$D"
    printf 'export SLURM_CONF=%q\n' "$CONF"
    printf 'export PS_SLURM_MUNGE_SOCKET=%q\n' "$MUNGE_SOCK"
    printf 'export PS_SLURM_PORT_BASE=%q\n' "$BASE"
}

cmd_status() {
    local f pid rc=0
    if [[ ! -f $D/mode ]]; then
        echo "not running ($D)"
        return 3
    fi
    echo "mode: $(<"$D/mode")  dir: $D  slurmctld port: $BASE"
    for f in "$D"/pids/*.pid; do
        [[ -f $f ]] || continue
        if pid=$(pid_is_ours "$f"); then
            echo "$(basename "$f" .pid): running (pid $pid)"
        else
            echo "$(basename "$f" .pid): NOT running"
            rc=3
        fi
    done
    slurm_env timeout 10 sinfo -N -o '%N %T %E' || rc=3
    slurm_env timeout 10 squeue || rc=3
    return "$rc"
}

usage() {
    sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
}

main() {
    local cmd=${1:-}
    [[ $D == /?* && $D != *[[:space:]]* ]] || die "PS_SLURM_DIR must be an absolute path without spaces: '$D'"
    if ! [[ $BASE =~ ^[0-9]+$ ]] || ((BASE < 1024 || BASE > 65530)); then
        die "bad PS_SLURM_PORT_BASE '$BASE'"
    fi
    [[ $# -gt 0 ]] && shift
    case $cmd in
    install) cmd_install "$@" ;;
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    env) cmd_env "$@" ;;
    status) cmd_status "$@" ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        exit 2
        ;;
    esac
}

main "$@"
