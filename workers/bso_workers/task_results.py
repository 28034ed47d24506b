"""The one line a task returns, for Flower's task list and Celery's own logs.

bso's replies travel on their reply keys, not through Celery's result backend,
so without a return value Flower shows every task's result as ``None`` and an
operator cannot tell a stop from a new trial.  Celery puts the task's return
value (its ``repr``, truncated) into the ``task-succeeded`` event Flower shows,
so each task returns a short summary of the reply it sent: its kind and the
identifiers an operator searches for, never the caller's key or channel.
"""

from __future__ import annotations

from pydantic import BaseModel

_FIELDS = (
    ("trial_number", "trial"),
    ("batch_size", "bs"),
    ("epoch", "epoch"),
    ("stop", "stop"),
    ("converged", "converged"),
    ("reason", "reason"),
    ("status", "status"),
    ("created", "created"),
    ("existed", "existed"),
    ("code", "code"),
)
"""Reply fields worth a glance, in the order they are shown, with their short names."""

FLOWER_TASK_COLUMNS = "name,uuid,state,result,received,runtime,worker"
"""Flower's task list: its defaults plus this line, which its default list leaves out
(an operator opened every task's page to read it); ``bso up`` and compose.yaml
(tests/test_compose.py) ask for the same."""


def reply_summary(reply: BaseModel, job_id: object = None, tenant: object = None) -> str:
    """``"<kind> job=<id> tenant=<t> trial=3 bs=64 ..."``: the fields of ``reply`` that
    are set.

    ``job_id``: the event's job, for replies (errors, status reads) that do not
    carry one.  ``tenant``: the sender's, once its key was checked (job ids are per
    tenant, so two teams' ``nightly`` are two jobs).  Values are printed with
    ``str``; enums with their value.
    """
    kind = str(getattr(reply, "kind", type(reply).__name__))
    parts = [kind]
    job = getattr(reply, "job_id", None) or job_id
    if job:
        parts.append(f"job={job}")
    if tenant:
        parts.append(f"tenant={tenant}")
    for field, short in _FIELDS:
        value = getattr(reply, field, None)
        if value is None or isinstance(value, BaseModel):
            continue
        parts.append(f"{short}={getattr(value, 'value', value)}")
    return " ".join(parts)
