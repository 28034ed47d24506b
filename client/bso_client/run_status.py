"""How a run ended, where a launcher or scheduler can read it: a status file and a last line.

A script bso stopped without convergence exits with :data:`EXIT_RELAUNCH` (3)
so that a scheduler launches the job again.  Under ``torchrun`` or
``accelerate launch`` that status is lost: the launcher exits 1 with a
``ChildFailedError`` whatever its children's codes were, so "relaunch" reads
like a crash.  :class:`RunStatus` says it in two ways a launcher does not
touch:

* the **status file** named by ``BSO_RUN_STATUS_FILE`` (or ``path=``), a small
  JSON object written by rank 0: ``"running"`` once the trial has its batch
  size, then the outcome when the ``with`` block ends::

      {"outcome": "relaunch", "exit_code": 3, "job_id": "nightly", "trial_number": 7,
       "batch_size": 256, "reason": "cost_bound", "world_size": 2, ...}

  The outcome is read from the exception that ends the block, else from
  the optimizer (a script that caught ``TrainFailError`` still reads
  "relaunch"); on SIGTERM inside the optimizer's ``with`` block, which kills the
  process before the block ends, "interrupted" is written as the signal arrives.
  A file still saying ``"running"`` after the launcher exited means the
  process was killed without a word (SIGKILL, the OOM killer): a crash.  Without the
  variable no file is written (every run of every job would otherwise write
  the same name in its working directory); the scheduler that wants the
  file chooses its path;
* **one distinct line** on rank 0's stderr, the last bso prints::

      bso: RELAUNCH job=nightly trial=7 batch_size=256 reason=cost_bound

The outcomes, and the exit code that goes with each (:attr:`exit_code`):
``converged`` (0), ``finished`` (0: the script ended without bso stopping
it), ``relaunch`` (3), ``interrupted`` (130: Ctrl-C, SIGTERM), ``crashed``
(1).  Use it around the optimizer, so it sees how the optimizer's block ended::

    status = RunStatus()
    with status, BatchSizeOptimizer(job, url) as bso:
        status.watch(bso)
        try:
            train(bso)
        except TrainFailError as err:   # bso stopped the run unconverged
            print(err, file=sys.stderr)
    sys.exit(status.exit_code)          # 3 for "relaunch"

Exceptions are never swallowed, and a file that cannot be written costs a
warning, never the run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal, Self

from bso_client.errors import TrainFailError

if TYPE_CHECKING:
    from bso_client.optimizer import BatchSizeOptimizer

logger = logging.getLogger(__name__)

STATUS_FILE_ENV: Final = "BSO_RUN_STATUS_FILE"
"""The environment variable that names the status file."""

EXIT_RELAUNCH: Final = 3
"""Exit status of a run bso stopped without convergence: launch the job again."""

Outcome = Literal["running", "converged", "finished", "relaunch", "interrupted", "crashed"]

EXIT_CODES: Final[dict[Outcome, int]] = {
    "running": 0,
    "converged": 0,
    "finished": 0,
    "relaunch": EXIT_RELAUNCH,
    "interrupted": 130,
    "crashed": 1,
}
"""The exit code a script should end with for each outcome (130: as a shell's Ctrl-C)."""

_ERROR_CHARS: Final = 300
"""An error's text is cut to this in the file: the file is a status, not a log."""


class RunStatus:
    """Records how the run ended, on rank 0: see the module docstring.

    Args:
        path: the status file; None reads ``BSO_RUN_STATUS_FILE`` (unset: no file).
        environ: where to read that variable and, before :meth:`watch`, ``RANK``.
    """

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, environ: dict[str, str] | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        given = path if path is not None else env.get(STATUS_FILE_ENV)
        self.path: Path | None = Path(given) if given else None
        self._rank = int(env.get("RANK", "0"))
        self._bso: BatchSizeOptimizer | None = None
        self.outcome: Outcome = "running"
        self.fields: dict[str, Any] = {}
        """What the file holds besides the outcome: job, trial, batch size, reason."""

    @property
    def exit_code(self) -> int:
        """The exit status that says :attr:`outcome` to a launcher that reads codes."""
        return EXIT_CODES[self.outcome]

    def watch(self, bso: BatchSizeOptimizer) -> None:
        """Follow ``bso``'s trial; asks for its batch size, so call it where
        :meth:`~bso_client.optimizer.BatchSizeOptimizer.get_batch_size` may be
        called (on every rank), and write ``"running"``."""
        self._bso = bso
        self._rank = bso.rank
        bso.get_batch_size()
        self._record("running", {})
        bso.on_sigterm(self._terminated)

    def _terminated(self) -> None:
        """SIGTERM (a preemption, torchrun tearing the job down): the process dies of
        it before ``__exit__`` runs, so say "interrupted" now, not "running" (which
        reads as a crash)."""
        self._say("interrupted", {"reason": "SIGTERM"})

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._say(*self._judge(exc))

    def _say(self, outcome: Outcome, fields: dict[str, Any]) -> None:
        """Write the file and, on rank 0, the last line."""
        self._record(outcome, fields)
        if self._rank == 0:
            details = " ".join(f"{k}={v}" for k, v in self.fields.items() if v is not None)
            print(f"bso: {outcome.upper()} {details}".rstrip(), file=sys.stderr, flush=True)

    def _judge(self, exc: BaseException | None) -> tuple[Outcome, dict[str, Any]]:
        if isinstance(exc, TrainFailError):
            reason = exc.reason.value if exc.reason is not None else None
            return "relaunch", {
                "job": exc.job_id,
                "trial": exc.trial_number,
                "batch_size": exc.batch_size,
                "reason": reason,
            }
        if isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, SystemExit) and exc.code not in (0, None)
        ):
            return "interrupted", {}
        if exc is not None and not isinstance(exc, SystemExit):
            return "crashed", {"error": f"{type(exc).__name__}: {exc}"[:_ERROR_CHARS]}
        bso = self._bso
        decision = bso.last_decision if bso is not None else None
        if bso is None or decision is None or not bso.training_finished:
            return "finished", {}
        if decision.converged:
            return "converged", {}
        # The script caught the TrainFailError itself (a trainer callback raised it).
        reason = decision.reason.value if decision.reason is not None else None
        return "relaunch", {"reason": reason}

    def _record(self, outcome: Outcome, extra: dict[str, Any]) -> None:
        self.outcome = outcome
        bso = self._bso
        self.fields = {
            "job": bso.job_id if bso else None,
            "trial": bso.trial_number if bso else None,
            "batch_size": bso.batch_size if bso else None,
            **extra,
        }
        if self.path is None or self._rank != 0:
            return
        document = {
            "outcome": outcome,
            "exit_code": self.exit_code,
            "job_id": self.fields["job"],
            "trial_number": self.fields["trial"],
            "batch_size": self.fields["batch_size"],
            **extra,
            "world_size": bso.world_size if bso else None,
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            scratch.write_text(json.dumps(document) + "\n")
            scratch.replace(self.path)  # atomic: a reader never sees half a file
        except OSError as exc:
            logger.warning("bso: could not write the run status file %s (%s)", self.path, exc)


__all__ = ["EXIT_CODES", "EXIT_RELAUNCH", "STATUS_FILE_ENV", "RunStatus"]
