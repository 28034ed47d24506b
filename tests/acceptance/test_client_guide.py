"""docs/client.md's first example as a new user pastes it into a script of their own,
against a live ``bso up``: the user writes the model, the data and the two functions
the example leaves to them, and launches the script until bso has what it needs.

A run bso stops short of its target ends as the guide says a launcher expects: exit
status 3 (``EXIT_RELAUNCH``) and bso's one-line reason, not a traceback.  Pasted as
it once stood, with no handler, the stop was an uncaught ``TrainFailError`` (exit 1),
which a launcher reads as a crash (a new user's walkthrough, helper).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.acceptance.conftest import EXIT_RELAUNCH, ROOT, LiveService, run_trainer, trials_of

pytestmark = pytest.mark.integration

USERS_OWN = """
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
features = torch.randn(1024, 8)
labels = torch.randint(0, 2, (1024,))  # coin flips: no epoch gets near the 0.75 target
train_set = TensorDataset(features, labels)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)


def train_one_epoch(model, loader):
    for inputs, targets in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()


def validate(model):
    with torch.no_grad():
        return (model(features).argmax(1) == labels).float().mean().item()
"""
"""What the example leaves to its user: a model, its data, its two loops."""


def the_guides_first_example(job_id: str, max_epochs: int) -> str:
    text = (ROOT / "docs" / "client.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    # The user's own job: its id, and few epochs (none reaches the guide's target).
    example = example.replace('job_id="nightly-resnet"', f'job_id="{job_id}"')
    example, changed = re.subn(r"max_epochs=\d+", f"max_epochs={max_epochs}", example)
    assert changed == 1, example
    return USERS_OWN + example


def test_the_guides_first_example_ends_a_run_bso_stopped_with_the_relaunch_status(
    service: LiveService, tmp_path: Path
) -> None:
    job = "acceptance-client-guide"
    script = tmp_path / "train.py"
    script.write_text(the_guides_first_example(job, max_epochs=2))
    run = run_trainer([sys.executable, str(script)], service.env())
    assert run.returncode == EXIT_RELAUNCH, str(run)
    assert "Traceback" not in run.stderr, str(run)
    assert f"bso stopped trial 1 of job {job}" in run.stderr, str(run)
    assert "launch the job again" in run.stderr, str(run)
    [trial] = trials_of(service.status(job)).values()
    assert (trial["outcome"], trial["epochs"]) == ("failed", 2), trial  # max_epochs, bso's stop
