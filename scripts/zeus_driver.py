"""Replay a trace "world" through Zeus 0.16.0's own server-side batch size optimizer.

Why this exists: the bso benchmark compares our optimizer with Zeus's real code,
not with a re-implementation of it, so that any difference is ours to explain.
Zeus pins packages (pydantic<2, numpy<2, ...) that clash with bso's, so this
script runs inside the side venv made by ``scripts/setup_zeus_venv.sh`` and must
not import ``bso``; it talks to the benchmark only through JSON on stdin/stdout.

Zeus's optimizer is meant to sit behind a FastAPI server. Instead of HTTP we do
in-process what each route of ``zeus.optimizer.batch_size.server.router`` does:
open a fresh ``AsyncSession``, wrap it in ``ZeusService`` and
``ZeusBatchSizeOptimizer``, call ``register_job`` / ``predict`` / ``report`` /
``end_trial``, then commit (or roll back on a Zeus error). The database is an
in-memory SQLite (aiosqlite) whose tables come from Zeus's own ``Base.metadata``.
The per-epoch loop copies what Zeus's client (``BatchSizeOptimizer``) sends:
cumulative time and energy of the trial, the metric and the epoch number, and
the trial is ended with ``end_trial`` as the client's ``atexit`` hook does.

Usage (stdin: one world object or a JSON list of worlds; stdout: the result, or
a list of results in the same order; logs go to stderr)::

    .venv-zeus/bin/python scripts/zeus_driver.py < world.json > result.json

Replay semantics (shared with bso's own simulator): for recurrence r, attempt a,
Zeus hands out size b and the run needs ``e = recurrences[r][a][str(b)]`` epochs
(null: never reaches the target). After epoch k the cumulative time is
``k * epoch_time_s(b)``, the energy ``time * avg_power_w(b) * gpu_count`` and the
metric is the target once ``k >= e``, else a value on the wrong side of it. A run
that Zeus stops before it reaches the target is followed by attempt a+1 (a new
trial); when the attempts run out the recurrence is recorded as not converged.
The cost of a run is ``eta * energy + (1 - eta) * max_power_w * gpu_count * time``
(Zeus's ``zeus_cost`` with the cluster-wide max power its client registers), and a
recurrence's cost is the sum over its attempts.

This module imports zeus lazily so that its pure helpers (the cost arithmetic)
can be imported and tested from bso's own venv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import cache
from types import SimpleNamespace
from typing import Any, TypeVar

POLICY = "zeus-0.16.0"
"""Name of the policy in the result JSON; the version is the one the venv pins."""

logger = logging.getLogger("zeus_driver")

T = TypeVar("T")


@dataclass(frozen=True)
class SizeProfile:
    """Per-batch-size physics of the world: seconds per epoch and mean power per GPU."""

    epoch_time_s: float
    avg_power_w: float


@dataclass(frozen=True)
class JobConfig:
    """The world's job block, with the defaults Zeus's ``JobParams`` uses."""

    job_id: str
    batch_sizes: list[int]
    default_batch_size: int
    eta_knob: float
    beta_knob: float | None
    target_metric: float
    higher_is_better_metric: bool
    max_epochs: int
    num_pruning_rounds: int
    window_size: int
    mab_prior_mean: float
    mab_prior_precision: float
    mab_num_explorations: int
    mab_seed: int | None
    max_power_w: float
    gpu_count: int
    gpu_model: str

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> JobConfig:
        """Parse the world's ``job`` object, filling in Zeus's own defaults."""
        return cls(
            job_id=str(raw["job_id"]),
            batch_sizes=[int(b) for b in raw["batch_sizes"]],
            default_batch_size=int(raw["default_batch_size"]),
            eta_knob=float(raw.get("eta_knob", 0.5)),
            beta_knob=None if raw.get("beta_knob", 2.0) is None else float(raw["beta_knob"]),
            target_metric=float(raw["target_metric"]),
            higher_is_better_metric=bool(raw.get("higher_is_better_metric", True)),
            max_epochs=int(raw.get("max_epochs", 100)),
            num_pruning_rounds=int(raw.get("num_pruning_rounds", 2)),
            window_size=int(raw.get("window_size", 0)),
            mab_prior_mean=float(raw.get("mab_prior_mean", 0.0)),
            mab_prior_precision=float(raw.get("mab_prior_precision", 0.0)),
            mab_num_explorations=int(raw.get("mab_num_explorations", 2)),
            mab_seed=None if raw.get("mab_seed") is None else int(raw["mab_seed"]),
            max_power_w=float(raw["max_power_w"]),
            gpu_count=int(raw.get("gpu_count", 1)),
            gpu_model=str(raw.get("gpu_model", "unknown")),
        )

    @property
    def cluster_max_power_w(self) -> float:
        """Max power of all GPUs together: what Zeus's client registers as ``max_power``."""
        return self.max_power_w * self.gpu_count

    def missed_metric(self) -> float:
        """A metric value that does not reach the target (one unit on the wrong side)."""
        return (
            self.target_metric - 1.0 if self.higher_is_better_metric else self.target_metric + 1.0
        )


def run_time_energy(profile: SizeProfile, epochs: int, gpu_count: int) -> tuple[float, float]:
    """Cumulative (time_s, energy_j) of a run after ``epochs`` epochs at one batch size."""
    time_s = epochs * profile.epoch_time_s
    return time_s, time_s * profile.avg_power_w * gpu_count


def run_cost(energy_j: float, time_s: float, eta_knob: float, cluster_max_power_w: float) -> float:
    """Zeus's energy-time cost, written out here so the result does not depend on zeus.

    ``cluster_max_power_w`` is ``max_power_w * gpu_count`` (see ``JobConfig``).
    """
    return eta_knob * energy_j + (1.0 - eta_knob) * cluster_max_power_w * time_s


def parse_sizes(raw: dict[str, Any]) -> dict[int, SizeProfile]:
    """Parse the world's ``sizes`` object (keys are batch sizes as strings)."""
    return {
        int(k): SizeProfile(float(v["epoch_time_s"]), float(v["avg_power_w"]))
        for k, v in raw.items()
    }


def epochs_needed(attempt: dict[str, Any], size: int) -> int | None:
    """Epochs the run at ``size`` needs to reach the target in this attempt (None: never).

    A missing size is a malformed world rather than "never converges", so it raises.
    """
    key = str(size)
    if key not in attempt:
        raise ValueError(f"attempt has no entry for batch size {size}: {sorted(attempt)}")
    value = attempt[key]
    return None if value is None else int(value)


@cache
def zeus_api() -> SimpleNamespace:
    """The Zeus (and SQLAlchemy) names the driver uses, imported on first use.

    Kept in one place so that the module imports without zeus (bso's venv runs the
    pure-arithmetic tests) and so the import, which takes seconds because Zeus's
    package pulls in scikit-learn, happens once.
    """
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
    from sqlalchemy.pool import StaticPool
    from zeus.optimizer.batch_size.common import (  # type: ignore[import-not-found]
        JobSpecFromClient,
        TrainingResult,
    )
    from zeus.optimizer.batch_size.server.database.schema import (  # type: ignore[import-not-found]
        Base,
    )
    from zeus.optimizer.batch_size.server.exceptions import (  # type: ignore[import-not-found]
        ZeusBSOServerBaseError,
    )
    from zeus.optimizer.batch_size.server.optimizer import (  # type: ignore[import-not-found]
        ZeusBatchSizeOptimizer,
    )
    from zeus.optimizer.batch_size.server.services.service import (  # type: ignore[import-not-found]
        ZeusService,
    )

    return SimpleNamespace(
        async_sessionmaker=async_sessionmaker,
        create_async_engine=create_async_engine,
        StaticPool=StaticPool,
        JobSpecFromClient=JobSpecFromClient,
        TrainingResult=TrainingResult,
        Base=Base,
        ZeusBSOServerBaseError=ZeusBSOServerBaseError,
        ZeusBatchSizeOptimizer=ZeusBatchSizeOptimizer,
        ZeusService=ZeusService,
    )


class ZeusInProcess:
    """Zeus's BSO server without the HTTP layer: one DB session per call, as its router does.

    Each public method mirrors one route of ``zeus.optimizer.batch_size.server.router``
    so that the optimizer sees the same transaction boundaries (and hence the same
    state) as behind a real server.
    """

    def __init__(self, sessionmaker: Any) -> None:
        """Keep the async sessionmaker bound to a database that already has Zeus's tables."""
        self._sessionmaker = sessionmaker
        self._optimizer_cls = zeus_api().ZeusBatchSizeOptimizer
        self._service_cls = zeus_api().ZeusService

    async def _request(self, call: Callable[[Any], Awaitable[T]], *, dry_run: bool = False) -> T:
        """Run one call in its own session; commit on success, roll back on error.

        With ``dry_run`` the session is always rolled back, so Zeus's answer is
        obtained without changing its state (used by the ``fast`` stop search).
        """
        async with self._sessionmaker() as session:
            optimizer = self._optimizer_cls(self._service_cls(session))
            try:
                result = await call(optimizer)
                if dry_run:
                    await session.rollback()
                else:
                    await session.commit()
            except BaseException:
                await session.rollback()
                raise
            return result

    async def register_job(self, spec: Any) -> bool:
        """POST /jobs: register the job (True if newly created)."""
        return await self._request(lambda opt: opt.register_job(spec))

    async def predict(self, job_id: str) -> Any:
        """GET /jobs/batch_size: start a new trial and return its ``TrialId``."""
        return await self._request(lambda opt: opt.predict(job_id))

    async def report(self, result: Any, *, dry_run: bool = False) -> Any:
        """POST /report: per-epoch report; returns ``ReportResponse`` (stop/converged)."""
        return await self._request(lambda opt: opt.report(result), dry_run=dry_run)

    async def end_trial(self, trial_id: Any) -> None:
        """PATCH /trials: end the trial (Zeus marks it Failed if it was never reported)."""
        await self._request(lambda opt: opt.end_trial(trial_id))

    async def stage(self, job_id: str) -> str:
        """The job's stage ("Pruning" or "MAB"), read through Zeus's service for the log."""

        async def read(opt: Any) -> str:
            job = await opt.service.get_job(job_id)
            return str(job.stage.value) if job is not None else "unknown"

        return await self._request(read)


def job_spec(job: JobConfig) -> Any:
    """Build the ``JobSpecFromClient`` that Zeus's client would register for this job."""
    return zeus_api().JobSpecFromClient(
        job_id=job.job_id,
        job_id_prefix=job.job_id,
        batch_sizes=list(job.batch_sizes),
        default_batch_size=job.default_batch_size,
        eta_knob=job.eta_knob,
        beta_knob=job.beta_knob,
        target_metric=job.target_metric,
        higher_is_better_metric=job.higher_is_better_metric,
        max_epochs=job.max_epochs,
        num_pruning_rounds=job.num_pruning_rounds,
        window_size=job.window_size,
        mab_prior_mean=job.mab_prior_mean,
        mab_prior_precision=job.mab_prior_precision,
        mab_num_explorations=job.mab_num_explorations,
        mab_seed=job.mab_seed,
        # Zeus's client registers the power limit of one GPU times the GPU count.
        max_power=job.cluster_max_power_w,
        number_of_gpus=job.gpu_count,
        gpu_model=job.gpu_model,
    )


async def first_stop_epoch(
    stops: Callable[[int], Awaitable[bool]], max_epochs: int, guess: int
) -> int:
    """Smallest epoch in ``[1, max_epochs]`` at which ``stops`` is true.

    ``stops`` must be monotone (once true, true for every later epoch) and true at
    ``max_epochs`` (Zeus always stops there). ``guess`` is where the answer most
    likely is (the epoch the run reaches the target): ``guess - 1`` and ``guess``
    are probed first, which settles the common case in two calls; otherwise a
    binary search over what is left takes ~log2(max_epochs) more.
    """
    low, high = 1, max_epochs  # the answer is always within [low, high]
    for candidate in (guess - 1, guess):
        if low <= candidate < high:
            if await stops(candidate):
                high = candidate
            else:
                low = candidate + 1
    while low < high:
        mid = (low + high) // 2
        if await stops(mid):
            high = mid
        else:
            low = mid + 1
    return low


async def run_attempt(
    zeus: ZeusInProcess,
    job: JobConfig,
    sizes: dict[int, SizeProfile],
    attempt: dict[str, Any],
    *,
    fast: bool = False,
) -> dict[str, Any]:
    """One training run: get a size, report epochs until Zeus says stop, end the trial.

    By default every epoch is reported, as Zeus's client does. With ``fast`` the
    first epoch at which Zeus says stop is found by ``first_stop_epoch`` over
    reports made in rolled-back sessions, and only that epoch's report is
    committed. The outcome is the same: within one trial of a sequential replay
    Zeus's state does not change, a "keep training" report writes nothing, and each
    stop condition (target reached, cost above ``beta_knob * min_cost``,
    ``epoch >= max_epochs``) stays true once true. It takes ~3 calls per trial
    instead of one per epoch.
    """
    trial = await zeus.predict(job.job_id)
    size = int(trial.batch_size)
    if size not in sizes:
        raise ValueError(f"Zeus chose batch size {size}, which the world's sizes lack")
    needed = epochs_needed(attempt, size)
    profile = sizes[size]
    missed = job.missed_metric()

    def result_at(epoch: int) -> Any:
        """What Zeus's client sends after ``epoch`` epochs (cumulative time and energy)."""
        time_s, energy_j = run_time_energy(profile, epoch, job.gpu_count)
        reached = needed is not None and epoch >= needed
        return zeus_api().TrainingResult(
            job_id=trial.job_id,
            batch_size=size,
            trial_number=trial.trial_number,
            time=time_s,
            energy=energy_j,
            metric=job.target_metric if reached else missed,
            current_epoch=epoch,
        )

    try:
        if fast:

            async def stops(epoch: int) -> bool:
                return bool((await zeus.report(result_at(epoch), dry_run=True)).stop_train)

            guess = job.max_epochs if needed is None else min(needed, job.max_epochs)
            epoch = await first_stop_epoch(stops, job.max_epochs, guess)
            response = await zeus.report(result_at(epoch))
            if not response.stop_train:
                raise RuntimeError(f"Zeus's stop decision is not monotone in epochs ({trial})")
        else:
            epoch = 0
            while True:
                epoch += 1
                if epoch > job.max_epochs:
                    raise RuntimeError(f"Zeus did not stop {trial} by epoch {job.max_epochs}")
                response = await zeus.report(result_at(epoch))
                if response.stop_train:
                    break
    finally:
        # Zeus's client registers this PATCH /trials call with atexit.
        await zeus.end_trial(trial)
    time_s, energy_j = run_time_energy(profile, epoch, job.gpu_count)
    return {
        "size": size,
        "trial_number": int(trial.trial_number),
        "epochs": epoch,
        "reached_target": needed is not None and epoch >= needed,
        "zeus_converged": bool(response.converged),
        "time_s": time_s,
        "energy_j": energy_j,
        "cost": run_cost(energy_j, time_s, job.eta_knob, job.cluster_max_power_w),
    }


async def run_recurrence(
    zeus: ZeusInProcess,
    job: JobConfig,
    sizes: dict[int, SizeProfile],
    attempts: list[dict[str, Any]],
    *,
    fast: bool = False,
) -> dict[str, Any]:
    """All attempts of one recurrence, until one reaches the target or they run out."""
    done: list[dict[str, Any]] = []
    error: str | None = None
    for attempt in attempts:
        try:
            outcome = await run_attempt(zeus, job, sizes, attempt, fast=fast)
        except zeus_api().ZeusBSOServerBaseError as err:
            # Behind HTTP this is an error response and the client raises; the job is
            # stuck (e.g. no size converged during pruning), so the recurrence fails.
            error = f"{type(err).__name__}: {err.message}"
            logger.warning("%s: Zeus refused: %s", job.job_id, error)
            break
        done.append(outcome)
        if outcome["reached_target"]:
            break
    record: dict[str, Any] = {
        "sizes": [a["size"] for a in done],
        "tries": len(done),
        "time_s": sum(a["time_s"] for a in done),
        "energy_j": sum(a["energy_j"] for a in done),
        "cost": sum(a["cost"] for a in done),
        "converged": bool(done) and done[-1]["reached_target"],
        "attempts": done,
        "zeus_stage": await zeus.stage(job.job_id),
    }
    if error is not None:
        record["error"] = error
    return record


async def replay_world(world: dict[str, Any], *, fast: bool = False) -> dict[str, Any]:
    """Replay one world through a fresh in-memory Zeus database and return its result."""
    api = zeus_api()
    job = JobConfig.from_json(world["job"])
    sizes = parse_sizes(world["sizes"])
    missing = [b for b in job.batch_sizes if b not in sizes]
    if missing:
        raise ValueError(f"world has no size profile for batch sizes {missing}")

    # One connection shared by every session, so the in-memory DB outlives each session.
    engine = api.create_async_engine("sqlite+aiosqlite://", poolclass=api.StaticPool)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(api.Base.metadata.create_all)
        zeus = ZeusInProcess(api.async_sessionmaker(bind=engine))
        await zeus.register_job(job_spec(job))
        started = time.perf_counter()
        recurrences = []
        for index, attempts in enumerate(world["recurrences"]):
            record = await run_recurrence(zeus, job, sizes, attempts, fast=fast)
            logger.info(
                "%s r%d: sizes=%s converged=%s cost=%.1f stage=%s",
                job.job_id,
                index,
                record["sizes"],
                record["converged"],
                record["cost"],
                record["zeus_stage"],
            )
            recurrences.append(record)
        logger.info(
            "%s: %d recurrences in %.2fs",
            job.job_id,
            len(recurrences),
            time.perf_counter() - started,
        )
    finally:
        await engine.dispose()
    return {
        "policy": POLICY,
        "job_id": job.job_id,
        # Recurrences Zeus refused outright (see run_recurrence): they cost 0 here,
        # so a caller comparing totals must decide how to charge them.
        "zeus_errors": sum(1 for r in recurrences if "error" in r),
        "recurrences": recurrences,
    }


async def replay_all(worlds: list[dict[str, Any]], *, fast: bool = False) -> list[dict[str, Any]]:
    """Replay worlds one after another, each on its own database.

    Sequential on purpose: replaying worlds concurrently with asyncio.gather was
    several times slower overall (each engine's aiosqlite thread fights for the GIL).
    """
    return [await replay_world(world, fast=fast) for world in worlds]


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run on uvloop when the venv has it (zeus[bso-server] pulls it in): ~20% faster here."""
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def main(argv: list[str] | None = None) -> int:
    """Read world(s) from stdin, write result(s) to stdout as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--log-level",
        default="WARNING",
        help="log level for this driver (stderr); Zeus's own loggers stay at ERROR "
        "unless --zeus-logs is given",
    )
    parser.add_argument("--zeus-logs", action="store_true", help="let Zeus log at --log-level")
    parser.add_argument(
        "--fast",
        action="store_true",
        help="find each trial's stop epoch with a few rolled-back reports instead of "
        "reporting every epoch (same result, several times faster; see run_attempt)",
    )
    args = parser.parse_args(argv)

    logging.basicConfig(
        stream=sys.stderr, level=args.log_level.upper(), format="%(levelname)s %(name)s %(message)s"
    )
    if not args.zeus_logs:
        # Zeus logs every report at INFO and warns about cold arms; that is noise here.
        logging.getLogger("zeus").setLevel(logging.ERROR)

    payload = json.load(sys.stdin)
    if isinstance(payload, list):
        results: Any = run_coroutine(replay_all(payload, fast=args.fast))
    else:
        results = run_coroutine(replay_world(payload, fast=args.fast))
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
