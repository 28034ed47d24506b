"""``bso status``: a job's recommendation, confidence, gain and outcomes, from a database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bso.cli import main
from bso.core.vocabulary import StopReason
from bso.replay.simulate import make_world, run_recurrence
from bso.replay.workloads import synthetic_workloads
from bso.service import BsoService
from bso.storage.sql import SqlStore
from bso.storage.sql.engine import upgrade


@pytest.fixture(scope="module")
def database_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A job with six recurrences and one trial ended out of memory."""
    url = f"sqlite:///{tmp_path_factory.mktemp('status') / 'bso.sqlite3'}"
    upgrade(url)
    store = SqlStore(url)
    service = BsoService(store)
    workload = synthetic_workloads()[1]
    service.register(workload.job_spec(job_id="lang", seed=1))
    world = make_world(workload, 6, seed=1)
    for index, attempts in enumerate(world.draws):
        run_recurrence(
            service, workload=workload, job_id="lang", index=index, attempts=attempts, eta_knob=0.5
        )
    oom = service.next_trial("lang", workload.hardware)
    service.end_trial("lang", oom.trial_number, reason=StopReason.OUT_OF_MEMORY)
    store.close()
    return url


def test_text(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--database-url", database_url]) == 0
    out = capsys.readouterr().out
    first, header, *rows = out.splitlines()
    assert first.startswith("bso-status job=lang ")
    for field in ("recommended=", "confidence=", "gain=", "sizes="):
        assert field in first
    assert "out_of_me" in header
    assert any(line.strip().startswith("out of memory from batch size") for line in rows)


def test_json_matches_the_service(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "lang", "--database-url", database_url, "--json"]) == 0
    (document,) = json.loads(capsys.readouterr().out)
    store = SqlStore(database_url)
    try:
        assert document == BsoService(store).status("lang").model_dump(mode="json")
    finally:
        store.close()
    (lane,) = document["lanes"]
    oom_size = lane["history"][-1]["batch_size"]
    assert lane["memory_limit"] == oom_size
    # The recommendation is among the sizes that still fit, or there is none.
    if lane["recommended_batch_size"] is None:
        assert lane["confidence"] is None
    else:
        assert lane["recommended_batch_size"] < oom_size
        assert 0 <= lane["confidence"] <= 100
    assert sum(s["outcomes"].get("out_of_memory", 0) for s in lane["sizes"]) == 1
    assert lane["history"][-1]["outcome"] == "out_of_memory"


def test_plot(database_url: str, tmp_path: Path) -> None:
    path = tmp_path / "status.png"
    assert main(["status", "--database-url", database_url, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_job_is_an_error(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "nope", "--database-url", database_url]) == 2
    assert "'nope' is not in" in capsys.readouterr().err


def test_a_live_read_needs_a_service_and_a_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BSO_BROKER_URL", raising=False)
    assert main(["status", "lang", "--data-dir", str(tmp_path)]) == 2
    assert "--broker-url" in capsys.readouterr().err
    assert main(["status", "--broker-url", "redis://127.0.0.1:1/0"]) == 2
    assert "name a job" in capsys.readouterr().err
