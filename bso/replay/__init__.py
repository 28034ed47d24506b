"""Replaying recurring jobs on traces or synthetic workloads (``bso simulate``)."""
