"""``bso jobs`` as a user runs it, against real Redis and a real Celery worker: list,
reset, set-sizes and delete, each through the service with the tenant's API key."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bso.cli import main
from bso.errors import ConfigMismatch, NoFeasibleBatchSize
from bso.spec import Hardware, JobSpec
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade
from bso_client.transport import ServiceClient
from bso_workers.tenant_keys import create_key
from tests.fixtures.celery_workers import WorkerCluster

pytestmark = pytest.mark.integration

GPU = Hardware(gpu_model="Tesla T4", gpu_count=1, max_power_w=70.0)


@pytest.fixture(scope="module")
def cluster(
    worker_cluster_factory: Callable[..., WorkerCluster], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerCluster, str]]:
    """One worker on SQLite, and a second tenant's key."""
    url = f"sqlite:///{tmp_path_factory.mktemp('jobs') / 'bso.sqlite3'}"
    upgrade(url)
    cluster = worker_cluster_factory(url)
    store = SqlStore(url)
    try:
        other_key = create_key(store, "team-b")
    finally:
        store.close()
    yield cluster, other_key
    cluster.stop()


def bso(cluster: WorkerCluster, *argv: str, key: str | None = None) -> list[str]:
    return [
        "jobs",
        *argv,
        "--broker-url",
        cluster.settings.broker_url,
        "--api-key",
        key or cluster.api_key,
    ]


def exhaust(client: ServiceClient, job_id: str) -> None:
    """Run the job until no size is feasible: every run misses the target."""
    client.register(
        JobSpec(
            job_id=job_id,
            batch_sizes=[32, 64],
            default_batch_size=32,
            target_metric=0.9,
            max_epochs=2,
            hardware=GPU,
        )
    )
    for _ in range(10):
        try:
            trial = client.next_trial(job_id)
        except NoFeasibleBatchSize:
            return
        for epoch in (1, 2):
            client.report_epoch(
                job_id, trial.trial_number, epoch=epoch, time_s=epoch, energy_j=epoch, metric=0.0
            )
    raise AssertionError("the job never ran out of sizes")


def test_a_user_gets_a_job_out_of_a_dead_end(
    cluster: tuple[WorkerCluster, str], capsys: pytest.CaptureFixture[str]
) -> None:
    workers, other_key = cluster
    client = workers.client()
    exhaust(client, "stuck")
    with pytest.raises(NoFeasibleBatchSize, match="bso jobs reset stuck"):
        client.next_trial("stuck")

    assert main(bso(workers, "list")) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["job", "trials", "running"]
    assert row.split()[0] == "stuck"
    assert GPU.key in row

    # Another tenant neither sees the job nor may reset it.
    assert main(bso(workers, "list", "--json", key=other_key)) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(bso(workers, "reset", "stuck", key=other_key)) == 2
    said = "bso jobs: there is no job 'stuck'; bso jobs list shows the jobs\n"
    assert capsys.readouterr().err == said  # as delete says it (test_delete)
    assert (
        main(
            bso(
                workers,
                "set-sizes",
                "stuck",
                "--lane",
                GPU.key,
                "--batch-sizes",
                "8",
                key=other_key,
            )
        )
        == 2
    )
    assert capsys.readouterr().err == said

    assert main(bso(workers, "reset", "stuck")) == 0
    assert "finished trial(s) forgotten" in capsys.readouterr().out
    assert client.next_trial("stuck").batch_size in (32, 64)


def test_a_user_gives_a_lane_new_sizes_as_config_mismatch_says(
    cluster: tuple[WorkerCluster, str], capsys: pytest.CaptureFixture[str]
) -> None:
    workers, _ = cluster
    client = workers.client()
    exhaust(client, "resized")
    changed = JobSpec(
        job_id="resized",
        batch_sizes=[64, 128, 256],
        default_batch_size=64,
        target_metric=0.9,
        max_epochs=2,
        hardware=GPU,
    )
    with pytest.raises(ConfigMismatch) as refused:
        client.register(changed)
    argv = ["--lane", GPU.key, "--batch-sizes", "64,128,256", "--default", "64"]
    named = f"bso jobs set-sizes resized --lane '{GPU.key}' --batch-sizes 64,128,256 --default 64"
    assert named in refused.value.message  # the command run below, as the user copies it
    assert main(bso(workers, "set-sizes", "resized", *argv)) == 0
    out = capsys.readouterr().out
    assert "batch sizes [64, 128, 256] (default 64)" in out
    assert client.register(changed).plan is None
    assert client.next_trial("resized").batch_size in (128, 256, 64)

    assert main(bso(workers, "set-sizes", "resized", "--lane", "TPU x1", "--batch-sizes", "8")) == 2
    assert "has no lane 'TPU x1'" in capsys.readouterr().err


def test_delete(cluster: tuple[WorkerCluster, str], capsys: pytest.CaptureFixture[str]) -> None:
    workers, _ = cluster
    client = workers.client()
    client.register(JobSpec(job_id="gone", batch_sizes=[8], default_batch_size=8, target_metric=1))
    assert main(bso(workers, "delete", "gone")) == 0
    assert capsys.readouterr().out.strip() == "job gone deleted"
    assert main(bso(workers, "delete", "gone")) == 2
    assert (
        capsys.readouterr().err
        == "bso jobs: there is no job 'gone'; bso jobs list shows the jobs\n"
    )
    assert client.register(
        JobSpec(job_id="gone", batch_sizes=[8], default_batch_size=8, target_metric=1)
    ).created


def test_a_job_list_needs_a_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``bso up`` never ran, or ran with another --data-dir: the line names the folder it
    looked in and the fix, not only --broker-url."""
    assert main(["jobs", "list", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no credentials.env in {tmp_path}, where bso up writes its URL and key" in err
    assert "give this command the same --data-dir" in err
    assert "--broker-url" in err


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--batch-sizes", "-16,32", "-16 is not a batch size: 1 to 4194304"),
        ("--batch-sizes", "0,32", "0 is not a batch size: 1 to 4194304"),
        ("--batch-sizes", "16,8388608", "8388608 is not a batch size: 1 to 4194304"),
        ("--default", "0", "0 is not a batch size: 1 to 4194304"),
    ],
)
def test_sizes_no_lane_can_have_are_refused_before_the_service_is_asked(
    option: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A negative size reached the event's model and was "internal error (ValidationError
    ...); this is a bug in bso", exit 1: a typo is the user's to fix (exit 2, the rule)."""
    argv = ["jobs", "set-sizes", "job", "--lane", "cpu x1", "--batch-sizes", "16,32"]
    argv += [f"{option}={value}", "--broker-url", "redis://127.0.0.1:1/0", "--api-key", "k"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    assert "internal error" not in err
