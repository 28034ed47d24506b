"""``bso deadletters``: the queue items the workers refused, and why.

Reads what :class:`bso_workers.deadletters.DeadLetters` recorded: the counts per
reason (:data:`bso.wire.keys.DEADLETTER_COUNTS_KEY`) and the newest records
(:data:`bso.wire.keys.DEADLETTERS_KEY`); ``--purge`` deletes both.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import redis

from bso.commands.arguments import count
from bso.commands.failures import UserError, broker_fix
from bso.wire import keys
from bso.wire.connection import check_redis_url, redact_url
from bso_workers.credentials import CREDENTIALS_FILE, read_env_file
from bso_workers.deadletters import preview
from bso_workers.settings import WorkerSettings
from bso_workers.stack import DEFAULT_DATA_DIR


def read(client: redis.Redis, limit: int) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Counts per reason and the newest ``limit`` records."""
    counts = {_text(k): int(v) for k, v in client.hgetall(keys.DEADLETTER_COUNTS_KEY).items()}
    records = []
    for raw in client.lrange(keys.DEADLETTERS_KEY, 0, max(limit, 1) - 1)[:limit]:
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            record = {"unreadable": preview(raw if isinstance(raw, bytes) else raw.encode())}
        records.append(record)
    return counts, records


def purge(client: redis.Redis) -> int:
    """Delete the records and the counts; returns how many records there were."""
    with client.pipeline(transaction=True) as pipe:
        pipe.llen(keys.DEADLETTERS_KEY)
        pipe.delete(keys.DEADLETTERS_KEY, keys.DEADLETTER_COUNTS_KEY)
        length, _ = pipe.execute()
    return int(length)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--broker-url",
        help="Redis of the service, with the workers' user (default: BSO_WORKER_BROKER_URL "
        "from --data-dir's credentials.env when it exists, else $BSO_BROKER_URL)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="bso up's data dir, for its credentials (default: %(default)s)",
    )
    parser.add_argument(
        "--limit", type=count, default=20, help="newest records to show (default: %(default)s)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--purge", action="store_true", help="delete the records and counts after printing"
    )


def run(args: argparse.Namespace) -> int:

    saved = args.data_dir / CREDENTIALS_FILE
    settings = WorkerSettings()
    url = (
        args.broker_url
        or (read_env_file(saved).get("BSO_WORKER_BROKER_URL") if saved.exists() else None)
        or (settings.broker_url if "broker_url" in settings.model_fields_set else None)
    )
    if url is None:  # never a Redis that merely answers on the default port
        raise UserError(
            f"no service to ask: no credentials in --data-dir {args.data_dir}; run where bso "
            "up's --data-dir is, or give --broker-url (BSO_WORKER_BROKER_URL in its "
            "credentials.env)"
        )
    check_redis_url(url)
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    try:
        counts, records = read(client, max(args.limit, 0))
        purged = purge(client) if args.purge else None
    except redis.exceptions.NoPermissionError as exc:
        raise UserError(
            f"{redact_url(url)} may not read the dead letters ({exc}); give the workers' URL "
            f"(BSO_WORKER_BROKER_URL in {saved})"
        ) from exc
    except (redis.AuthenticationError, redis.exceptions.AuthorizationError) as exc:
        # Not broker_fix's advice for a training job: a team's file cannot read them.
        raise UserError(
            f"Redis refused the login of {redact_url(url)} ({exc}); bso deadletters reads "
            f"with the workers' user: give --broker-url the BSO_WORKER_BROKER_URL in {saved}"
        ) from exc
    except (redis.RedisError, OSError) as exc:
        raise UserError(f"cannot read {redact_url(url)}: {exc}; {broker_fix(exc)}") from exc
    finally:
        client.close()
    if args.json:
        print(json.dumps({"counts": counts, "records": records, "purged": purged}, indent=1))
        return 0
    print(_summary(counts))
    for record in records:
        print(_line(record))
    if purged is not None:
        print(f"purged {purged} records and the counts")
    return 0


SHORT_PREVIEW_CHARS = 240
"""How much of a record's preview the text listing shows: a line or three, not a page."""


def _summary(counts: Mapping[str, int]) -> str:
    total = counts.get("total", 0)
    reasons = ", ".join(f"{_safe(k)} {v}" for k, v in sorted(counts.items()) if k != "total")
    return f"{total} queue items refused" + (f" ({reasons})" if reasons else "")


def _line(record: Mapping[str, Any]) -> str:
    fields = ("at", "queue", "reason", "bytes", "worker", "replied_to")
    head = " ".join(_safe(str(record[f])) for f in fields if f in record)
    shown = _safe(str(record.get("preview")))
    if len(shown) > SHORT_PREVIEW_CHARS:
        shown = shown[:SHORT_PREVIEW_CHARS] + "... (--json shows the whole preview)"
    return f"{head}: {_safe(str(record.get('why', '')))}\n    {shown}"


def _safe(text: str) -> str:
    """A record field fit for a terminal: records are written by workers, but this
    reads whatever the list holds."""
    return text if text.isprintable() else ascii(text)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
