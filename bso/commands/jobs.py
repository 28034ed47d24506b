"""``bso jobs``: list the tenant's jobs, reset one, delete one, or give a lane new sizes.

Every action goes through the live service as a training client does (events over
Redis with the tenant's API key, :mod:`bso.commands.live`), so the service checks
the key: a tenant lists and reaches only its own jobs (job ids are per tenant:
another tenant's job of the same id is never found).  These are the ways out that
``NoFeasibleBatchSize`` and ``ConfigMismatch`` name (:mod:`bso.job_admin`):

* ``reset JOB`` forgets the job's finished trials and keeps its spec and each
  lane's sizes; a trial still running is kept, its run goes on and counts.
* ``set-sizes JOB --lane KEY --batch-sizes ...`` gives one hardware lane a new list;
  trials at sizes still listed keep counting.
* ``delete JOB`` removes the job; the next registration of its id starts afresh.
"""

from __future__ import annotations

import argparse
import json

from bso.commands.arguments import job_id
from bso.commands.failures import UserError
from bso.commands.live import add_api_key_argument, add_service_arguments, connect
from bso.errors import InvalidEvent, InvalidSpec, UnknownJob
from bso.spec import MAX_BATCH_SIZE, listed
from bso.wire.jobs_query import JobSummary

ACTIONS = {
    "list": "List the API key's tenant's jobs: lanes, trials, last activity.",
    "reset": "Forget a job's finished trials; keep its spec and its lanes' sizes.",
    "delete": "Delete a job with its trials; its id can be registered afresh.",
    "set-sizes": "Give one hardware lane of a job a new list of batch sizes.",
}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated integers, e.g. 32,64,128"
        ) from None
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one batch size, e.g. 32,64,128")
    return [_in_range(size) for size in sizes]


def _size(text: str) -> int:
    try:
        return _in_range(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer, e.g. 64") from None


def _in_range(size: int) -> int:
    """``size`` if a lane may have it (what the event's model takes), else the
    argument's error: a typo is the user's to fix, not a bug of bso's."""
    if not 1 <= size <= MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(f"{size} is not a batch size: 1 to {MAX_BATCH_SIZE}")
    return size


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_service_arguments(parser)
    actions = parser.add_subparsers(dest="action", required=True)
    formatter = parser.formatter_class
    for name, summary in ACTIONS.items():
        action = actions.add_parser(
            name, help=summary, description=summary, formatter_class=formatter
        )
        add_api_key_argument(action)
        if name != "list":
            action.add_argument("job", type=job_id, help="the job id (see `bso jobs list`)")
    actions.choices["list"].add_argument("--json", action="store_true", help="print JSON")
    set_sizes = actions.choices["set-sizes"]
    set_sizes.add_argument(
        "--lane", required=True, help="the hardware lane, as bso status shows it: 'NVIDIA A100 x8'"
    )
    set_sizes.add_argument(
        "--batch-sizes", required=True, type=_sizes, help="the lane's new sizes: 32,64,128"
    )
    set_sizes.add_argument(
        "--default",
        type=_size,
        help="the default batch size (default: the lane's, or the listed size nearest it)",
    )


def no_such_job(job: str) -> UserError:
    """What every action says of a job the key's tenant does not have (one wording:
    ``reset`` used to say "is not registered" where ``delete`` said "there is no job")."""
    return UserError(f"there is no job {job!r}; bso jobs list shows the jobs")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UnknownJob:
        if getattr(args, "job", None) is None:  # list names no job
            raise
        raise no_such_job(args.job) from None


def _run(args: argparse.Namespace) -> int:
    with connect(args) as client:
        if args.action == "list":
            jobs = client.list_jobs()
            if args.json:
                print(json.dumps([j.model_dump(mode="json") for j in jobs], indent=1))
            else:
                print(describe(jobs))
        elif args.action == "reset":
            reset = client.reset_job(args.job)
            kept = f"; {reset.running} running trial(s) kept" if reset.running else ""
            print(
                f"job {reset.job_id} reset: {reset.forgotten} finished trial(s) forgotten"
                f"{kept}; its spec and its lanes' sizes stay"
            )
        elif args.action == "delete":
            if not client.delete_job(args.job).existed:
                raise no_such_job(args.job)
            print(f"job {args.job} deleted")
        else:
            try:
                done = client.set_lane_sizes(
                    args.job, args.lane, args.batch_sizes, default_batch_size=args.default
                )
            except (InvalidEvent, InvalidSpec) as exc:
                raise UserError(exc.message) from None
            print(
                f"job {done.job_id}, lane {done.lane}: batch sizes "
                f"{listed(done.plan.batch_sizes)} (default {done.plan.default_batch_size}); "
                f"{done.kept_trials} trial(s) at sizes kept still count, "
                f"{done.set_aside_trials} set aside. List the same sizes in the job."
            )
    return 0


def describe(jobs: list[JobSummary]) -> str:
    """One row per job: id, trials (running), last activity, lanes."""
    if not jobs:
        return "no jobs for this API key's tenant"
    width = max(len("job"), *(len(j.job_id) for j in jobs))
    lines = [f"{'job':<{width}} {'trials':>6} {'running':>7}  {'last activity':<25} lanes"]
    for job in jobs:
        when = job.last_activity.isoformat(timespec="seconds")
        lines.append(
            f"{job.job_id:<{width}} {job.trials:>6} {job.running_trials:>7}  {when:<25} "
            + ", ".join(job.lanes)
        )
    return "\n".join(lines)
