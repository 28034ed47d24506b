"""Worker settings, read from the environment or a ``.env`` file (prefix ``BSO_``).

One flat model so that every knob of a deployment is listed in one place and
``bso up`` can hand the same values to every process it starts by setting
environment variables (see :meth:`WorkerSettings.to_env`).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bso.wire import keys
from bso_workers.limits import CELERY_HARD_LIMIT_GRACE_S, watchdog_lateness_s

PositiveSeconds = Annotated[float, Field(gt=0)]


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BSO_", env_file=".env", env_file_encoding="utf-8", extra="ignore"
    )

    broker_url: str = "redis://127.0.0.1:6379/0"
    """Redis that carries the events (Celery broker) and the replies."""
    database_url: str = "sqlite:///bso.sqlite3"
    """SQLAlchemy URL of the store; a SQLite file in the working directory by default."""
    reply_ttl_s: Annotated[int, Field(ge=1)] = keys.DEFAULT_REPLY_TTL_S
    """Lifetime of a reply key nobody picked up."""
    reply_retention_s: PositiveSeconds = 7 * 24 * 3600.0
    """How long the store remembers the replies of a DELETED job's events (a redelivered
    delete still gets its reply).  A live job's replies are kept as long as the job, so a
    duplicate of any of its events is recognised however late."""
    heartbeat_timeout_s: PositiveSeconds = 6 * 3600.0
    """The lease of a trial whose caller promised none (``NextTrial.lease_s``): silent
    this long, it is ended as interrupted by the sweep.  It must exceed the longest
    epoch of any job, since such a caller only speaks at epoch ends.  bso's client
    promises its own lease and sends heartbeats (see docs/client.md)."""
    sweep_interval_s: PositiveSeconds = 15.0
    """How often beat runs the sweep (expired leases, old replies): a vanished caller
    is noticed at most this long after its lease ran out."""
    soft_time_limit_s: PositiveSeconds = 30.0
    """A task still running after this long is interrupted and answers an error."""
    time_limit_s: PositiveSeconds = 60.0
    """A task still running after this long has its process killed and replaced."""
    visibility_timeout_s: PositiveSeconds = keys.DEFAULT_VISIBILITY_TIMEOUT_S
    """Seconds before an unacknowledged message of a dead worker node is redelivered."""
    max_worker_deaths: Annotated[int, Field(ge=1)] = 2
    """An event whose worker died this many times running it (hard time limit, OOM,
    crash) is answered ``poison_event`` and dropped instead of delivered again."""
    max_queue_item_bytes: Annotated[int, Field(ge=1024)] = keys.DEFAULT_MAX_QUEUE_ITEM_BYTES
    """A queue item larger than this is dead-lettered unread (``bso deadletters``)."""
    task_events: bool = True
    """Publish task events for Flower (one extra Redis publish per task)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["kv", "json"] = "kv"
    health_file: Path | None = None
    """A file the worker node touches from its event loop while it consumes, read by
    the container health check (:mod:`bso_workers.healthcheck`); None: no file."""

    @model_validator(mode="after")
    def _check_limits(self) -> WorkerSettings:
        if self.soft_time_limit_s >= self.time_limit_s:
            raise ValueError(
                f"soft_time_limit_s ({self.soft_time_limit_s}) must be below "
                f"time_limit_s ({self.time_limit_s}) so that the task can still answer"
            )
        longest = self.longest_task_s
        if self.visibility_timeout_s <= longest:
            raise ValueError(
                f"visibility_timeout_s ({self.visibility_timeout_s}) must exceed the longest "
                f"a task can run ({longest:g} s: time_limit_s {self.time_limit_s} plus the "
                "watchdog's polling and Celery's backstop), or running tasks get delivered twice"
            )
        return self

    @property
    def longest_task_s(self) -> float:
        """The longest a task can live: bso's hard limit, noticed by the watchdog up to
        one polling period late, and Celery's later backstop under prefork."""
        return (
            self.time_limit_s + watchdog_lateness_s(self.time_limit_s) + CELERY_HARD_LIMIT_GRACE_S
        )

    @property
    def heartbeat_timeout(self) -> timedelta:
        return timedelta(seconds=self.heartbeat_timeout_s)

    @property
    def reply_retention(self) -> timedelta:
        return timedelta(seconds=self.reply_retention_s)

    def to_env(self) -> dict[str, str]:
        """These settings as the ``BSO_*`` variables that reproduce them in a child process
        (an unset optional one, None, is left out: its default is None)."""
        return {
            f"BSO_{name.upper()}": str(value)
            for name, value in self.model_dump(mode="json").items()
            if value is not None
        }
