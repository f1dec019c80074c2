#!/usr/bin/env bash
# Throwaway MariaDB, Redis and RabbitMQ for the tests, bound to 127.0.0.1 only,
# with all their state under one run directory.
#
#   scripts/services.sh install   apt-get what is missing (start does it too)
#   scripts/services.sh start     start what is not answering yet (idempotent)
#   scripts/services.sh status    exit 0 if all three answer
#   scripts/services.sh stop      stop what start started (never a foreign server)
#   scripts/services.sh env       print the PHORGE_BRIDGE_TEST_* export lines
#
# See shared/services.md for why each flag is there.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
run=${PHORGE_BRIDGE_SERVICES_DIR:-/tmp/phorge-bridge-services}
mysql_port=${PHORGE_BRIDGE_TEST_MYSQL_PORT:-3307}
redis_port=${PHORGE_BRIDGE_TEST_REDIS_PORT:-6379}
timeout=${PHORGE_BRIDGE_SERVICES_TIMEOUT:-60}   # seconds each service gets to come up

# RabbitMQ reads its whole setup from the environment, and every rabbitmqctl
# call needs the same: a node name that resolves without DNS, epmd and the
# distribution port on loopback only, and state in our run directory.
export RABBITMQ_NODENAME=rabbit@localhost RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=5672 ERL_EPMD_ADDRESS=127.0.0.1
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}'
export RABBITMQ_MNESIA_BASE=$run/rabbitmq/mnesia RABBITMQ_LOG_BASE=$run/rabbitmq/log
export RABBITMQ_PID_FILE=$run/rabbitmq/rabbitmq.pid

t0=${EPOCHREALTIME/./}
# say MESSAGE: log to stderr with the time since this script started.
say() {
    local t=$(((${EPOCHREALTIME/./} - t0) / 100000))
    echo "services.sh [$((t / 10)).$((t % 10))s]: $*" >&2
}

# die SERVICE LOGFILE: a service did not come up; show why and stop.
die() {
    say "ERROR: $1 did not come up within ${timeout}s. Last lines of $2:"
    tail -n 30 "$2" >&2 2>/dev/null || true
    exit 1
}

# wait_for SECONDS COMMAND...: poll until COMMAND succeeds; fail after SECONDS.
wait_for() {
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# gone PID: the process has exited. A zombie counts as gone: PID 1 on these
# machines reaps orphans only every second or two.
gone() { local s; s=$(ps -o stat= -p "$1") || return 0; [[ $s == Z* ]]; }
alive() { [[ -f $1 ]] && ! gone "$(cat "$1")"; }

install() {
    local missing=0
    for bin in mariadbd mariadb-install-db redis-server rabbitmq-server pkg-config php \
        promtool prometheus systemd-analyze; do
        command -v "$bin" >/dev/null || missing=1
    done
    # mysqlclient builds from source against libmariadb-dev.
    pkg-config --exists libmariadb 2>/dev/null || missing=1
    # The real-Phorge tier runs Phorge's PHP: its MySQL, cURL and mbstring extensions.
    for module in mysqli curl mbstring; do
        php -m 2>/dev/null | grep -qx "$module" || missing=1
    done
    ((missing)) || return 0
    say "installing system packages"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # systemd-analyze checks the shipped unit (no systemd runs here).
    apt-get install -y -qq mariadb-server rabbitmq-server redis-server \
        pkg-config libmariadb-dev php-cli php-mysql php-curl php-mbstring systemd >/dev/null
    # promtool checks the shipped alert rules; an acceptance test starts a server of
    # its own. The node exporter it recommends is not needed.
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
}

# Each probe has its own timeout: a foreign listener on the port must not hang us.
mysql_up() {
    mariadb --no-defaults --connect-timeout=2 -h127.0.0.1 -P"$mysql_port" \
        -ubridge -pbridge -e 'SELECT 1' >/dev/null
}
redis_up() { [[ $(timeout 2 redis-cli -h 127.0.0.1 -p "$redis_port" ping 2>/dev/null) == PONG ]]; }
amqp_port_open() { timeout 2 bash -c 'echo >/dev/tcp/127.0.0.1/5672' 2>/dev/null; }
# The port opens seconds before logins work, so check a real AMQP login.
amqp_up() {
    timeout 5 python3 -c 'import amqp
with amqp.Connection("127.0.0.1:5672"): pass'
}

start_mysql() {
    mysql_up 2>/dev/null && { say "MariaDB: reusing 127.0.0.1:$mysql_port"; return; }
    # The one MariaDB launcher (the fault suite's and the bench's too): a fresh datadir
    # unless a server is already starting in $run/mariadb, Phorge's settings, durability
    # traded for speed (the data is thrown away anyway), user bridge/bridge, who may
    # create the least-privileged account the docs recommend (the read-only tests).
    # It says why when the server does not come up.
    python3 "$here/mariadb_launcher.py" start --dir "$run/mariadb" --port "$mysql_port" \
        --timeout "$timeout" --grant-option || { say "ERROR: MariaDB on 127.0.0.1:$mysql_port"; exit 1; }
    mysql_up >/dev/null 2>&1 || die "MariaDB login as bridge" "$run/mariadb/mysqld.log"
    say "MariaDB: started on 127.0.0.1:$mysql_port"
}

start_redis() {
    redis_up && { say "Redis: reusing 127.0.0.1:$redis_port"; return; }
    mkdir -p "$run/redis"
    # No RDB snapshots, no AOF: nothing outlives the process.
    redis-server --bind 127.0.0.1 --port "$redis_port" --daemonize yes --save '' \
        --appendonly no --dir "$run/redis" --pidfile "$run/redis/redis.pid" \
        --logfile "$run/redis/redis.log"
    wait_for "$timeout" redis_up || die "Redis on 127.0.0.1:$redis_port" "$run/redis/redis.log"
    say "Redis: started on 127.0.0.1:$redis_port"
}

start_rabbitmq() {
    local d=$run/rabbitmq log=$run/rabbitmq/log/$RABBITMQ_NODENAME.log
    if amqp_port_open; then
        say "RabbitMQ: reusing 127.0.0.1:5672"
    else
        if ! alive "$d/rabbitmq.pid"; then
            # Debian's wrapper runs the node as user rabbitmq, which must own
            # its state; a fresh one every time, like MariaDB's.
            rm -rf "$d" && mkdir -p "$d" && chown rabbitmq: "$d"
            timeout "$timeout" rabbitmq-server -detached >"$run/rabbitmq-start.log" 2>&1 \
                || die "rabbitmq-server -detached" "$run/rabbitmq-start.log"
        fi
        # `rabbitmqctl await_startup` fails straight after -detached: poll the port.
        wait_for "$timeout" amqp_port_open || die "RabbitMQ on 127.0.0.1:5672" "$log"
        say "RabbitMQ: port 5672 open"
    fi
    if python3 -c 'import amqp' 2>/dev/null; then
        wait_for "$timeout" amqp_up || die "RabbitMQ login as guest" "$log"
    else
        # No AMQP client yet (pip has not run): ask the node itself.
        wait_for "$timeout" rabbitmqctl await_startup || die "RabbitMQ" "$log"
    fi
    say "RabbitMQ: accepts logins on 127.0.0.1:5672"
}

stop() {
    local d=$run/rabbitmq
    if alive "$d/rabbitmq.pid"; then
        local pid
        pid=$(cat "$d/rabbitmq.pid")
        # Given the pid file, rabbitmqctl stop returns only once the node has exited.
        rabbitmqctl stop "$d/rabbitmq.pid" >/dev/null 2>&1 || kill "$pid" || true
        wait_for "$timeout" gone "$pid" || { say "ERROR: RabbitMQ did not stop"; exit 1; }
        # The node leaves epmd behind (on loopback, thanks to ERL_EPMD_ADDRESS).
        epmd -kill >/dev/null 2>&1 || true
        say "RabbitMQ: stopped"
    fi
    local name pidfile
    for name in MariaDB:mariadb/mysqld.pid Redis:redis/redis.pid; do
        pidfile=$run/${name#*:}
        alive "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill "$pid"
        # Wait, so that a start right after this one finds the port free.
        wait_for "$timeout" gone "$pid" || { say "ERROR: ${name%:*} did not stop"; exit 1; }
        say "${name%:*}: stopped"
    done
    rm -rf "$run/mariadb" "$run/redis" "$run/rabbitmq" "$run/rabbitmq-start.log"
    rmdir "$run" 2>/dev/null || true
}

status() { mysql_up && redis_up && amqp_port_open && amqp_up; }

print_env() {
    echo "export PHORGE_BRIDGE_TEST_MYSQL_URL=mysql+mysqldb://bridge:bridge@127.0.0.1:$mysql_port"
    echo "export PHORGE_BRIDGE_TEST_AMQP_URL=amqp://guest:guest@127.0.0.1:5672//"
    echo "export PHORGE_BRIDGE_TEST_REDIS_URL=redis://127.0.0.1:$redis_port"
}

case ${1:-} in
    install) install ;;
    start) install; mkdir -p "$run"; start_mysql; start_redis; start_rabbitmq ;;
    stop) stop ;;
    status) status >/dev/null 2>&1 ;;
    env) print_env ;;
    *) echo "usage: $0 install|start|status|stop|env" >&2; exit 2 ;;
esac
