"""Rank 0's connection to the service: the client, its calls and its fail-open state,
set up once per optimizer before anything is asked of the service.

Kept apart from :mod:`bso_client.detachment`, which holds what happens once the
service fails; this module decides how long a call may take for that to work.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from bso.apikeys import DEFAULT_TENANT
from bso.wire.connection import redact_url
from bso_client.detached_journal import owners_delivered
from bso_client.detachment import Detachment
from bso_client.fail_open import DEADLINE_SHARE, SOCKET_SHARE, GuardedService
from bso_client.service_calls import BsoServiceLike, JobCalls

if TYPE_CHECKING:
    from bso_client.transport import ServiceClient


def no_service_given(broker_url: str | None) -> str:
    """What a BatchSizeOptimizer given neither or both of ``broker_url`` and ``service``
    says: a script that forgot ``bso up`` or its credentials has no ``BSO_BROKER_URL``
    in its environment, and passes ``os.environ.get("BSO_BROKER_URL")`` or nothing."""
    if broker_url is not None:
        return "give exactly one of broker_url and service, not both"
    return (
        "no broker_url (None), and BSO_BROKER_URL is not set in this process's environment: "
        "pass the Redis URL `bso up` printed, or your team file's; `bso up` keeps it in "
        "<data dir>/credentials.env as BSO_BROKER_URL, which "
        "`set -a; . .bso/credentials.env; set +a` exports (is bso up running, and was the "
        "file sourced in the shell that started this script?); or service= for an "
        "in-process BsoService"
    )


def chosen_broker_url(
    broker_url: str | None, service: BsoServiceLike | None, environ: Mapping[str, str] | None
) -> str | None:
    """The URL a BatchSizeOptimizer connects to: ``broker_url``, else (without
    ``service``) ``BSO_BROKER_URL`` from ``environ`` (None: the process's), as the
    API key comes from ``BSO_API_KEY``; None with ``service``.  A ``ValueError`` for
    neither or both: a setup mistake, which no later run could fix by itself."""
    if broker_url is None and service is None:  # then it connects: the transport loads anyway
        from bso_client.transport import BROKER_URL_ENV

        broker_url = (os.environ if environ is None else environ).get(BROKER_URL_ENV) or None
    if (broker_url is None) == (service is None):
        raise ValueError(no_service_given(broker_url))
    return broker_url


def rank_zero_calls(
    broker_url: str | None,
    service: BsoServiceLike | None,
    *,
    rank: int,
    fail_open: bool,
    bound_s: float,
    lease_s: float | None,
    reprobe_memory: bool,
    transport: dict[str, Any],
) -> tuple[ServiceClient | None, JobCalls | None, Detachment]:
    """Rank 0's client (when it connects to ``broker_url``), its calls, and its
    fail-open state; the other ranks get (None, None, a detachment without a guard).

    With ``fail_open``, a call gets :data:`~bso_client.fail_open.DEADLINE_SHARE` of
    ``bound_s`` (the transport's ``call_deadline_s``) and a socket operation (connect,
    read) the rest (:data:`~bso_client.fail_open.SOCKET_SHARE`): the deadline is
    checked between operations, so one that began just before it (a host that drops
    packets) still ends within the bound.  ``transport``: the optimizer's timeout,
    retry and outage settings.
    """
    if rank != 0:
        return None, None, Detachment(None, bound_s, None)
    client = None
    owners: tuple[str, ...] = (DEFAULT_TENANT,)
    if service is None:
        from bso_client.transport import API_KEY_ENV, ServiceClient

        assert broker_url is not None
        owners = owners_delivered(broker_url, transport["api_key"] or os.environ.get(API_KEY_ENV))
        settings = dict(transport)
        if fail_open:
            socket_s = bound_s * SOCKET_SHARE
            settings["connect_timeout_s"] = min(settings["connect_timeout_s"], socket_s)
            settings["call_deadline_s"] = bound_s * DEADLINE_SHARE
        client = ServiceClient.connect(broker_url, **settings)
        service = client
    guard = None
    if fail_open:
        address = redact_url(broker_url) if broker_url else "the in-process bso service"
        service = guard = GuardedService(service, address)
    calls = JobCalls(service, lease_s=lease_s, reprobe_memory=reprobe_memory)
    return client, calls, Detachment(guard, bound_s, client, owners[0], owners)
