"""bso.commands.arguments: what a command line may name, refused as a usage error."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bso.cli import main
from bso.commands.arguments import job_id, job_or_tenant_job, port_number, positive_int


def test_a_job_id_passes_and_a_tenants_job_is_explained() -> None:
    assert job_id("nightly") == "nightly"
    with pytest.raises(argparse.ArgumentTypeError, match=r"its own jobs by their id alone"):
        job_id("team-a/nightly")
    with pytest.raises(argparse.ArgumentTypeError, match=r"not a job id: a job id must be"):
        job_id("bad id!")


def test_where_every_tenants_jobs_may_be_read_tenant_job_passes() -> None:
    assert job_or_tenant_job("nightly") == "nightly"
    assert job_or_tenant_job("team-a/nightly") == "team-a/nightly"
    for bad in ("a/b/c", "/nightly", "team a/nightly", "bad id!"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"^not a job: "):
            job_or_tenant_job(bad)


def test_positive_int() -> None:
    assert positive_int("3") == 3
    for bad in ("0", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_port_number() -> None:
    assert (port_number("0"), port_number("65535")) == (0, 65535)
    for bad in ("-1", "65536", "http"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["up", "--workers", "0"], "argument --workers: must be at least 1, got 0"),
        (["demo", "--workers", "-3"], "argument --workers: must be at least 1, got -3"),
        (["up", "--pool", "prefork", "--concurrency", "0"], "--concurrency: must be at least 1"),
        (["up", "--redis-port", "99999"], "--redis-port: a port is 0 (any free one) to 65535"),
        (["up", "--metrics-port", "-5"], "--metrics-port: a port is 0 (any free one) to 65535"),
        (["metrics", "--port", "70000"], "--port: a port is 0 (any free one) to 65535"),
        (["metrics", "--max-jobs", "-1"], "argument --max-jobs: must be at least 0, got -1"),
        (["deadletters", "--limit", "-1"], "argument --limit: must be at least 0, got -1"),
    ],
)
def test_a_service_of_no_workers_or_an_impossible_port_is_refused_before_it_starts(
    argv: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bso up --workers 0 (or -3) printed 'bso is up' with an empty workers line and
    served nobody; --concurrency 0 is Celery's 'one per CPU' under a line saying 0;
    a port past 65535 was 'internal error (OverflowError ...)' once Redis was up."""
    data_dir = tmp_path / "data"
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--data-dir", str(data_dir)] if argv[0] in ("up", "demo") else argv)
    assert exited.value.code == 2
    assert said in capsys.readouterr().err
    assert not data_dir.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["jobs", "reset", "team-b/nightly"], "a team names its own jobs by their id alone"),
        (["jobs", "delete", "bad id!"], "not a job id"),
        (["status", "bad id!"], "not a job:"),
        (["status", "team-a/nightly"], "names a job with its tenant, which only --database-url"),
    ],
)
def test_a_malformed_job_is_a_mistake_to_fix_not_a_bug_in_bso(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 and one line saying why, before anything connects (the broker URL is
    unreachable on purpose)."""
    try:
        status = main([*argv, "--broker-url", "redis://127.0.0.1:1/0"])
    except SystemExit as exc:  # argparse's usage error
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert said in err
    assert "bug in bso" not in err
