"""The lane's last recommendation known on this machine: what a run starting detached uses.

Every status the optimizer reads (when a trial starts, when it ends) leaves the
lane's recommended batch size in ``<cache dir>/recommendations/<key>.json``,
keyed by the job's key for the tenant the run acts for
(:func:`~bso_client.detached_journal.local_owner`: job ids are per tenant) and the
hardware key; a run that cannot reach the service
at its start trains at that size (:mod:`bso_client.fail_open`), else at the
job's default.  A file that is missing or unreadable is no recommendation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from bso.apikeys import DEFAULT_TENANT, job_key
from bso_client.discovery import cache_dir

logger = logging.getLogger(__name__)


def _path(job_id: str, hardware_key: str, root: Path | None, owner: str) -> Path:
    key = job_key(owner, job_id)  # the default tenant's files stay where they were
    digest = hashlib.sha256(json.dumps([key, hardware_key]).encode()).hexdigest()[:24]
    return cache_dir(root) / "recommendations" / f"{digest}.json"


def remember(
    job_id: str,
    hardware_key: str,
    batch_size: int,
    root: Path | None = None,
    owner: str = DEFAULT_TENANT,
) -> None:
    """Keep ``batch_size`` as ``owner``'s lane's recommendation; a failure to write costs
    nothing."""
    document = {"job_id": job_id, "hardware": hardware_key, "batch_size": batch_size}
    try:
        path = _path(job_id, hardware_key, root, owner)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".rec-", suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(document, out)
        os.replace(temporary, path)
    except OSError as err:  # a full or read-only disk, no cache folder at all
        logger.debug("bso: cannot keep the recommendation of job %s: %s", job_id, err)


def recall(
    job_id: str, hardware_key: str, root: Path | None = None, owner: str = DEFAULT_TENANT
) -> int | None:
    """``owner``'s lane's last recommendation kept on this machine, if any."""
    try:
        document = json.loads(_path(job_id, hardware_key, root, owner).read_text())
    except (OSError, ValueError):
        return None
    size = document.get("batch_size") if isinstance(document, dict) else None
    same = isinstance(document, dict) and document.get("job_id") == job_id
    return size if same and isinstance(size, int) and size > 0 else None
