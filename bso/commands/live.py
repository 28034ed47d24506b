"""Reaching the live service from a command, as a training client does: the client URL
and the tenant's API key, over Redis, so the service checks the key on every call.

Where they come from: ``--broker-url`` / ``--api-key``, else ``$BSO_BROKER_URL`` /
``$BSO_API_KEY``, else the credentials ``bso up`` saved in its ``--data-dir``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from bso.commands.failures import UserError
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


def connect(args: argparse.Namespace) -> ServiceClient:
    """A client of the service ``args`` name; it fails at once when the broker is down
    (no outage window: a command's user is there to read the error)."""
    saved_path = Path(args.data_dir) / CREDENTIALS_FILE
    saved = read_env_file(saved_path) if saved_path.exists() else {}
    url = args.broker_url or os.environ.get("BSO_BROKER_URL") or saved.get("BSO_BROKER_URL")
    key = args.api_key or os.environ.get(API_KEY_ENV) or saved.get(API_KEY_ENV)
    if not url:
        raise UserError(
            "no service to ask: give --broker-url (what bso up prints), or run it where "
            "bso up's --data-dir is"
        )
    return ServiceClient.connect(url, api_key=key, outage_window_s=0)
