"""Check the client's GPU-facing parts on a real NVIDIA GPU, and print what they measure.

The test suite checks these parts against fakes (:mod:`bso_client.testing`);
this package runs them on the real thing (``python3 scripts/gpu_check`` from
the repository root; see ``__main__`` and ``docs/gpu.md``).
"""
