"""The replies a SQL store recorded, per job, in the order it committed them.

The store stamps each reply (``replies.created_at``) inside the job's
transaction, i.e. under the job's lock, so within one job the stamps order the
events exactly as they were applied.  Jobs are independent of each other (each
has its own trials and random state), so per-job order is all a serial replay
needs (:mod:`bso.audit`).  Read-only; used by audits and tests, never by the
service itself.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import select

from bso.storage.schema import replies
from bso.storage.sql.engine import make_engine


@dataclass(frozen=True)
class RecordedReply:
    event_id: str
    job_id: str
    reply_json: str


def replies_in_commit_order(
    database_url: str, job_ids: Collection[str] | None = None
) -> dict[str, list[RecordedReply]]:
    """Recorded replies of ``job_ids`` (all jobs when None), per job in commit order.

    Ties between equal stamps (two events of one job within the clock's
    resolution) are broken by event id, which may misorder them; a replay then
    reports a difference rather than hiding one.
    """
    engine = make_engine(database_url)
    query = select(replies.c.event_id, replies.c.job_id, replies.c.reply).order_by(
        replies.c.job_id, replies.c.created_at, replies.c.event_id
    )
    wanted = None if job_ids is None else set(job_ids)
    history: dict[str, list[RecordedReply]] = {}
    try:
        with engine.connect() as connection:
            for row in connection.execute(query):
                if wanted is not None and row.job_id not in wanted:
                    continue
                history.setdefault(row.job_id, []).append(
                    RecordedReply(row.event_id, row.job_id, row.reply)
                )
    finally:
        engine.dispose()
    return history
