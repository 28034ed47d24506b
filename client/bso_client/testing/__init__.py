"""Test doubles for code that uses bso_client: a behaving fake of NVML and a fake clock.

Shipped with the client (not only in bso's own tests) so that users can test
their training loops' energy reporting on machines without GPUs.  Needs
``pynvml`` installed (the ``client`` extra), for its real error classes.
"""

from bso_client.testing.fake_nvml import (
    ConstantLoad,
    FakeClock,
    FakeGpu,
    FakeHandle,
    FakeNvml,
    LoadCurve,
    PiecewiseLinearLoad,
    SineLoad,
)

__all__ = [
    "ConstantLoad",
    "FakeClock",
    "FakeGpu",
    "FakeHandle",
    "FakeNvml",
    "LoadCurve",
    "PiecewiseLinearLoad",
    "SineLoad",
]
