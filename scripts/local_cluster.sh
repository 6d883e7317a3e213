#!/usr/bin/env bash
# A one-machine cluster for the `cluster` tests and for trying docs/distributed.md on a laptop:
# SLURM (munge, slurmctld, slurmd: one node with every core, partition `cpu`), PostgreSQL (database
# `soma_pl`, reached as postgresql:///soma_pl by root over the local socket) and a Ray head.
#
#   scripts/local_cluster.sh up       # install what is missing (apt-get, pip), then start all three
#   scripts/local_cluster.sh down     # stop them
#   scripts/local_cluster.sh status   # one line per service
#
# `up` and `down` are idempotent. Debian/Ubuntu and root only (it writes /etc/slurm/slurm.conf and
# starts daemons); it refuses with one line elsewhere. ray and psycopg[binary] (the driver of
# postgresql:// URLs) go into the Python on PATH (activate the project's virtual environment first).
# A test fixture and a recipe, not a production setup: one node, daemons running as root, no
# cgroups, no accounting.
set -uo pipefail

MARK="# written by soma_pl scripts/local_cluster.sh"
CONF=/etc/slurm/slurm.conf
STATE=/var/lib/soma_pl-slurm
LOGS=/var/log/soma_pl-slurm
PARTITION=cpu
DATABASE=soma_pl
PYTHON=$(command -v python || command -v python3 || true)

fail() { echo "local_cluster: $*" >&2; exit 1; }

require_root_and_apt() {
    [[ $(id -u) -eq 0 ]] || fail "needs root (it installs packages, writes $CONF and starts daemons); run it with sudo"
    [[ -n "$PYTHON" ]] || fail "no python on PATH: activate the project's virtual environment first"
}

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurm-wlm)
    command -v munged >/dev/null || missing+=(munge)
    command -v pg_ctlcluster >/dev/null || missing+=(postgresql)
    if ((${#missing[@]})); then
        command -v apt-get >/dev/null || fail "apt-get not found: install ${missing[*]} with this system's package manager"
        echo "local_cluster: apt-get install ${missing[*]}"
        local log=/tmp/local_cluster-apt.log
        { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } >"$log" 2>&1 \
            || fail "apt-get install ${missing[*]} failed (its output is in $log)"
    fi
    local wheels=()
    "$PYTHON" -c "import ray" 2>/dev/null || wheels+=(ray)
    "$PYTHON" -c "import psycopg" 2>/dev/null || wheels+=("psycopg[binary]")
    if ((${#wheels[@]})); then
        echo "local_cluster: pip install ${wheels[*]} into $PYTHON"
        local log=/tmp/local_cluster-pip.log
        "$PYTHON" -m pip install -q "${wheels[@]}" >"$log" 2>&1 \
            || fail "pip install ${wheels[*]} failed (its output is in $log)"
    fi
}

# --- munge -------------------------------------------------------------------------------------
munge_up() {
    [[ -s /etc/munge/munge.key ]] || mungekey --create --keyfile /etc/munge/munge.key >/dev/null
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge && chown munge:munge /run/munge
    munge_running || runuser -u munge -- munged || fail "munged did not start"
}
munge_running() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# --- slurm -------------------------------------------------------------------------------------
write_slurm_conf() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        fail "$CONF exists and this script did not write it: leaving SLURM as it is"
    fi
    local node
    node=$(slurmd -C | head -1)
    mkdir -p "$STATE/ctld" "$STATE/d" "$LOGS" /etc/slurm
    cat >"$CONF" <<EOF
$MARK: one node, one partition.
ClusterName=soma-local
SlurmctldHost=$(hostname -s)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/soma_pl-slurmctld.pid
SlurmdPidFile=/run/soma_pl-slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
$node
PartitionName=$PARTITION Nodes=$(hostname -s) Default=YES MaxTime=INFINITE State=UP
EOF
}

slurm_up() {
    write_slurm_conf
    pid_alive /run/soma_pl-slurmctld.pid || slurmctld || fail "slurmctld did not start (see $LOGS/slurmctld.log)"
    pid_alive /run/soma_pl-slurmd.pid || slurmd || fail "slurmd did not start (see $LOGS/slurmd.log)"
    local state
    for _ in $(seq 60); do
        state=$(sinfo -h -p "$PARTITION" -o %T 2>/dev/null | head -1)
        case "$state" in
            idle*|mixed*|allocated*) return 0 ;;
            down*|drain*) scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 ;;
        esac
        sleep 1
    done
    fail "the SLURM node did not become idle (state: ${state:-none}; see $LOGS)"
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pid() {
    pid_alive "$1" || return 0
    local pid
    pid=$(cat "$1")
    kill "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
}

slurm_status() {
    if ! command -v sinfo >/dev/null; then echo "slurm: not installed"; return 1; fi
    local state
    state=$(sinfo -h -p "$PARTITION" -o "%T %c" 2>/dev/null | head -1)
    if [[ -z "$state" ]]; then echo "slurm: not running"; return 1; fi
    echo "slurm: running, partition $PARTITION, node $(hostname -s) ${state% *}, ${state#* } CPUs"
    [[ $state == idle* || $state == mixed* || $state == allocated* ]]
}

# --- postgresql --------------------------------------------------------------------------------
pg_cluster() { pg_lsclusters -h 2>/dev/null | head -1; }

postgres_up() {
    if [[ -z "$(pg_cluster)" ]]; then
        pg_createcluster "$(ls /usr/lib/postgresql | sort -n | tail -1)" main >/dev/null || fail "pg_createcluster failed"
    fi
    local version name status
    read -r version name _ status _ <<<"$(pg_cluster)"
    [[ $status == online* ]] || pg_ctlcluster "$version" "$name" start || fail "PostgreSQL $version/$name did not start"
    runuser -u postgres -- psql -qtAc "select 1 from pg_roles where rolname = 'root'" | grep -q 1 \
        || runuser -u postgres -- createuser --superuser root || fail "could not create the PostgreSQL role root"
    psql -d postgres -qtAc "select 1 from pg_database where datname = '$DATABASE'" | grep -q 1 \
        || createdb "$DATABASE" || fail "could not create the database $DATABASE"
}

postgres_status() {
    if ! command -v pg_lsclusters >/dev/null; then echo "postgresql: not installed"; return 1; fi
    local version name port status
    read -r version name port status _ <<<"$(pg_cluster)"
    if [[ $status != online* ]]; then echo "postgresql: not running"; return 1; fi
    if ! psql -d "$DATABASE" -qtAc "select 1" >/dev/null 2>&1; then
        echo "postgresql: $version/$name running on port $port, but no database $DATABASE for root"; return 1
    fi
    echo "postgresql: running, $version/$name on port $port, postgresql:///$DATABASE"
}

postgres_down() {
    local version name status
    read -r version name _ status _ <<<"$(pg_cluster)"
    [[ $status == online* ]] && pg_ctlcluster "$version" "$name" stop
    return 0
}

# --- ray ---------------------------------------------------------------------------------------
# The `ray` command of $PYTHON's installation: beside it in a virtual environment, else on PATH.
ray_bin() {
    [[ -n "$PYTHON" ]] && "$PYTHON" -c "import ray" 2>/dev/null || return 1
    if [[ -x "$(dirname "$PYTHON")/ray" ]]; then echo "$(dirname "$PYTHON")/ray"; else command -v ray; fi
}

ray_up() {
    local ray
    ray=$(ray_bin) || fail "ray is not installed in $PYTHON"
    "$ray" status >/dev/null 2>&1 && return 0
    "$ray" start --head --num-cpus="$(nproc)" --object-store-memory=$((256 * 1024 * 1024)) --disable-usage-stats \
        >/dev/null 2>&1 || fail "ray start --head failed"
}

ray_status() {
    local ray
    if ! ray=$(ray_bin); then echo "ray: not installed"; return 1; fi
    if ! "$ray" status >/dev/null 2>&1; then echo "ray: not running"; return 1; fi
    echo "ray: running, head at $("$PYTHON" -c 'import ray._private.services as s; print(s.get_ray_address_from_environment("auto", None))' 2>/dev/null)"
}

# --- verbs -------------------------------------------------------------------------------------
status() {
    local code=0
    if munge_running; then echo "munge: running"; else echo "munge: not running"; code=1; fi
    slurm_status || code=1
    postgres_status || code=1
    ray_status || code=1
    return $code
}

case "${1:-}" in
    up)
        require_root_and_apt
        install_packages
        munge_up
        slurm_up
        postgres_up
        ray_up
        status
        ;;
    down)
        require_root_and_apt
        if [[ -n "$(ray_bin)" ]]; then "$(ray_bin)" stop >/dev/null 2>&1; fi
        echo "ray: stopped"
        if command -v pg_lsclusters >/dev/null; then postgres_down; fi
        echo "postgresql: stopped"
        stop_pid /run/soma_pl-slurmd.pid
        stop_pid /run/soma_pl-slurmctld.pid
        echo "slurm: stopped"
        stop_pid /run/munge/munged.pid
        echo "munge: stopped"
        ;;
    status) status ;;
    *) fail "usage: scripts/local_cluster.sh up|down|status" ;;
esac
