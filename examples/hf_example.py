"""Hugging Face Trainer with bso choosing the batch size: the callback does the calls.

A tiny BERT built from a config (no download) learns whether a token sequence
contains a "keyword" token; CPU, seconds per epoch.  The batch size goes into
``TrainingArguments``, the evaluation accuracy is reported after every epoch,
and training stops when bso says so::

    bso up                                    # prints the Redis URL and the API key
    set -a; . .bso/credentials.env; set +a    # BSO_BROKER_URL (user, password), BSO_API_KEY
    python examples/hf_example.py

Exits with status 3 when bso stopped the run without convergence (relaunch);
the last line on stderr (``bso: RELAUNCH job=...``) and, when
``BSO_RUN_STATUS_FILE`` names one, a JSON status file say the same under a
launcher that changes exit codes (:mod:`bso_client.run_status`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    EvalPrediction,
    Trainer,
    TrainingArguments,
)

from bso_client import JobSpec, RunStatus, TrainFailError
from bso_client.integrations.hf import BsoHfCallback
from bso_client.run_status import EXIT_CODES

VOCAB = 32
LENGTH = 12
KEYWORD = 7


class KeywordDataset(Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, labelled 1 when they contain the keyword token."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, VOCAB, (size, LENGTH), generator=generator)
        self.labels = (self.tokens == KEYWORD).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.labels[index]}


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    predicted = np.argmax(prediction.predictions, axis=-1)
    return {"accuracy": float((predicted == prediction.label_ids).mean())}


def tiny_bert(seed: int) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
    )
    config.num_labels = 2
    return BertForSequenceClassification(config)


def run(
    broker_url: str | None = None,
    *,
    job_id: str = "tiny-bert-hf",
    target: float = 0.9,
    max_epochs: int = 8,
    seed: int = 0,
    **optimizer_options: Any,
) -> dict[str, Any]:
    """One run of the job; ``optimizer_options`` go to the BatchSizeOptimizer (``service=``...)."""
    job = JobSpec(
        job_id=job_id,
        batch_sizes=[16, 32, 64, 128],
        default_batch_size=32,
        target_metric=target,
        max_epochs=max_epochs,
    )
    bso = BsoHfCallback(job, broker_url, metric="accuracy", **optimizer_options)
    summary: dict[str, Any] = {"job_id": job_id}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    with tempfile.TemporaryDirectory() as output_dir, status, bso:
        status.watch(bso.bso)
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=bso.per_device_train_batch_size,
            gradient_accumulation_steps=bso.gradient_accumulation_steps,
            per_device_eval_batch_size=256,
            learning_rate=3e-3,
            num_train_epochs=max_epochs,
            eval_strategy="epoch",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=seed,
        )
        trainer = Trainer(
            model=tiny_bert(seed),
            args=args,
            train_dataset=KeywordDataset(1024, seed),
            eval_dataset=KeywordDataset(512, seed + 1),
            compute_metrics=accuracy,
            callbacks=[bso],
        )
        try:
            trainer.train()
        except TrainFailError as err:
            print(err, file=sys.stderr)
        decision = bso.bso.last_decision
        summary.update(
            trial_number=bso.bso.trial_number,
            batch_size=bso.batch_size,
            epochs=bso.bso.epoch,
            accuracy=next(
                (
                    h["eval_accuracy"]
                    for h in reversed(trainer.state.log_history)
                    if "eval_accuracy" in h
                ),
                None,
            ),
            converged=decision is not None and decision.converged,
        )
    summary["outcome"] = status.outcome
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--broker-url",
        default=os.environ.get("BSO_BROKER_URL"),
        help="default: BSO_BROKER_URL, from bso up's credentials.env",
    )
    parser.add_argument("--job-id", default="tiny-bert-hf")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--max-epochs", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a model this small only loses time to thread hand-offs
    summary = run(
        args.broker_url, job_id=args.job_id, target=args.target, max_epochs=args.max_epochs
    )
    print(json.dumps(summary))
    return EXIT_CODES[summary["outcome"]]  # 3: bso stopped it unconverged, relaunch


if __name__ == "__main__":
    sys.exit(main())
