"""``rediss://`` verifies the server's certificate, in the client and in the workers.

A real TLS Redis (the system's Redis 7, which has TLS built in) with a
self-signed certificate: nothing connects to it unless told to trust it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bso.errors import ServiceUnavailable
from bso.spec import JobSpec
from bso.wire.connection import BrokerUnreachable
from bso_client.transport import ServiceClient
from bso_workers.celery_app import create_app
from bso_workers.settings import WorkerSettings
from bso_workers.supervision import ManagedProcess, free_port, spawn, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("openssl") is None,
        reason="needs the system redis-server (with TLS) and openssl",
    ),
]

SPEC = JobSpec(job_id="tls", batch_sizes=[8, 16], default_batch_size=16, target_metric=1)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    server: ManagedProcess = spawn(
        "redis-tls",
        ["redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
         "--tls-key-file", str(key), "--tls-auth-clients", "no", "--save", "",
         "--dir", str(folder)],
        folder / "logs", dict(os.environ), folder,
    )  # fmt: skip
    trusting = redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")

    def answers() -> bool:
        try:
            return bool(trusting.ping())
        except redis.RedisError:
            return False

    try:
        wait_until(answers, "TLS redis", 30, [server])
        yield port, cert
    finally:
        trusting.close()
        server.stop()


def test_the_client_refuses_an_unverified_server_at_once(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    started = time.monotonic()
    with (
        ServiceClient.connect(f"rediss://127.0.0.1:{port}/0", outage_window_s=600) as client,
        pytest.raises(ServiceUnavailable, match="certificate") as caught,
    ):
        client.register(SPEC)
    assert not isinstance(caught.value, BrokerUnreachable)  # not waited out as an outage
    assert time.monotonic() - started < 10


def test_the_client_trusts_a_ca_it_is_given(tls_redis: tuple[int, Path]) -> None:
    port, cert = tls_redis
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
    finally:
        client.close()


def test_workers_refuse_an_unverified_server(tls_redis: tuple[int, Path]) -> None:
    port, _ = tls_redis
    app = create_app(WorkerSettings(_env_file=None, broker_url=f"rediss://127.0.0.1:{port}/0"))
    try:
        with pytest.raises(Exception, match="CERTIFICATE_VERIFY_FAILED"), app.connection() as conn:
            conn.ensure_connection(max_retries=1)
    finally:
        app.close()
