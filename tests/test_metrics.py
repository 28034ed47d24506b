"""Prometheus metrics: the exporter's login, what it reads, and a live stack scraped.

The live test runs real worker processes (the multiprocess files are the point),
sends events through the real client, scrapes ``/metrics`` with the monitoring
login and checks the figures, and that every series the shipped Grafana
dashboard queries is there.
"""

from __future__ import annotations

import base64
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bso.core.vocabulary import StopReason, TrialPhase, TrialStatus
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire import keys
from bso.wire.events import EpochReport, NextTrial, RegisterJob, TrialAssigned
from bso_client.transport import ServiceClient
from bso_workers.metrics import EVENTS
from bso_workers.metrics_export import BsoCollector, fair_share, metrics_registry, with_login
from bso_workers.stack import Stack
from tests.fixtures.stacks import running_stack

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "bso-dashboard.json"
SPEC = JobSpec(
    job_id="metered",
    batch_sizes=[16, 32],
    default_batch_size=16,
    target_metric=0.9,
    max_epochs=3,
    mab_seed=1,
)


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return found[(name, frozenset(labels.items()))]


# -- the login --------------------------------------------------------------------------


def call(app: Any, authorization: str | None) -> tuple[str, bytes]:
    status: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics"}
    if authorization is not None:
        environ["HTTP_AUTHORIZATION"] = authorization
    body = b"".join(app(environ, lambda s, _headers: status.append(s)))
    return status[0], body


def test_only_the_monitoring_login_gets_the_metrics() -> None:
    app = with_login(lambda _e, start: (start("200 OK", []), [b"secret figures"])[1], "bso", "pw")
    good = "Basic " + base64.b64encode(b"bso:pw").decode()
    assert call(app, good) == ("200 OK", b"secret figures")
    # "Basic \xe9": a header WSGI decodes to non-ASCII text, which hmac.compare_digest
    # refused with a TypeError: a 500 and a traceback in the log for anyone, not a 401.
    for wrong in (
        None,
        "Basic " + base64.b64encode(b"bso:nope").decode(),
        "Bearer pw",
        "",
        "Basic \xe9",
        "Basic \xc3\xa9",
    ):
        status, body = call(app, wrong)
        assert status.startswith("401")
        assert b"secret" not in body


# -- what a scrape reads ----------------------------------------------------------------


def finished_service() -> BsoService:
    """Two jobs, one converged trial each; a third job with a running trial."""
    service = BsoService(MemoryStore())
    for job_id in ("a", "b", "c"):
        service.register(SPEC.model_copy(update={"job_id": job_id}))
        trial = service.next_trial(job_id)
        if job_id != "c":
            service.report_epoch(
                job_id, trial.trial_number, epoch=1, time_s=5, energy_j=9, metric=1
            )
    return service


def test_a_scrape_reads_the_queue_the_dead_letters_and_the_database() -> None:
    server = fakeredis.FakeServer()
    redis_client = fakeredis.FakeRedis(server=server)
    redis_client.lpush(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, "x", "y")
    redis_client.hset(keys.DEADLETTER_COUNTS_KEY, mapping={"bad_envelope": 3, "total": 3})
    service = finished_service()
    registry = metrics_registry(BsoCollector(redis_client, service.store, max_jobs=2), None)
    found = samples(generate_latest(registry).decode())
    assert value(found, "bso_queue_depth", queue=keys.EVENTS_QUEUE) == 2
    assert value(found, "bso_queue_depth", queue=keys.MAINTENANCE_QUEUE) == 0
    assert value(found, "bso_dead_letters_total", reason="bad_envelope") == 3
    assert ("bso_dead_letters_total", frozenset({("reason", "total")})) not in found
    assert value(found, "bso_trials", outcome="converged") == 2
    assert value(found, "bso_trials", outcome="running") == 1
    assert value(found, "bso_trial_stops", reason="target_reached") == 2
    series = {dict(labels)["job"] for name, labels in found if name == "bso_recommended_batch_size"}
    assert len(series) <= 2  # the cap
    assert value(found, "bso_recommendation_jobs_omitted") == 1
    assert value(found, "bso_exporter_source_up", source="redis") == 1
    assert value(found, "bso_exporter_source_up", source="database") == 1


def test_two_tenants_jobs_of_one_id_are_two_series() -> None:
    """Job ids are per tenant: each team's ``nightly`` is its own job and series."""
    service = BsoService(MemoryStore())
    for tenant, size in (("team-a", 16), ("team-b", 32)):
        spec = SPEC.model_copy(update={"job_id": "nightly", "default_batch_size": size})
        service.handle(RegisterJob(spec=spec), tenant)
        trial = service.handle(NextTrial(job_id="nightly"), tenant)
        assert isinstance(trial, TrialAssigned)
        assert trial.batch_size == size
        report = EpochReport(
            job_id="nightly", trial_number=1, epoch=1, time_s=5, energy_j=9, metric=1
        )
        service.handle(report, tenant)
    collector = BsoCollector(fakeredis.FakeRedis(), service.store, max_jobs=10)
    found = samples(generate_latest(metrics_registry(collector, None)).decode())
    for tenant, size in (("team-a", 16), ("team-b", 32)):
        labels = {"job": "nightly", "lane": SPEC.hardware.key, "tenant": tenant}
        assert value(found, "bso_recommended_batch_size", **labels) == size


def test_a_tenant_busy_with_many_jobs_leaves_the_others_their_series() -> None:
    """team-b keeps more jobs active than the cap (a heartbeat each keeps them the most
    recent): the series went to its jobs alone, and team-a's dashboards went blank."""
    service = BsoService(MemoryStore())
    clock = [datetime(2026, 12, 1, tzinfo=UTC)]
    service.clock = lambda: clock[0]
    for tenant, count in (("team-a", 2), ("team-b", 6)):
        for i in range(count):
            clock[0] += timedelta(seconds=1)
            spec = SPEC.model_copy(update={"job_id": f"job-{i}"})
            service.handle(RegisterJob(spec=spec), tenant)
            service.handle(NextTrial(job_id=f"job-{i}"), tenant)
            report = EpochReport(
                job_id=f"job-{i}", trial_number=1, epoch=1, time_s=5, energy_j=9, metric=1
            )
            service.handle(report, tenant)
    collector = BsoCollector(fakeredis.FakeRedis(), service.store, max_jobs=4)
    found = samples(generate_latest(metrics_registry(collector, None)).decode())
    series = {
        (dict(labels)["tenant"], dict(labels)["job"])
        for name, labels in found
        if name == "bso_recommended_batch_size"
    }
    assert series == {
        ("team-a", "job-1"),
        ("team-a", "job-0"),
        ("team-b", "job-5"),
        ("team-b", "job-4"),
    }
    assert value(found, "bso_recommendation_jobs_omitted") == 4


def test_fair_share_takes_turns_in_the_order_of_each_tenants_latest_job() -> None:
    keys_ = ["b/1", "b/2", "a-only", "b/3", "c/1", "a-two"]
    assert fair_share(keys_, 4) == ["b/1", "a-only", "c/1", "b/2"]
    assert fair_share(keys_, 10) == ["b/1", "a-only", "c/1", "b/2", "a-two", "b/3"]


@pytest.mark.parametrize("decoded", [False, True], ids=["bytes", "str"])
def test_a_scrape_shows_each_tenants_queue_and_its_refusals(decoded: bool) -> None:
    """With a plain client, and with the str-decoding one `bso metrics` builds."""
    redis_client = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=decoded)
    loud, quiet = keys.tenant_namespace("loud"), keys.tenant_namespace("quiet")
    redis_client.sadd(keys.TENANTS_KEY, "loud", "quiet", "not:a tenant")
    redis_client.lpush(loud.queue_key, *"abc")
    redis_client.hset(keys.TENANT_REFUSED_KEY, "loud", 1994)
    redis_client.set(keys.tenant_namespace("spoiled").queue_key, "not a list")
    redis_client.sadd(keys.TENANTS_KEY, "spoiled")
    registry = metrics_registry(BsoCollector(redis_client, finished_service().store), None)
    found = samples(generate_latest(registry).decode())
    assert value(found, "bso_tenant_queue_depth", tenant="loud") == 3
    assert value(found, "bso_tenant_refused_total", tenant="loud") == 1994
    assert value(found, "bso_tenant_queue_depth", tenant="quiet") == 0
    assert value(found, "bso_tenant_refused_total", tenant="quiet") == 0
    tenants = {dict(labels).get("tenant") for name, labels in found if "tenant" in name}
    assert tenants == {"loud", quiet.tenant, "spoiled"}
    assert ("bso_tenant_queue_depth", frozenset({("tenant", "spoiled")})) not in found
    assert value(found, "bso_exporter_source_up", source="redis") == 1


def test_a_source_that_cannot_be_read_does_not_fail_the_scrape() -> None:
    broken = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    broken.connection_pool.connection_kwargs["server"].connected = False
    registry = metrics_registry(BsoCollector(broken, finished_service().store), None)
    found = samples(generate_latest(registry).decode())
    assert value(found, "bso_exporter_source_up", source="redis") == 0
    assert value(found, "bso_trials", outcome="converged") == 2


def test_trials_are_counted_by_outcome_so_a_stop_by_bso_is_not_a_failure() -> None:
    """``bso_trials{status="failed"}`` used to count bso's own cost stops."""
    service = BsoService(MemoryStore())
    service.register(SPEC.model_copy(update={"job_id": "d"}))
    endings = [
        (1, StopReason.COST_BOUND),  # stopped by bso
        (0, StopReason.ABANDONED),  # raised before its first epoch: a script error
        (2, StopReason.ABANDONED),  # crashed after two epochs: a script error too
        (3, StopReason.DIVERGED),  # the metric went NaN: the size's failure
    ]
    with service.store.transaction("d") as tx:
        for epochs, reason in endings:
            trial = tx.add_trial("cpu x1", 8, TrialPhase.EXPLORATION, datetime.now(UTC))
            tx.save_trial(
                trial.replace(status=TrialStatus.FAILED, stop_reason=reason, epochs=epochs)
            )
    registry = metrics_registry(
        BsoCollector(fakeredis.FakeRedis(server=fakeredis.FakeServer()), service.store), None
    )
    found = samples(generate_latest(registry).decode())
    assert value(found, "bso_trials", outcome="stopped") == 1
    assert value(found, "bso_trials", outcome="script_error") == 2
    assert value(found, "bso_trials", outcome="failed") == 1
    assert value(found, "bso_trial_stops", reason="cost_bound") == 1


# -- a live stack -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        tmp_path_factory.mktemp("metrics") / "data", workers=2, metrics=True
    ) as running:
        yield running


def scrape(stack: Stack, login: str | None) -> str:
    assert stack.metrics_url is not None
    headers = {}
    if login is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(login.encode()).decode()
    request = urllib.request.Request(stack.metrics_url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.read().decode())


def monitoring_login(stack: Stack) -> str:
    assert stack.credentials_file is not None
    text = stack.credentials_file.read_text()
    password = re.search(r"^BSO_FLOWER_PASSWORD=(.+)$", text, re.M)
    assert password is not None
    return f"bso:{password.group(1).strip()}"


@pytest.mark.integration
def test_a_live_stack_counts_every_worker_process_and_serves_the_dashboards_series(
    stack: Stack,
) -> None:
    assert "metrics" in stack.describe()
    with pytest.raises(urllib.error.HTTPError) as refused:
        scrape(stack, None)
    assert refused.value.code == 401
    assert stack.client_url is not None
    client = ServiceClient.connect(stack.client_url, api_key=stack.api_key)
    try:
        client.register(SPEC)
        for _ in range(3):
            trial = client.next_trial("metered", Hardware())
            for epoch in (1, 2):
                client.report_epoch(
                    "metered",
                    trial.trial_number,
                    epoch=epoch,
                    time_s=epoch,
                    energy_j=epoch,
                    metric=0.95 if epoch == 2 else 0.1,
                )
    finally:
        client.close()
    worker_redis = redis.Redis.from_url(stack.settings.broker_url)
    try:  # garbage on the queue: a worker dead-letters it
        worker_redis.lpush(keys.BROKER_KEY_PREFIX + keys.EVENTS_QUEUE, b"not a message")
        deadline = time.monotonic() + 30
        while not worker_redis.hget(keys.DEADLETTER_COUNTS_KEY, "total"):
            assert time.monotonic() < deadline, "the garbage was never dead-lettered"
            time.sleep(0.1)
    finally:
        worker_redis.close()
    found = samples(scrape(stack, monitoring_login(stack)))
    dead = [v for (name, _), v in found.items() if name == "bso_dead_letters_total"]
    assert dead == [1]
    assert value(found, "bso_events_total", type="register", outcome="ok") == 1
    assert value(found, "bso_events_total", type="next_trial", outcome="ok") == 3
    assert value(found, "bso_events_total", type="epoch", outcome="ok") == 6
    assert value(found, "bso_event_handling_seconds_count", type="epoch") == 6
    assert value(found, "bso_event_queue_seconds_count", type="epoch") == 6
    assert value(found, "bso_trials", outcome="converged") == 3
    assert value(found, "bso_trial_stops", reason="target_reached") == 3
    recommended = value(
        found, "bso_recommended_batch_size", job="metered", lane="cpu x1", tenant="default"
    )
    assert recommended in (16, 32)
    workers = {p.name for p in stack.processes if p.name.startswith("worker")}
    files = list((stack.config.data_dir.resolve() / "metrics").glob("*.db"))
    assert len(workers) == 2
    assert files  # the workers' own processes wrote them
    names = {name for name, _ in found}
    queried = set(re.findall(r"bso_[a-z_]+", DASHBOARD.read_text()))
    missing = {q for q in queried if not any(n == q or n.startswith(q) for n in names)}
    assert missing == set()


def test_the_endpoint_never_runs_without_a_login(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bso.cli import main

    monkeypatch.delenv("BSO_METRICS_BASIC_AUTH", raising=False)
    assert main(["metrics", "--port", "0"]) == 2
    assert "set BSO_METRICS_BASIC_AUTH=user:password" in capsys.readouterr().err


def test_the_event_counters_help_names_every_type_the_workers_record() -> None:
    """The HELP line Prometheus and Grafana show lists the ``type`` label's values: every
    event kind and every other type the task shell records (it once missed five)."""
    source = (Path(__file__).parent.parent / "workers/bso_workers/tasks.py").read_text()
    recorded = set(re.findall(r'observe_event\(\s*"(\w+)"', source)) | set(keys.TASK_FOR_KIND)
    assert {"status", "list_jobs", "invalid", "refused"} <= recorded
    documentation = EVENTS.describe()[0].documentation
    assert [kind for kind in sorted(recorded) if kind not in documentation] == []
