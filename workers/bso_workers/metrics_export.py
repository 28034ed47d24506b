"""The Prometheus endpoint: the workers' counters, plus what is read where it is kept.

One exporter per deployment (``bso metrics``; ``bso up`` starts it, compose
runs it as a service) serves ``/metrics`` behind the monitoring login (the same
user and password as Flower's).  A scrape gathers:

* the workers' own metrics (:mod:`bso_workers.metrics`), summed over every
  worker process from the multiprocess files;
* from Redis: the depth of each queue and the dead letters by reason (the
  ``bso:deadletters:counts`` hash the workers keep);
* from the database: trials by status, stops by reason, and for each of the
  :data:`DEFAULT_MAX_JOBS` most recently active jobs (shared out among the
  tenants, :func:`fair_share`) and each of its hardware lanes, the recommended
  batch size, its confidence and its gain over the default.  That cap bounds
  the cardinality (a job x lane is a series; a platform with thousands of jobs
  must not make Prometheus hold thousands of series per metric);
  ``bso_recommendation_jobs_omitted`` says how many jobs it left out.

Database reads are cached for :data:`DEFAULT_CACHE_S`: scrapes (every 15 s,
from several Prometheus replicas) never queue behind events.  A source that
cannot be read is reported as ``bso_exporter_source_up{source=...} 0`` rather
than failing the whole scrape.
"""

from __future__ import annotations

import base64
import hmac
import itertools
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, Final
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, make_wsgi_app, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bso.apikeys import split_job_key
from bso.core.outcomes import outcome_from
from bso.errors import UnknownJob
from bso.service import BsoService
from bso.spec import MAX_SQL_INT
from bso.status import LaneStatus
from bso.storage.base import Store
from bso.wire import keys
from bso_workers.tenant_queues import tenant_names

log = logging.getLogger("bso.metrics")

LOGIN_ENV: Final = "BSO_METRICS_BASIC_AUTH"
"""``user:password`` of the endpoint: passed in the environment, never on a command line."""
DEFAULT_MAX_JOBS: Final = 50
"""Jobs whose recommendations are exported: the most recently active ones, shared
out among the tenants (:func:`fair_share`)."""
DEFAULT_CACHE_S: Final = 15.0
"""How long one read of the database serves scrapes."""
QUEUES: Final = (keys.EVENTS_QUEUE, keys.MAINTENANCE_QUEUE)


@dataclass(frozen=True)
class _DatabaseFigures:
    tallies: dict[tuple[str, str | None], int]
    """Trials per (outcome, stop reason)."""
    lanes: list[tuple[str, str, LaneStatus]]
    """(job id, tenant, lane) of the most recently active jobs."""
    omitted: int


def fair_share(job_keys: list[str], limit: int) -> list[str]:
    """At most ``limit`` of ``job_keys`` (most recently active first), taken in turns
    from each tenant: every tenant's most recent job, then every tenant's second...,
    tenants in the order of their most recent job.

    Not simply the first ``limit``: a team keeping that many jobs busy (a heartbeat
    each every few seconds, well within its admission rate) pushed every other
    team's recommendations out of the metrics, and their dashboards went blank.
    """
    per_tenant: dict[str, list[str]] = {}
    for key in job_keys:
        per_tenant.setdefault(split_job_key(key)[0], []).append(key)
    turns = itertools.zip_longest(*per_tenant.values())
    return [key for turn in turns for key in turn if key is not None][:limit]


def _text(field: object) -> str:
    """A hash field as text: `bso metrics` reads Redis with decode_responses
    (bso.wire.connection), which gives str; a plain client gives bytes."""
    return field.decode() if isinstance(field, bytes) else str(field)


class BsoCollector(Collector):
    """What a scrape reads from Redis and the database; see the module docstring."""

    def __init__(
        self,
        redis_client: redis.Redis,
        store: Store,
        *,
        max_jobs: int = DEFAULT_MAX_JOBS,
        cache_s: float = DEFAULT_CACHE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis_client
        self.service = BsoService(store)
        self.max_jobs = max_jobs
        self.cache_s = cache_s
        self.clock = clock
        self._cached: tuple[float, _DatabaseFigures] | None = None
        self._lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "bso_exporter_source_up", "Whether the last scrape could read it", labels=["source"]
        )
        try:
            yield from self._from_redis()
            up.add_metric(["redis"], 1)
        except redis.RedisError as exc:
            log.warning("metrics: cannot read Redis (%s)", type(exc).__name__)
            up.add_metric(["redis"], 0)
        try:
            yield from self._from_database(self._database_figures())
            up.add_metric(["database"], 1)
        except Exception as exc:  # a database down must not fail the scrape
            log.warning("metrics: cannot read the database (%s)", type(exc).__name__)
            up.add_metric(["database"], 0)
        yield up

    def _from_redis(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily(
            "bso_queue_depth", "Events waiting in each queue", labels=["queue"]
        )
        with self.redis.pipeline(transaction=False) as pipe:
            for queue in QUEUES:
                pipe.llen(keys.BROKER_KEY_PREFIX + queue)
            pipe.hgetall(keys.DEADLETTER_COUNTS_KEY)
            *lengths, counts = pipe.execute()
        for queue, length in zip(QUEUES, lengths, strict=True):
            depth.add_metric([queue], float(length))
        dead = CounterMetricFamily(
            "bso_dead_letters",
            "Queue items the workers refused unread, by reason (bso deadletters shows them)",
            labels=["reason"],
        )
        for reason, count in sorted(counts.items()):
            name = _text(reason)
            if name != "total":
                dead.add_metric([name], float(count))
        return [depth, dead, *self._tenants()]

    def _tenants(self) -> list[Metric]:
        """Per tenant served (:data:`bso.wire.keys.TENANTS_KEY`): its queue's depth and
        the events refused at its door or past its bound (:mod:`bso.wire.admission`)."""
        depth = GaugeMetricFamily(
            "bso_tenant_queue_depth", "Events waiting in each tenant's queue", labels=["tenant"]
        )
        refused = CounterMetricFamily(
            "bso_tenant_refused",
            "Events refused unapplied: at the tenant's door (queue full or rate spent) or "
            "past its queue's bound",
            labels=["tenant"],
        )
        tenants = sorted(tenant_names(self.redis.smembers(keys.TENANTS_KEY)))
        counted = {
            _text(field): count
            for field, count in self.redis.hgetall(keys.TENANT_REFUSED_KEY).items()
        }
        with self.redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.llen(keys.tenant_namespace(tenant).queue_key)
            lengths = pipe.execute(raise_on_error=False)
        for tenant, length in zip(tenants, lengths, strict=True):
            if not isinstance(length, Exception):  # a queue key a tenant spoiled: no figure
                depth.add_metric([tenant], float(length))
            refused.add_metric([tenant], float(counted.get(tenant, 0)))
        return [depth, refused]

    def _database_figures(self) -> _DatabaseFigures:
        with self._lock:
            now = self.clock()
            if self._cached is not None and now - self._cached[0] < self.cache_s:
                return self._cached[1]
            store = self.service.store
            tallies = {
                (outcome_from(status, reason).value, reason.value if reason else None): n
                for (status, reason), n in store.trial_tallies().items()
            }
            active = store.recently_active_jobs(MAX_SQL_INT)
            lanes: list[tuple[str, str, LaneStatus]] = []
            for key in fair_share(active, self.max_jobs):
                tenant, job_id = split_job_key(key)
                try:
                    status = self.service.status(job_id, tenant)
                except UnknownJob:  # deleted since the list was read
                    continue
                lanes.extend((job_id, tenant, lane) for lane in status.lanes)
            figures = _DatabaseFigures(tallies, lanes, max(len(active) - self.max_jobs, 0))
            self._cached = (now, figures)
            return figures

    @staticmethod
    def _from_database(figures: _DatabaseFigures) -> Iterable[Metric]:
        trials = GaugeMetricFamily(
            "bso_trials",
            "Trials in the database, by outcome (as bso status names them: a stop by bso's "
            "cost rules is 'stopped', never 'failed')",
            labels=["outcome"],
        )
        stops = GaugeMetricFamily(
            "bso_trial_stops",
            "Trials that ended, by the reason they stopped (target reached, cost bound, ...)",
            labels=["reason"],
        )
        by_outcome: dict[str, int] = {}
        by_reason: dict[str, int] = {}
        for (outcome, reason), count in figures.tallies.items():
            by_outcome[outcome] = by_outcome.get(outcome, 0) + count
            if reason is not None:
                by_reason[reason] = by_reason.get(reason, 0) + count
        for outcome, count in sorted(by_outcome.items()):
            trials.add_metric([outcome], float(count))
        for reason, count in sorted(by_reason.items()):
            stops.add_metric([reason], float(count))
        labels = ["job", "lane", "tenant"]
        size = GaugeMetricFamily(
            "bso_recommended_batch_size", "The lane's recommended batch size", labels=labels
        )
        confidence = GaugeMetricFamily(
            "bso_recommendation_confidence",
            "Posterior probability (0-1) that the recommended size is the lane's cheapest",
            labels=labels,
        )
        gain = GaugeMetricFamily(
            "bso_recommendation_gain",
            "Expected cost of the default batch size over the recommendation's",
            labels=labels,
        )
        for job_id, tenant, lane in figures.lanes:
            series = [job_id, lane.hardware.key, tenant]
            if lane.recommended_batch_size is not None:
                size.add_metric(series, float(lane.recommended_batch_size))
            if lane.confidence is not None:
                confidence.add_metric(series, lane.confidence / 100)
            if lane.gain_over_default is not None:
                gain.add_metric(series, lane.gain_over_default)
        omitted = GaugeMetricFamily(
            "bso_recommendation_jobs_omitted",
            f"Jobs left out of the recommendation series (the cap keeps the most recently "
            f"active {DEFAULT_MAX_JOBS} by default)",
            value=float(figures.omitted),
        )
        return [trials, stops, size, confidence, gain, omitted]


def metrics_registry(collector: BsoCollector, multiproc_dir: str | None) -> CollectorRegistry:
    """A registry with the workers' summed metrics (when a directory is given) and the
    collector's."""
    registry = CollectorRegistry()
    if multiproc_dir:
        multiprocess.MultiProcessCollector(registry, path=multiproc_dir)  # type: ignore[no-untyped-call]
    registry.register(collector)
    return registry


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def with_login(app: WsgiApp, user: str, password: str) -> WsgiApp:
    """``app`` behind HTTP basic authentication (compared in constant time); a request
    without the right login gets 401 and nothing else."""
    expected = base64.b64encode(f"{user}:{password}".encode())

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "")
        scheme, _, token = given.partition(" ")
        # As bytes: compare_digest refuses str with non-ASCII characters (a TypeError, a 500).
        offered = token.strip().encode("utf-8", "surrogateescape")
        if scheme.lower() == "basic" and hmac.compare_digest(offered, expected):
            return app(environ, start_response)
        start_response(
            "401 Unauthorized",
            [("WWW-Authenticate", 'Basic realm="bso metrics"'), ("Content-Type", "text/plain")],
        )
        return [b"bso metrics: log in with the monitoring user\n"]

    return guarded


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log per scrape (every 15 s, forever)."""


def serve(
    registry: CollectorRegistry, host: str, port: int, user: str, password: str
) -> WSGIServer:
    """The HTTP server of ``/metrics`` (not yet serving: call ``serve_forever``)."""
    app = with_login(make_wsgi_app(registry), user, password)
    return make_server(host, port, app, _ThreadingServer, handler_class=_QuietHandler)


def metrics_dir_of(data_dir: Path) -> Path:
    return data_dir / "metrics"


def fresh_metrics_dir(data_dir: Path) -> Path:
    """The workers' metrics folder, emptied: counters start from zero with the stack
    (files of processes from an earlier run would add their counts forever)."""
    folder = metrics_dir_of(data_dir)
    folder.mkdir(exist_ok=True)
    for leftover in folder.glob("*.db"):
        leftover.unlink()
    return folder


def metrics_answer(url: str) -> bool:
    """Whether ``url`` is served by the exporter: it refuses an anonymous request.  (A
    logged-in scrape would read the database and fill its cache before any caller
    has a say.)"""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return False  # served without a login: not ours
    except urllib.error.HTTPError as exc:
        return exc.code == HTTPStatus.UNAUTHORIZED
    except (urllib.error.URLError, OSError):
        return False
