"""The PASS/FAIL lines and number formats every section prints with.

One :class:`Checks` is shared by all sections so that the summary at the end
can count passes and list every failure, whichever section it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass
class Checks:
    """PASS/FAIL lines as they come, and what failed for the summary."""

    failures: list[str] = field(default_factory=list)
    passed: int = 0

    def check(self, ok: bool, what: str, detail: str = "") -> None:
        tail = f": {detail}" if detail else ""
        print(f"  [{'PASS' if ok else 'FAIL'}] {what}{tail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)


def heading(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


def rel(value: float, reference: float) -> float:
    """Relative difference of ``value`` from ``reference`` (0 when both are 0)."""
    if reference == 0:
        return 0.0 if value == 0 else float("inf")
    return (value - reference) / reference


def gib(n_bytes: float) -> str:
    return f"{n_bytes / (1 << 30):.2f} GiB"
