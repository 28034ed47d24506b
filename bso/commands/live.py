"""Reaching the live service from a command, as a training client does: the client URL
and the tenant's API key, over Redis, so the service checks the key on every call.

Where they come from: ``--broker-url`` / ``--api-key``, else ``$BSO_BROKER_URL`` /
``$BSO_API_KEY``, else the credentials ``bso up`` saved in its ``--data-dir``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bso.commands.failures import UserError
from bso.errors import ServiceUnavailable
from bso.wire.connection import BrokerUnreachable, cause_of, redact_url
from bso_client.transport import API_KEY_ENV, ServiceClient
from bso_workers.credentials import CREDENTIALS_FILE, read_env_file
from bso_workers.stack import DEFAULT_DATA_DIR


def add_api_key_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help=f"the tenant's API key (default: ${API_KEY_ENV})")


def add_service_arguments(parser: argparse.ArgumentParser) -> None:
    """``--broker-url`` and ``--data-dir``: global options (:data:`bso.cli.GLOBAL_OPTIONS`),
    which ``bso.cli`` also gives every action of a command."""
    parser.add_argument("--broker-url", help="the service's client URL (what bso up prints)")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="bso up's data dir, for its client URL and key (default: %(default)s)",
    )


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[ServiceClient]:
    """A client of the service ``args`` name; it fails at once when the broker is down
    (no outage window: a command's user is there to read the error), with a line that
    names the service's URL (password masked), where the URL came from and what to
    check, rather than the training client's outage settings."""
    saved_path = Path(args.data_dir) / CREDENTIALS_FILE
    saved = read_env_file(saved_path) if saved_path.exists() else {}
    key = args.api_key or os.environ.get(API_KEY_ENV) or saved.get(API_KEY_ENV)
    if args.broker_url:
        url, source = args.broker_url, "--broker-url"
    elif os.environ.get("BSO_BROKER_URL"):
        url, source = os.environ["BSO_BROKER_URL"], "$BSO_BROKER_URL"
    elif saved.get("BSO_BROKER_URL"):
        url, source = saved["BSO_BROKER_URL"], f"bso up's {saved_path}"
    else:
        raise UserError(
            f"no service to ask: no {CREDENTIALS_FILE} in {saved_path.parent}, where bso up "
            "writes its URL and key (is bso up running? `bso up --data-dir DIR` starts one; "
            "give this command the same --data-dir), and no --broker-url or $BSO_BROKER_URL"
        )
    with ServiceClient.connect(url, api_key=key, outage_window_s=0) as client:
        try:
            yield client
        except ServiceUnavailable as exc:
            outage = cause_of(exc, BrokerUnreachable)
            if outage is None:  # refused credentials, no worker, a rate limit: said as is
                raise
            raise UserError(unreachable_line(url, source, outage)) from exc


def unreachable_line(url: str, source: str, outage: BrokerUnreachable) -> str:
    """``the bso service at redis://...@host:port/0 is unreachable (Connection refused);
    check ...``: what the command's user sees, in the command's terms."""
    cause = outage.__cause__
    why = f" ({' '.join(str(cause).split())})" if cause is not None and str(cause) else ""
    fix = (
        "is bso up still running? It saved that URL when it started"
        if source.startswith("bso up's")
        else f"check that {source} names the host and port the service listens on (what "
        "bso up prints) and that the service runs there; `bso up` starts one"
    )
    return f"the bso service at {redact_url(url)} (from {source}) is unreachable{why}; {fix}"
