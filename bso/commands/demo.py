"""``bso demo``: a simulated recurring training job driven through the live service.

Everything a real training job would touch is real: Redis, the Celery
workers, the SQL store, and the caller's transport (:class:`ServiceClient`).
Only the training is simulated, by a synthetic workload of
:mod:`bso.replay.workloads`: for each recurrence the job asks for a batch
size, "trains" epoch by epoch (reporting cumulative time, energy and metric),
stops when told, and relaunches with a new batch size until a run converges,
exactly as :func:`bso.replay.simulate.replay_policy` does in-process.

Each recurrence prints its batch sizes, tries, cost and the service's current
recommendation, read through the ``bso.status`` task: the demo then needs
nothing but the broker URL, so it works the same against a stack it started
and against one already running elsewhere (``--broker-url``), and it reads
what a real client could read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from bso.commands.up import add_stack_arguments, stack_config
from bso.errors import BsoError, ServiceUnavailable, Unauthorized
from bso.replay.simulate import RecurrenceResult, make_world, run_recurrence
from bso.replay.workloads import Workload, synthetic_workloads
from bso.storage.sql.engine import SchemaTooNewError
from bso_client.transport import ServiceClient
from bso_workers.data_dir_lock import DataDirInUse
from bso_workers.stack import Stack
from bso_workers.supervision import stop_signals
from bso_workers.tenant_keys import LOAD_GENERATOR_LIMITS

HEADER = (
    f"{'rec':>4}  {'batch sizes tried':<24} {'tries':>5} {'cost (kJ)':>10}  "
    f"{'converged':<9}  recommendation"
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    names = [w.name for w in synthetic_workloads()]
    parser.add_argument(
        "--broker-url",
        help="use the service already running behind this Redis URL instead of starting one "
        "(its API key from BSO_API_KEY)",
    )
    parser.add_argument("--workload", choices=names, default=names[0], help="simulated job")
    parser.add_argument("--recurrences", type=int, default=15, help="recurrences to drive")
    parser.add_argument("--seed", type=int, default=1, help="seed of the simulated world")
    parser.add_argument("--eta-knob", type=float, default=0.5, help="the job's eta_knob")
    parser.add_argument(
        "--job-id", help="job id (default: a fresh one; reuse one to continue its learning)"
    )
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each reply"
    )
    add_stack_arguments(parser)
    parser.set_defaults(workers=2, data_dir=Path(".bso-demo"))


def run(args: argparse.Namespace) -> int:
    workload = next(w for w in synthetic_workloads() if w.name == args.workload)
    job_id = args.job_id or f"demo-{workload.name}-{uuid.uuid4().hex[:8]}"
    with stop_signals() as stopper:
        stopped = stopper.requested.is_set
        if args.broker_url:
            return drive(args.broker_url, workload, job_id, args, stopped)
        try:
            # The simulated job reports hours of epochs in seconds: at a team's
            # admission limits its own service would refuse it at the door.
            config = dataclasses.replace(
                stack_config(args, flower=False, redis_port=0, flower_port=0, owner="bso demo"),
                default_tenant_limits=LOAD_GENERATOR_LIMITS,
            )
        except ValueError as exc:
            print(f"bso demo: {exc}", file=sys.stderr)
            return 2
        print(f"starting the service ({args.workers} workers) in {args.data_dir} ...", flush=True)
        stack = Stack(config)
        try:
            with stopper.interruptible():
                stack.start()
        except KeyboardInterrupt:
            stack.stop()
            print("bso demo: interrupted while starting the service", file=sys.stderr)
            return 130
        except (DataDirInUse, SchemaTooNewError) as exc:
            print(f"bso demo: {exc}", file=sys.stderr)
            return 2
        except (RuntimeError, TimeoutError) as exc:
            print(f"bso demo: {exc}", file=sys.stderr)
            return 1
        try:
            print(stack.describe(), flush=True)
            assert stack.client_url is not None, "set by Stack.start"
            return drive(
                # The training client's credentials, as a user's job would have them.
                stack.client_url,
                workload,
                job_id,
                args,
                stopped,
                api_key=stack.api_key,
            )
        finally:
            stack.stop()
            print("service stopped", flush=True)


def drive(
    broker_url: str,
    workload: Workload,
    job_id: str,
    args: argparse.Namespace,
    stopped: Callable[[], bool],
    *,
    api_key: str | None = None,
) -> int:
    """Run the recurrences against the service at ``broker_url`` with ``api_key``
    (None: ``BSO_API_KEY``); 0 on success."""
    world = make_world(workload, args.recurrences, args.seed)
    oracle_size, oracle_cost = workload.oracle(args.eta_knob)
    spec = workload.job_spec(job_id=job_id, eta_knob=args.eta_knob, seed=args.seed)
    total = 0.0
    try:
        with ServiceClient.connect(broker_url, api_key=api_key, timeout_s=args.timeout) as client:
            registered = client.register(spec)
            print(
                f"\njob {registered.job_id} ({workload.name}, sizes {workload.batch_sizes}, "
                f"default {workload.default_batch_size}); oracle: {oracle_size} at "
                f"{oracle_cost / 1e3:.1f} kJ per recurrence\n\n{HEADER}",
                flush=True,
            )
            for index, attempts in enumerate(world.draws):
                if stopped():
                    print("interrupted", flush=True)
                    return 130
                result = run_recurrence(
                    client,
                    workload=workload,
                    job_id=job_id,
                    index=index,
                    attempts=attempts,
                    eta_knob=args.eta_knob,
                )
                total += result.cost
                print(row(result), flush=True)
    except (ServiceUnavailable, Unauthorized):
        raise  # the user's to fix (start the workers, give the key): bso.cli says how
    except BsoError as exc:
        print(f"bso demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    oracle_total = oracle_cost * args.recurrences
    print(
        f"\ntotal cost {total / 1e3:.1f} kJ over {args.recurrences} recurrences; "
        f"always the oracle's size would cost about {oracle_total / 1e3:.1f} kJ "
        f"({total / oracle_total:.2f}x)",
        flush=True,
    )
    return 0


def row(result: RecurrenceResult) -> str:
    sizes = " ".join(str(s) for s in result.sizes) or "-"
    if result.recommendation is None:
        recommendation = "none yet"
    elif result.confidence is None:
        recommendation = str(result.recommendation)
    else:
        recommendation = f"{result.recommendation} (confidence {result.confidence})"
    return (
        f"{result.index + 1:>4}  {sizes:<24} {result.tries:>5} {result.cost / 1e3:>10.1f}  "
        f"{'yes' if result.converged else 'no':<9}  {recommendation}"
    )
