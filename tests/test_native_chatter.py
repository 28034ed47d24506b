"""Torch's native profiler lines are dropped; everything else written meanwhile is kept."""

from __future__ import annotations

import os

import pytest

from bso_client.native_chatter import CHATTER, quiet_profiler_chatter

TORCH_LINES = [
    "USDT:2026-11-27 06:13:11 10102:10102 SyncActivityProfilerHandler.cpp:52] profiler_start\n",
    "USDT:2026-11-27 06:13:11 10102:10102 SyncActivityProfilerHandler.cpp:59] profiler_stop\n",
    "[W1127 06:13:50.304667514 CPUAllocator.cpp:245] Memory block of unknown size was "
    "allocated before the profiling started, profiler results will not include the "
    "deallocation event\n",
]


def test_only_the_profilers_own_lines_are_chatter() -> None:
    assert all(CHATTER.search(line) for line in TORCH_LINES)
    for kept in ("UserWarning: something real\n", "profiler_start\n", "[W1127 other.cpp:1] x\n"):
        assert not CHATTER.search(kept)


def test_what_the_block_writes_to_descriptor_2_comes_back_without_the_chatter(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with quiet_profiler_chatter():
        for line in [TORCH_LINES[0], "a real warning\n", *TORCH_LINES[1:]]:
            os.write(2, line.encode())
    assert capfd.readouterr().err == "a real warning\n"
