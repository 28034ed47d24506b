"""What the workers measure for Prometheus: events, their time in the queue and in hand.

Every worker process records into the files of ``prometheus_client``'s
multiprocess mode (the directory in ``PROMETHEUS_MULTIPROC_DIR``, which ``bso
up`` and compose set), and one exporter (:mod:`bso_workers.metrics_export`)
adds them up at each scrape: a counter is the sum over every process that ever
ran, whatever the pool or the number of nodes.  The files are named by host
and process id, not the process id alone, so worker containers sharing one
volume (compose) never write into each other's files.

Only what happens inside a task is recorded here.  What is better counted
where it is kept (the queue's depth, dead letters, trials and their stops, the
recommendations) is read at scrape time by the exporter, once, exactly.
Labels are bounded: event kinds and the error codes of :mod:`bso.errors`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Final

from prometheus_client import Counter, Histogram, values

from bso.wire import keys

MULTIPROC_DIR_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"


def _process_file_id() -> str:
    """``host-pid`` without underscores (prometheus_client splits file names on them)."""
    return f"{socket.gethostname().replace('_', '-')}-{os.getpid()}"


if os.environ.get(MULTIPROC_DIR_ENV):
    values.ValueClass = values.MultiProcessValue(  # type: ignore[no-untyped-call]
        process_identifier=_process_file_id
    )

LATENCY_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
"""Seconds: an event is handled in milliseconds; the tail shows a backlog or a stall."""

EVENT_TYPES: Final = (*keys.TASK_FOR_KIND, "status", "list_jobs", "invalid", "refused")
"""The ``type`` label's values: every event kind, the two reads, an event that did not
validate, and one refused unapplied past its tenant's queue bound."""

EVENTS: Final = Counter(
    "bso_events",
    f"Events the workers handled, by type ({', '.join(EVENT_TYPES)}) and outcome (ok, or "
    "the error code answered)",
    ["type", "outcome"],
)
QUEUE_SECONDS: Final = Histogram(
    "bso_event_queue_seconds",
    "Seconds from the client sending an event to a worker starting it (the client's clock: "
    "skew between hosts shifts it; negative values count as 0)",
    ["type"],
    buckets=LATENCY_BUCKETS,
)
HANDLING_SECONDS: Final = Histogram(
    "bso_event_handling_seconds",
    "Seconds a worker spent on an event: decode, the store transaction, the reply",
    ["type"],
    buckets=LATENCY_BUCKETS,
)


def observe_event(
    kind: str, outcome: str, started: float, sent_at: float | None, started_wall: float
) -> None:
    """Record one handled event.  ``started``: ``time.perf_counter()`` when the task
    began; ``started_wall``: ``time.time()`` then, compared with the client's
    ``sent_at`` (:data:`bso.wire.keys.SENT_AT_HEADER`)."""
    EVENTS.labels(kind, outcome).inc()
    HANDLING_SECONDS.labels(kind).observe(time.perf_counter() - started)
    if sent_at is not None:
        QUEUE_SECONDS.labels(kind).observe(max(started_wall - sent_at, 0.0))
