"""``--plot FILE`` of ``bso simulate`` and ``bso status``, checked before any work.

A replay of the traces takes minutes; finding out at the end that the plot's
folder does not exist, or that ``out.data`` is no image format matplotlib knows,
would lose them to a typo (and used to end in a traceback).  A path without an
extension is refused too: matplotlib would silently write ``FILE.png`` instead,
and the command would report a file that is not there.
"""

from __future__ import annotations

import os
from pathlib import Path

from bso.commands.failures import UserError

COMMON_FORMATS = ("png", "pdf", "svg")
"""What a refusal suggests first."""


def checked_plot_path(path: Path) -> Path:
    """``path`` if a plot can be written there; else a :class:`UserError` naming the fix."""
    formats = _image_formats()
    suffix = path.suffix.lower().removeprefix(".")
    if path.is_dir():
        raise UserError(f"--plot {path} is a folder; give a file's path, e.g. {path / 'plot.png'}")
    if not suffix:
        raise UserError(
            f"--plot {path} has no extension to choose the image format by; give one, "
            f"e.g. {path}.png (or .pdf, .svg)"
        )
    if suffix not in formats:
        raise UserError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; use "
            f"{', '.join('.' + f for f in COMMON_FORMATS)} (or any of {', '.join(formats)})"
        )
    folder = path.parent
    if not folder.is_dir():
        raise UserError(
            f"--plot {path}: the folder {folder} does not exist; create it first, "
            "or give a path in a folder that exists"
        )
    if not os.access(folder, os.W_OK):
        raise UserError(f"--plot {path}: cannot write in {folder}; give a folder you may write to")
    return path


def _image_formats() -> list[str]:
    """The extensions matplotlib can write, sorted."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UserError(
            "--plot needs matplotlib: pip install 'bso-batch-optimizer[plot]'"
        ) from None
    return sorted(FigureCanvasBase.get_supported_filetypes())
