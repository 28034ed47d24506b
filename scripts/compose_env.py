"""Write the secrets compose.yaml needs into ``.env`` (mode 0600), once.

    .venv/bin/python scripts/compose_env.py      # then: docker compose up --build

Every password is 256 random bits, URL-safe (they go into Redis and PostgreSQL
URLs unquoted).  An existing file is never overwritten (``--force`` does), so
running it twice cannot lock the running stack out of its own data; the secrets
it lacks (one a newer compose.yaml needs, such as ``BSO_REDIS_ADMIN_PASSWORD``) are
added to it, and the others are left as they are.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from bso_workers.credentials import Credentials, read_env_file, write_private

COMPOSE_SECRETS = (
    "BSO_REDIS_WORKER_PASSWORD",
    "BSO_REDIS_CLIENT_PASSWORD",
    "BSO_REDIS_ADMIN_PASSWORD",
    "BSO_FLOWER_PASSWORD",
    "BSO_POSTGRES_PASSWORD",
)


def env_text(names: tuple[str, ...] = COMPOSE_SECRETS) -> str:
    """Fresh ``NAME=secret`` lines for ``names``."""
    fresh = Credentials.generate()
    values = {
        "BSO_REDIS_WORKER_PASSWORD": fresh.worker_password,
        "BSO_REDIS_CLIENT_PASSWORD": fresh.client_password,
        "BSO_REDIS_ADMIN_PASSWORD": fresh.admin_password,
        "BSO_FLOWER_PASSWORD": fresh.flower_password,
        "BSO_POSTGRES_PASSWORD": secrets.token_urlsafe(32),
    }
    return "".join(f"{name}={values[name]}\n" for name in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path(".env"))
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    if args.output.exists() and not args.force:
        present = set(read_env_file(args.output))
        missing = tuple(name for name in COMPOSE_SECRETS if name not in present)
        if not missing:
            print(f"{args.output} exists; keeping it (--force replaces it)", file=sys.stderr)
            return 1
        text = args.output.read_text()
        write_private(args.output, text + ("" if text.endswith("\n") else "\n") + env_text(missing))
        print(f"{args.output} exists; added {', '.join(missing)}, kept the rest")
        return 0
    write_private(args.output, env_text())
    print(f"wrote {', '.join(COMPOSE_SECRETS)} to {args.output} (mode 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
