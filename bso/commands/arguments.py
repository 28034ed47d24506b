"""Argument types the sub-commands share (argparse ``type=`` callables)."""

from __future__ import annotations

import argparse

from bso.apikeys import JOB_KEY_SEPARATOR
from bso.ids import JOB_ID_RULE, is_job_id, is_tenant


def positive_int(text: str) -> int:
    """A whole number of at least 1, or argparse's usage error naming what was given."""
    return _whole_number(text, at_least=1)


def count(text: str) -> int:
    """A whole number of at least 0 (``--limit``, ``--max-jobs``): a negative one was
    taken as Python's slice from the end (``--max-jobs -1`` exported all but one)."""
    return _whole_number(text, at_least=0)


def _whole_number(text: str, *, at_least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < at_least:
        raise argparse.ArgumentTypeError(f"must be at least {at_least}, got {value}")
    return value


MAX_PORT = 65535


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: past them the socket's ``bind`` raised
    ``OverflowError`` as the stack started, which ``bso`` reported as a bug in itself."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is 0 (any free one) to {MAX_PORT}, got {value}")
    return value


def _tenants_job(text: str) -> str | None:
    """The job id of ``TENANT/JOB`` (:func:`bso.apikeys.job_key`), else None."""
    tenant, separator, rest = text.partition(JOB_KEY_SEPARATOR)
    return rest if separator and is_tenant(tenant) and is_job_id(rest) else None


def job_id(text: str) -> str:
    """A job id as a team names its jobs (:data:`bso.ids.JOB_ID_PATTERN`)."""
    if is_job_id(text):
        return text
    if (rest := _tenants_job(text)) is not None:
        raise argparse.ArgumentTypeError(
            f"a team names its own jobs by their id alone ({rest!r}); TENANT/JOB names "
            "another tenant's job, for an operator's bso status --database-url"
        )
    raise argparse.ArgumentTypeError(f"not a job id: a job id {JOB_ID_RULE}")


def job_or_tenant_job(text: str) -> str:
    """A job id, or ``TENANT/JOB`` where the command may read every tenant's jobs."""
    if is_job_id(text) or _tenants_job(text) is not None:
        return text
    raise argparse.ArgumentTypeError(
        f"not a job: a job id {JOB_ID_RULE}, or TENANT/JOB for another tenant's job"
    )
