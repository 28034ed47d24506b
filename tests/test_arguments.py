"""bso.commands.arguments: what a command line may name, refused as a usage error."""

from __future__ import annotations

import argparse

import pytest

from bso.cli import main
from bso.commands.arguments import job_id, job_or_tenant_job, positive_int


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
