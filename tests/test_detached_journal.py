"""The journal of a detached run on disk (bso_client.detached_journal)."""

from __future__ import annotations

import hashlib
import json
import logging
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bso.apikeys import DEFAULT_TENANT
from bso.core.vocabulary import StopReason, TrialStatus
from bso.errors import InvalidEvent, ServiceUnavailable
from bso.service import BsoService
from bso.spec import Hardware, JobSpec
from bso.storage.memory import MemoryStore
from bso.wire.events import DeliverDetachedRun, DetachedEpoch, DetachedRunDelivered
from bso_client.detached_journal import (
    DetachedJournal,
    deliver,
    job_folder,
    local_owner,
    lock_path,
    owners_delivered,
    pending_journals,
)
from bso_client.detachment import Detachment
from bso_client.fail_open import GuardedService
from bso_client.last_recommendation import recall, remember
from tests.test_fail_open import Switch, make, train

EPOCH = DetachedEpoch(epoch=1, time_s=1.0, energy_j=2.0, metric=0.5)


def start(job_id: str = "job", root: Path | None = None) -> DetachedJournal:
    return DetachedJournal.start(
        job_id=job_id, hardware=Hardware(), batch_size=16, trial_number=3, epochs=[], root=root
    )


def test_a_journal_is_written_whole_and_read_back(tmp_path: Path) -> None:
    journal = start(root=tmp_path)
    journal.record(EPOCH)
    journal.end(StopReason.OUT_OF_MEMORY)
    names = sorted(p.name for p in journal.path.parent.iterdir())
    assert names == sorted([journal.path.name, lock_path(journal.path).name])  # no temp
    loaded = DetachedJournal.load(journal.path)
    assert loaded is not None
    assert loaded.run == journal.run
    assert loaded.ended
    assert loaded.run.end_reason is StopReason.OUT_OF_MEMORY
    assert loaded.run.event_id == journal.path.stem


@pytest.mark.parametrize("job_id", ["..", "a/b", "x:y", "job"])
def test_every_job_id_gets_a_folder_of_its_own_inside_the_cache(
    tmp_path: Path, job_id: str
) -> None:
    folder = job_folder(job_id, tmp_path)
    assert folder.parent == tmp_path / "detached"
    assert folder != job_folder(job_id + "_", tmp_path)


def test_unreadable_journals_and_other_hosts_journals_are_not_pending(tmp_path: Path) -> None:
    mine = start(root=tmp_path).end(StopReason.ABANDONED)
    (mine.path.parent / "garbage.json").write_text("{not json")
    elsewhere = start(root=tmp_path)
    document = json.loads(elsewhere.path.read_text())
    document["host"] = "another-machine"
    document["pid"] = 1
    elsewhere.path.write_text(json.dumps(document))
    assert [j.path for j in pending_journals("job", tmp_path)] == [mine.path]


def test_delivery_removes_the_journal_only_once_the_service_answered(tmp_path: Path) -> None:
    journal = start(root=tmp_path).end(StopReason.ABANDONED)
    journal.record(EPOCH)

    def down(run: DeliverDetachedRun) -> DetachedRunDelivered:
        raise ServiceUnavailable("down")

    with pytest.raises(ServiceUnavailable):
        deliver(journal, down)
    assert journal.path.exists()

    def refused(run: DeliverDetachedRun) -> DetachedRunDelivered:
        raise InvalidEvent("not one of the lane's sizes")

    assert deliver(journal, refused) is None  # its answer for good: nothing to retry
    assert not journal.path.exists()


def test_a_killed_runs_delivery_is_said_as_an_interruption_not_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal of a process killed mid-run is delivered as interrupted; its line
    said 'trial 3, interrupted (interrupted)'."""
    journal = start(root=tmp_path)  # never ended: its process is gone
    journal.record(EPOCH)

    def interrupted(run: DeliverDetachedRun) -> DetachedRunDelivered:
        assert run.end_reason is StopReason.INTERRUPTED
        return DetachedRunDelivered(
            event_id=run.event_id,
            job_id="job",
            trial_number=3,
            status=TrialStatus.INTERRUPTED,
            reason=StopReason.INTERRUPTED,
            rewritten=True,
        )

    with caplog.at_level(logging.INFO, "bso_client"):
        assert deliver(journal, interrupted) is not None
    [line] = [r.getMessage() for r in caplog.records]
    assert "interrupted (interrupted)" not in line
    assert line.endswith(
        "trial 3, interrupted (its process was stopped or killed): not held against the batch size"
    )


def test_an_empty_journal_is_dropped_without_a_call(tmp_path: Path) -> None:
    journal = DetachedJournal.start(
        job_id="job",
        hardware=Hardware(),
        batch_size=16,
        trial_number=None,
        epochs=[],
        root=tmp_path,
    )

    def never(run: DeliverDetachedRun) -> DetachedRunDelivered:
        raise AssertionError("an empty journal teaches nothing")

    assert deliver(journal, never) is None
    assert not journal.path.exists()


def test_the_last_recommendation_is_kept_per_job_and_hardware(tmp_path: Path) -> None:
    assert recall("job", "A100 x1", tmp_path) is None
    remember("job", "A100 x1", 256, tmp_path)
    assert recall("job", "A100 x1", tmp_path) == 256
    assert recall("job", "V100 x1", tmp_path) is None
    assert recall("other", "A100 x1", tmp_path) is None


# -- two teams on one machine (job ids are per tenant) ------------------------------------


def test_two_teams_journals_and_recommendations_of_one_job_id_stay_apart(tmp_path: Path) -> None:
    """Two teams sharing a cache dir, each with a job ``nightly``: one team's next run
    never delivers the other's journal (with its own key, into its own job), nor starts
    detached at the other's recommendation."""
    theirs = DetachedJournal.start(
        job_id="nightly",
        hardware=Hardware(),
        batch_size=16,
        trial_number=3,
        epochs=[EPOCH],
        root=tmp_path,
        owner="team-a",
    ).end(StopReason.ABANDONED)
    remember("nightly", "A100 x1", 256, tmp_path, owner="team-a")
    assert pending_journals("nightly", tmp_path, owner="team-b") == []
    assert pending_journals("nightly", tmp_path) == []  # the default tenant's
    assert recall("nightly", "A100 x1", tmp_path, owner="team-b") is None
    assert [j.path for j in pending_journals("nightly", tmp_path, owner="team-a")] == [theirs.path]
    assert recall("nightly", "A100 x1", tmp_path, owner="team-a") == 256


def test_the_default_tenants_files_stay_where_earlier_clients_kept_them(tmp_path: Path) -> None:
    legacy = tmp_path / "detached" / f"nightly-{hashlib.sha256(b'nightly').hexdigest()[:12]}"
    assert job_folder("nightly", tmp_path, owner=DEFAULT_TENANT) == legacy
    assert job_folder("nightly", tmp_path, owner="team-a") != legacy


def test_a_run_acts_for_its_urls_tenant_else_its_keys_id() -> None:
    key = "bso_0123456789ab_" + "s" * 43
    team_url = "redis://bso-tenant-team-a:secret@host:6379/0"
    assert local_owner(team_url, key) == "team-a"
    assert local_owner("redis://bso-client:secret@host:6379/0", key) == "key:0123456789ab"
    assert local_owner("redis://bso-client:secret@host:6379/0", None) == "key:none"
    assert local_owner(None, None) == DEFAULT_TENANT


def test_a_run_on_its_teams_url_delivers_what_its_key_journaled_on_a_url_naming_no_team() -> None:
    """A user who forgot ``bso up`` trained on a guessed URL (no team user) with the
    team's key: the journal is the key's (``key:<id>``).  The next run, on the team's URL
    from credentials.env with the same key, delivers it, as the first run's log line said
    it would (it looked only among the team's own journals before)."""
    key = "bso_0123456789ab_" + "s" * 43
    team_url = "redis://bso-tenant-team-a:secret@host:6379/0"
    assert owners_delivered(team_url, key) == ("team-a", "key:0123456789ab")
    assert owners_delivered("redis://localhost:6379/0", key) == ("key:0123456789ab",)
    assert owners_delivered(team_url, None) == ("team-a",)
    spec = JobSpec(job_id="job", batch_sizes=[16, 32], default_batch_size=16, target_metric=0.9)
    journal = DetachedJournal.start(
        job_id="job",
        hardware=Hardware(),
        batch_size=16,
        trial_number=None,
        epochs=[EPOCH],
        owner=local_owner("redis://localhost:6379/0", key),
    ).end(StopReason.ABANDONED)
    service = BsoService(MemoryStore())
    service.register(spec)
    detachment = Detachment(
        GuardedService(service, "test"), 5.0, None, "team-a", owners_delivered(team_url, key)
    )
    detachment.bind(spec, "job", Hardware())
    detachment.deliver_pending()
    assert not journal.path.exists()
    (lane,) = service.status("job").lanes
    assert lane.detached_trials == 1


@pytest.fixture
def no_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """No cache folder can be named: BSO_CACHE_DIR, XDG_CACHE_HOME and HOME unset, and
    a user id with no entry in the passwd database (a container's arbitrary uid)."""
    for name in ("BSO_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_entry(uid: int) -> Any:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)


@pytest.mark.usefixtures("no_home")
def test_without_any_home_nothing_is_kept_and_nothing_raises() -> None:
    assert pending_journals("job") == []
    remember("job", "hw", 64)  # not kept, and no error
    assert recall("job", "hw") is None
    with pytest.raises(OSError, match="BSO_CACHE_DIR"):
        start()


@pytest.mark.usefixtures("no_home")
@pytest.mark.parametrize("service_up", [True, False], ids=["service-up", "service-down"])
def test_a_run_without_any_home_trains_to_its_end(
    service_up: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """With the service up the run is bso's as ever (no recommendation kept on this
    machine); with it down the run trains detached, its one line naming the fix."""
    switch = Switch()
    switch.up = service_up
    with caplog.at_level(logging.INFO, "bso_client.optimizer"), make(switch) as bso:
        trained = train(bso, [0.1, 0.2, 0.3, 0.95], lambda epoch: None)
        assert bso.detached is not service_up
    assert trained == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if service_up:
        assert warnings == []
        (trial,) = switch.trials()
        assert trial.status is TrialStatus.CONVERGED
    else:
        (warning,) = warnings
        assert "its epochs are not journaled (cannot write the journal" in warning
        assert "set BSO_CACHE_DIR" in warning


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        "null",
        '{"version": 1, "ended": tru',  # cut short
        "\x00" * 64,  # a crash of the disk left zeros
        "not json",
        '{"version": 1, "ended": false, "host": "h", "run": {}}',  # a key missing
        "PID:99999999999999999999",  # os.kill raised OverflowError
        "PID:0",  # os.kill(0, 0) is the process group: alive forever
    ],
    ids=["list", "null", "truncated", "zeros", "text", "no-pid", "huge-pid", "pid-0"],
)
def test_a_corrupt_journal_is_set_aside_once_and_said_not_raised(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A journal file that is no journal used to be skipped silently on every run, and
    one of another JSON shape (``[]``) or a pid ``os.kill`` refuses raised out of the
    next run's start (``AttributeError``, ``OverflowError``) and ended it."""
    good = start(root=tmp_path).end(StopReason.ABANDONED)
    bad = good.path.parent / "0-bad.json"
    if content.startswith("PID:"):
        document = json.loads(start(root=tmp_path).path.read_text())
        document["pid"] = int(content[4:])
        content = json.dumps(document)
        for other in good.path.parent.glob("*.json"):
            if other != good.path:
                other.unlink()
    bad.write_text(content)
    with caplog.at_level(logging.WARNING, "bso_client.optimizer"):
        assert [j.path for j in pending_journals("job", tmp_path)] == [good.path]
        assert [j.path for j in pending_journals("job", tmp_path)] == [good.path]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"the detached-run journal {bad} cannot be read" in warning
    assert "bso will not learn from that run" in warning
    assert not bad.exists()
    assert (bad.parent / "0-bad.json.unreadable").read_text() == content


def test_a_run_starts_and_delivers_past_a_corrupt_journal(caplog: pytest.LogCaptureFixture) -> None:
    """The next run of the job trains, bso's as ever, and delivers the readable ones."""
    left = start().end(StopReason.ABANDONED).record(EPOCH)
    (left.path.parent / "broken.json").write_text("[]")
    switch = Switch()
    with caplog.at_level(logging.INFO, "bso_client.optimizer"), make(switch) as bso:
        assert train(bso, [0.1, 0.95], lambda epoch: None) == 2
        assert not bso.detached
    assert not left.path.exists()  # delivered
    assert sorted(t.status for t in switch.trials()) == [
        TrialStatus.CONVERGED,
        TrialStatus.FAILED,
    ]


CONTAINER_RUN = """
import sys
from pathlib import Path
from bso.spec import Hardware
from bso.wire.events import DetachedEpoch
from bso_client.detached_journal import DetachedJournal

journal = DetachedJournal.start(
    job_id="job", hardware=Hardware(), batch_size=16, trial_number=None,
    epochs=[DetachedEpoch(epoch=1, time_s=1.0, energy_j=2.0, metric=0.5)], root=Path(sys.argv[1]),
)
journal.host = "container-" + sys.argv[2]  # a container's host name: its own, each start
journal.pid = 1  # and its pid namespace's: the training script is often pid 1
journal.save()
print(journal.path, flush=True)
sys.stdin.read()  # trains until told to die
"""


def test_a_journal_left_in_another_container_is_delivered_once_its_writer_is_gone(
    tmp_path: Path,
) -> None:
    """A container has a host name and a pid namespace of its own each time it starts:
    judged by them, a journal of a run killed in one container was another machine's
    to every later container with the same cache volume, and never delivered.  The
    writer's lock, which the kernel drops when it dies, tells instead."""
    writer = subprocess.Popen(
        [sys.executable, "-c", CONTAINER_RUN, str(tmp_path), "a1b2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert writer.stdout is not None
    path = Path(writer.stdout.readline().strip())
    try:
        assert path.exists()
        assert pending_journals("job", tmp_path) == []  # its writer trains on
    finally:
        writer.kill()
        writer.wait()
    (journal,) = pending_journals("job", tmp_path)
    assert (journal.path, journal.host) == (path, "container-a1b2")
