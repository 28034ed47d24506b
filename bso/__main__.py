"""``python -m bso``: the ``bso`` command, for child processes started with this Python."""

from bso.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
