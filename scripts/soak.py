"""Soak test: the live bso service on PostgreSQL under load, with faults injected at random.

Load.  ``--jobs`` synthetic recurring training jobs (default 100), each driven
by ``--runners-per-job`` threads (default 2, so two recurrences of one job run
at once and race for its lock), each thread with its own ``ServiceClient``:
register, then recurrence after recurrence: next trial, epoch reports until
the service says stop (now and then a trial is ended early, as a crash
would), end.  Epoch figures are small synthetic numbers from a seeded world
per job (no sleeping).  The load stops once ``--epochs-total`` epoch reports
(default 10,000) were accepted: every thread finishes its recurrence and exits.

Service.  Started the way ``bso up`` starts it (``bso_workers.stack.Stack``):
Redis with append-only persistence in a temporary data folder, ``--workers``
Celery nodes (default 4, solo pool: one process each), on PostgreSQL (a
private throwaway cluster started with initdb/pg_ctl on a free port, as the
tests do, unless ``--database-url`` names a migrated or empty database; it must
be one nobody else uses while the soak runs).  A supervisor thread restarts
worker nodes that die, as ``bso up`` does.  Beat and Flower are not started.

Faults, each logged with a timestamp to the fault log (one line per fault):

* ``worker_kill``: SIGKILL a random worker node (the supervisor starts it again);
* ``redis_restart``: SIGTERM or SIGKILL Redis, keep it down a moment, start it
  again with the same command line (port, data folder, append-only file);
  clients must ride the outage out;
* ``db_drop``: ``pg_terminate_backend`` every other connection to the database;
* ``duplicate``: a runner sends one event twice (same event id): half of the
  time as two concurrent calls, otherwise again once the first call was
  answered; both replies must be identical;
* ``reorder``: a runner sends the report of epoch n+1 before that of epoch n;
  it must get a typed error and change nothing, and that event id stays
  refused (its refusal is recorded, so a copy still in flight can never be
  applied later); then n and a new report of n+1 are sent in order and are
  accepted (unless the service stopped the trial at n);
* ``garbage``: items that are not bso messages (non-JSON, ``[]``, wrong
  envelopes, unknown tasks, pickle, oversized) LPUSHed straight onto the
  events queue over the workers' own (privileged) Redis connection; one in
  ten is PUBLISHed on Celery's remote-control channel instead, which every
  worker node listens to.

Check.  After the load the service is stopped (workers finish what they
hold), then:

* the recorded replies are read from the store per job in commit order and
  replayed through an in-process ``BsoService`` on a fresh ``MemoryStore``
  (:func:`bso.audit.audit`): every reply byte for byte, every trial (epochs,
  time, energy, cost, status, stop reason, ...), every lane's random state;
* the driver's ledger (every event it sent and the answers it got) is
  compared with the store.

Definitions (counted per distinct event id; an event sent several times, by a
duplicate or by the client's own re-sends, is one event):

* ``sent``: events the runners sent (register, next trial, epoch, end).
* ``accepted``: events that got a success reply.
* ``rejected``: events whose last answer was a typed error (the early copy of
  a reordered report, and any unexpected refusal, which is also listed and
  fails the run).
* ``lost``: a call that gave up (the client raised ServiceUnavailable or any
  non-typed error, so a training job would have crashed), an event sent that
  got no answer at all, or an accepted event whose effect is missing from the
  store: its reply not recorded, a trial it was handed missing, or a trial
  with fewer epochs than its highest accepted report.
* ``double_counted``: an effect beyond the accepted events: a recorded reply
  that differs from the one the caller got, an event applied though the
  caller was told it was refused (or never sent), the two copies of a
  duplicate answered differently, an early reordered report that was
  accepted, a trial number handed out to two events, a trial in the store
  that no recorded event created, a trial with more epochs than recorded
  reports for it, and every difference between the store and the serial
  replay (reply, trial, lane).

Output: progress on stderr, the fault log's path, a summary, and as the last
line::

    soak: sent=... accepted=... rejected=... lost=0 double_counted=0 epochs=... replay=ok ... \
faults: worker_kill=... redis_restart=... db_drop=... duplicate=... reorder=... garbage=...

Exit status 0 only if lost and double_counted are 0, the replay matches, no
unexpected refusal or worker death occurred, and the load reached
``--epochs-total`` before ``--duration-limit``.

    .venv/bin/python scripts/soak.py                    # full run, a few minutes
    .venv/bin/python scripts/soak.py --jobs 4 --epochs-total 100 --workers 2  # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from soak_load import Injector, Ledger, Load, Runner, Verdict, check, make_world
from soak_service import PROGRESS_EVERY_S, FaultLog, PrivateCluster, SoakStack

from bso_client.transport import ServiceClient

# -- options ----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--jobs", type=int, default=100, help="recurring jobs")
    add("--runners-per-job", type=int, default=2, help="threads running recurrences of each job")
    add("--epochs-total", type=int, default=10_000, help="accepted epoch reports to reach")
    add("--workers", type=int, default=4, help="Celery worker nodes (solo pool)")
    add("--seed", type=int, default=1, help="seed of the worlds and of the fault schedule")
    add("--database-url", help="PostgreSQL URL (default: a private cluster in a temp folder)")
    add("--duration-limit", type=float, default=900.0, help="seconds before the load is cut")
    add("--min-seconds", type=float, default=0.0, help="keep the load on at least this long")
    add("--data-dir", type=Path, help="folder for Redis, logs, fault log (default: a temp one)")
    add("--fault-log", type=Path, help="fault log path (default: DATA_DIR/faults.log)")
    add("--client-timeout", type=float, default=10.0, help="ServiceClient timeout_s")
    add("--worker-kill-every", type=float, default=12.0, help="mean seconds; 0: never")
    add("--redis-restart-every", type=float, default=30.0, help="mean seconds; 0: never")
    add("--redis-down", type=float, default=2.0, help="longest seconds Redis stays down")
    add("--db-drop-every", type=float, default=15.0, help="mean seconds; 0: never")
    add("--garbage-every", type=float, default=0.5, help="mean seconds between bursts; 0: never")
    add("--garbage-burst", type=int, default=3, help="most items per garbage burst")
    add("--duplicate-rate", type=float, default=0.015, help="share of events sent twice at once")
    add("--reorder-rate", type=float, default=0.015, help="share of epoch reports sent early")
    add("--abandon-rate", type=float, default=0.03, help="share of trials ended early")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.runners_per_job < 1 or args.workers < 1 or args.epochs_total < 1:
        parser.error("--jobs, --runners-per-job, --workers and --epochs-total must be >= 1")
    return args


# -- main -------------------------------------------------------------------------------


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    cluster = PrivateCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def progress(load: Load, started: float, target: int) -> str:
    elapsed = time.monotonic() - started
    with load.ledger.lock:
        sent = len(load.ledger.outcomes)
        epochs = load.ledger.epochs_accepted
    return (
        f"soak: {elapsed:6.1f} s  epochs {epochs}/{target}  events sent {sent} "
        f"({sent / max(elapsed, 1e-9):.0f}/s)  faults: {load.faults.summary()}"
    )


def run(args: argparse.Namespace) -> int:
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="bso-soak-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    faults = FaultLog(args.fault_log or data_dir / "faults.log")
    logging.basicConfig(
        filename=data_dir / "soak.log",
        level=logging.INFO,
        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s",
    )
    print(f"soak: data and logs in {data_dir}; fault log {faults.path}", file=sys.stderr)
    worlds = [make_world(i, args.seed) for i in range(args.jobs)]
    ledger = Ledger()
    load = Load(ledger, faults, args)
    with database(args.database_url) as database_url:
        stack = SoakStack(data_dir, database_url, args.workers, faults)
        injector = Injector(stack, faults, args)
        clients: list[ServiceClient] = []
        try:
            stack.start()
            faults.note(f"set-up: {args.workers} worker nodes up; load starts")
            runners = []
            for world in worlds:
                for number in range(args.runners_per_job):
                    client = stack.client(args.client_timeout)
                    clients.append(client)
                    runners.append(Runner(world, number, load, client))
            started = time.monotonic()
            for runner in runners:
                runner.start()
            injector.start()
            last_progress = started
            while any(r.is_alive() for r in runners):
                time.sleep(0.2)
                now = time.monotonic()
                if (
                    ledger.epochs_accepted >= args.epochs_total
                    and now - started >= args.min_seconds
                ):
                    load.enough.set()
                if now - started > args.duration_limit and not load.cut.is_set():
                    load.cut.set()
                    faults.note("duration limit reached: load cut")
                if now - last_progress >= PROGRESS_EVERY_S:
                    last_progress = now
                    print(progress(load, started, args.epochs_total), file=sys.stderr, flush=True)
            elapsed = time.monotonic() - started
            injector.done.set()
            injector.join()
            dead_letters = stack.dead_letter_counts()
            faults.note(f"load done after {elapsed:.1f} s; dead letters {dead_letters}; stopping")
        finally:
            injector.done.set()
            for client in clients:
                with contextlib.suppress(Exception):
                    client.close()
            stack.stop()
        faults.close()
        verdict = check(ledger, database_url, [w.job_id for w in worlds])
    return report(
        args=args,
        verdict=verdict,
        ledger=ledger,
        stack=stack,
        injector=injector,
        faults=faults,
        elapsed=elapsed,
        cut=load.cut.is_set(),
        dead_letters=dead_letters,
    )


def report(
    *,
    args: argparse.Namespace,
    verdict: Verdict,
    ledger: Ledger,
    stack: SoakStack,
    injector: Injector,
    faults: FaultLog,
    elapsed: float,
    cut: bool,
    dead_letters: dict[str, int],
) -> int:
    failures = [*ledger.problems, *verdict.findings, *stack.unexpected_deaths]
    if injector.error is not None:
        failures.append(f"fault injector failed: {injector.error!r}")
    if cut:
        failures.append(f"duration limit {args.duration_limit:g} s reached before the target")
    for line in failures[:40]:
        print(f"  {line}", file=sys.stderr)
    if len(failures) > 40:
        print(f"  ... and {len(failures) - 40} more", file=sys.stderr)
    replay = verdict.replay
    replay_ok = replay is not None and replay.ok
    print(f"fault log: {faults.path}")
    if replay is not None:
        print(
            f"replay: {replay.jobs} jobs, {replay.replayed} recorded events replayed serially, "
            f"{replay.trials} trials compared, {len(replay.differences)} differences"
        )
    print(f"dead letters (items the workers refused before decoding): {dead_letters or 'none'}")
    codes = ", ".join(f"{c}={n}" for c, n in sorted(verdict.rejected_codes.items())) or "none"
    print(f"rejected by code: {codes}; unexpected worker deaths: {len(stack.unexpected_deaths)}")
    ok = (
        verdict.lost == 0
        and verdict.double_counted == 0
        and replay_ok
        and not ledger.unexpected_refusals
        and not stack.unexpected_deaths
        and injector.error is None
        and not cut
        and verdict.epochs >= args.epochs_total
    )
    print(
        f"soak: sent={verdict.sent} accepted={verdict.accepted} rejected={verdict.rejected} "
        f"lost={verdict.lost} double_counted={verdict.double_counted} epochs={verdict.epochs} "
        f"jobs={args.jobs} workers={args.workers} seconds={elapsed:.0f} "
        f"replay={'ok' if replay_ok else 'differs'} result={'pass' if ok else 'FAIL'} "
        f"faults: {faults.summary()}",
        flush=True,
    )
    return 0 if ok else 1


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C / SIGTERM: unwind through the finally blocks, which stop everything.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("soak: interrupted; everything started was stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
