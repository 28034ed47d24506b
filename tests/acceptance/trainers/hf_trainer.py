"""A Hugging Face ``Trainer`` with bso's callback, as docs/client.md wires it.

A tiny BERT built from a ``BertConfig`` (randomly initialised: nothing is
downloaded) learns whether a token sequence contains a keyword token.  The
batch goes into ``TrainingArguments`` through the callback's
``per_device_train_batch_size`` and ``gradient_accumulation_steps``::

    set -a; . .bso/credentials.env; set +a      # BSO_BROKER_URL, BSO_API_KEY
    python hf_trainer.py --job-id nightly-bert

Prints ``epoch N accuracy A`` after every epoch it trained, and as its last
line a JSON summary.  Exits 3 when bso stopped the run unconverged (relaunch).
"""

from __future__ import annotations

import argparse
import json
import logging
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
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from bso_client import JobSpec, RunStatus, TrainFailError
from bso_client.integrations.hf import BsoHfCallback

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


class PrintEpochs(TrainerCallback):
    """What the user watches: one line per epoch the Trainer evaluated."""

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        value = (metrics or {}).get("eval_accuracy", float("nan"))
        print(f"epoch {round(state.epoch or 0)} accuracy {value:.3f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker-url", default=os.environ.get("BSO_BROKER_URL"))
    parser.add_argument("--job-id", default="nightly-bert")
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bso_client").setLevel(logging.INFO)
    torch.set_num_threads(1)

    job = JobSpec(
        job_id=args.job_id,
        batch_sizes=[16, 32, 64, 128],
        default_batch_size=32,
        target_metric=args.target,
        max_epochs=args.max_epochs,
        eta_knob=0.5,
    )
    bso = BsoHfCallback(job, args.broker_url, metric="accuracy")
    summary: dict[str, Any] = {"job_id": args.job_id}
    status = RunStatus()  # BSO_RUN_STATUS_FILE, and one last "bso: OUTCOME ..." line
    with tempfile.TemporaryDirectory() as output_dir, status, bso:
        status.watch(bso.bso)
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=bso.per_device_train_batch_size,
            gradient_accumulation_steps=bso.gradient_accumulation_steps,
            per_device_eval_batch_size=256,
            learning_rate=3e-3,
            num_train_epochs=args.max_epochs,
            eval_strategy="epoch",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            use_cpu=True,
            seed=args.seed,
        )
        torch.manual_seed(args.seed)
        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=LENGTH,
        )
        config.num_labels = 2
        trainer = Trainer(
            model=BertForSequenceClassification(config),
            args=training_args,
            train_dataset=KeywordDataset(768, args.seed),
            eval_dataset=KeywordDataset(256, args.seed + 1),
            compute_metrics=accuracy,
            callbacks=[PrintEpochs(), bso],
        )
        batch_size = bso.batch_size
        summary.update(
            trial_number=bso.bso.trial_number,
            batch_size=batch_size,
            trained_batch=training_args.per_device_train_batch_size
            * training_args.gradient_accumulation_steps
            * training_args.world_size,
        )
        try:
            trainer.train()
        except TrainFailError as err:  # bso stopped the run unconverged: relaunch
            print(err, file=sys.stderr)
    summary["outcome"] = status.outcome
    print(json.dumps(summary), flush=True)
    return status.exit_code


if __name__ == "__main__":
    sys.exit(main())
