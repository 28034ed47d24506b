"""``bso migrate``: apply the Alembic migrations.

Deployments run it once before the workers start; ``bso up`` runs it itself.
"""

from __future__ import annotations

import argparse
import os

from bso.storage.sql.engine import upgrade


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BSO_DATABASE_URL", "sqlite:///bso.sqlite3"),
        help="SQLAlchemy URL (default: $BSO_DATABASE_URL, else sqlite:///bso.sqlite3)",
    )


def run(args: argparse.Namespace) -> int:
    upgrade(args.database_url)
    print(f"database at the latest schema: {args.database_url}")
    return 0
