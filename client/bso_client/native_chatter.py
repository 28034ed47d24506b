"""Keep torch's native profiler chatter off the user's terminal.

On the CPU the memory probe measures a step with ``torch.profiler``, and each
profiled step makes torch's C++ side write straight to file descriptor 2 (not
through Python's ``sys.stderr``, so no logging setting reaches it)::

    USDT:2026-11-27 06:13:11 10102:10102 SyncActivityProfilerHandler.cpp:52] profiler_start
    [W1127 06:13:11.0495 CPUAllocator.cpp:245] Memory block of unknown size was
    allocated before the profiling started, ... (one line)

Nine or more such lines per probe said nothing to the user.  :func:`quiet_profiler_chatter`
sends descriptor 2 to a temporary file while the profiler runs, then writes back
every line that is not one of those, so nothing else written meanwhile is lost.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

CHATTER = re.compile(
    r"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*$"
    r"|^\[W\d+ [\d:.]+ (?:\d+ )?CPUAllocator\.cpp:\d+\] Memory block of unknown size was "
    r"allocated before the profiling started"
)
"""The lines torch writes around each profiled step, and nothing else."""


@contextmanager
def quiet_profiler_chatter() -> Iterator[None]:
    """Run the block with descriptor 2 captured; write back what is not :data:`CHATTER`."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2 (a daemon) or a closed stderr
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [
                line
                for line in captured.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not CHATTER.search(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
