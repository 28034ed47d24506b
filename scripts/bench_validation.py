"""Time to validate a register event's spec, by number of batch sizes.

Usage: ``python scripts/bench_validation.py [--repeat 5]``

Validation runs on the worker for every event a caller sends, so its cost must
grow linearly with the input and stop early on input beyond the bounds: a
register with 60,000 batch sizes (the old quadratic duplicate check took about
47 s on it) must be refused at once with a typed error naming ``batch_sizes``.
Prints the best of ``repeat`` runs, in milliseconds, for a valid spec of
:data:`bso.spec.MAX_BATCH_SIZES` (4096) sizes, for one with that many sizes
and a duplicate (the whole list is checked), and for 60,000 sizes.
No timed assertions in the tests: this script is where the figure is read.
"""

from __future__ import annotations

import argparse
import json
import time

from pydantic import ValidationError

from bso.spec import MAX_BATCH_SIZES
from bso.wire.events import EVENT_ADAPTER


def register_json(sizes: list[int]) -> str:
    """A register event's wire form (JSON text, as a worker receives it)."""
    spec = {
        "job_id": "bench",
        "batch_sizes": sizes,
        "default_batch_size": sizes[0],
        "target_metric": 0.9,
    }
    return json.dumps({"kind": "register", "event_id": "e1", "spec": spec})


def best_ms(payload: str, repeat: int) -> tuple[float, str]:
    """Best validation time of ``payload`` and its outcome (``ok`` or the error)."""
    best, outcome = float("inf"), ""
    for _ in range(repeat):
        started = time.perf_counter()
        try:
            EVENT_ADAPTER.validate_python(json.loads(payload))
            outcome = "ok"
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            outcome = f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
        best = min(best, time.perf_counter() - started)
    return best * 1000, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    cases = {
        f"{MAX_BATCH_SIZES} sizes": list(range(1, MAX_BATCH_SIZES + 1)),
        f"{MAX_BATCH_SIZES} sizes, one duplicate": [*range(1, MAX_BATCH_SIZES), 7],
        "60000 sizes": list(range(1, 60_001)),
    }
    for name, sizes in cases.items():
        ms, outcome = best_ms(register_json(sizes), args.repeat)
        print(f"{name:<28} {ms:9.2f} ms  {outcome[:90]}")


if __name__ == "__main__":
    main()
