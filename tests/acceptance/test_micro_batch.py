"""Micro-batch exploration in a real training loop, run as a user runs it against a
live ``bso up``.

The user passes ``explore_micro_batch=True`` and calls ``bso.explore_micro_batch``
at the start of the first epoch (``mnist_loop.py --explore-micro-batch STEPS``):
the run logs the interim recommendations Cerebras-style and its choice, trains
the rest at that split, and ``bso status`` shows per global batch the
micro-batch the runs settled on.  A later run at the same batch starts from
what earlier runs timed.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.acceptance.conftest import (
    LiveService,
    run_trainer,
    torchrun_argv,
    trainer_argv,
    trials_of,
)

pytestmark = pytest.mark.integration

INTERIM = re.compile(
    r"current recommended micro_batch_size: (\d+), estimated performance: "
    r"\d+\.\d\dx base, confidence score: (\d+) \(out of 100\)$"
)
CHOICE = re.compile(r"bso micro-batch for batch size (\d+): (\d+) per pass x (\d+) pass\(es\)")


def test_runs_explore_micro_batches_and_bso_status_shows_the_choice(
    service: LiveService,
) -> None:
    job = "acceptance-micro-batch"
    argv = trainer_argv("mnist_loop", "--job-id", job, "--explore-micro-batch", "12")
    runs = [run_trainer(argv, service.env()) for _ in range(3)]
    for run in runs:
        assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
        assert not run.bso_lines("ERROR"), str(run)
        summary = run.summary
        per_device, micro = summary["batch_size"], summary["micro_batch_size"]
        # The run trained its whole batch per step, in passes of the chosen micro-batch.
        assert micro * summary["accumulation_steps"] == per_device, str(run)
        info = run.bso_lines("INFO")
        chosen = [m for line in info if (m := CHOICE.search(line))]
        learned = [line for line in info if "learned from earlier runs" in line]
        assert len(chosen) + len(learned) >= 1, str(run)
        if chosen:
            (match,) = chosen
            assert (int(match[1]), int(match[2])) == (per_device, micro), str(run)
            assert int(match[3]) == summary["accumulation_steps"], str(run)
        if not learned:  # an exploration ran: its interim lines came first
            assert any(INTERIM.search(line) for line in info), str(run)
    status = service.status(job)
    (lane,) = status["lanes"]
    explored = Counter(t["batch_size"] for t in trials_of(status).values())
    shown = {m["batch_size"]: m for m in lane["micro_batches"]}
    assert shown, lane
    for size, choice in shown.items():
        assert choice["runs"] <= explored[size]
        assert size % choice["micro_batch_size"] == 0
        assert 0 <= choice["confidence"] <= 100
    text = service.status_text(job)
    for size, choice in shown.items():
        assert (
            f"  micro-batch at batch size {size}: {choice['micro_batch_size']} per pass "
            f"(confidence {choice['confidence']}, {choice['timed_steps']} steps timed over "
            f"{choice['runs']} run(s))"
        ) in text, text


def test_every_rank_of_a_ddp_job_takes_the_same_micro_batch(service: LiveService) -> None:
    """torchrun with 2 processes: each rank explores its own share of the global batch,
    rank 0's times decide, and every rank trains at the same split."""
    job = "acceptance-micro-batch-ddp"
    argv = torchrun_argv(2, "ddp_trainer", "--job-id", job, "--explore-micro-batch", "10")
    for _ in range(2):
        run = run_trainer(argv, service.env())
        assert run.run_status["outcome"] in ("converged", "relaunch"), str(run)
        summary = run.summary
        per_rank = summary["batch_size"] // 2
        (micro, passes), other = summary["micro_batches"]
        assert [micro, passes] == other, str(run)
        assert micro * passes == per_rank, str(run)
        assert any(CHOICE.search(line) for line in run.bso_lines("INFO")) or any(
            "learned from earlier runs" in line for line in run.bso_lines("INFO")
        ), str(run)
    (lane,) = service.status(job)["lanes"]
    assert lane["micro_batches"], lane
    for choice in lane["micro_batches"]:
        assert (choice["batch_size"] // 2) % choice["micro_batch_size"] == 0, lane
