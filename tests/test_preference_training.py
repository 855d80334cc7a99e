"""Preference training on the bundled arithmetic task improves the SFT policy.

Train pairs: ``arithmetic.preference_rows(train_problems(480))`` (correct answer chosen,
near-miss wrong answer rejected); held-out pairs come from the eval problems. Each run
starts from the session's ``sft_path`` policy, trains 30 steps of batch 16 in fp32, then
checks that held-out pairwise preference accuracy (chosen summed log-prob > rejected)
rises and that greedy exact-match accuracy on ``eval_rows(100)`` stays ≥ 0.5 × the start.

Measured (2 shared CPU cores; start: preference 0.65, exact match 0.13):
TBD

Tuning note: this tiny policy is fragile. The train pairs carry a superficial cue
(rejected answers are on average longer numbers), and pushing rejected log-probs down
quickly teaches "end numbers early", which ruins greedy answers; with learning rates
of 1e-4 and above DPO (β=0.1), KTO and SimPO all kept the preference gain but dropped
exact match to 0.02–0.05. Small steps (1e-5) with a stronger β for DPO/KTO keep the
answers; ORPO's NLL term protects them even at 3e-4.
"""
from __future__ import annotations

import time

import pytest

from verl_core import arithmetic
from verl_core.algorithms.dpo import DPOTrainer
from verl_core.algorithms.kto import KTOTrainer
from verl_core.evaluation import answer_accuracy, preference_accuracy
from verl_core.models import load_causal_lm, load_tokenizer

STEPS, BATCH = 30, 16
RUNS = {
    "dpo": (DPOTrainer, dict(loss_type="sigmoid", beta=0.5, learning_rate=1e-5)),
    "kto": (KTOTrainer, dict(beta=0.5, learning_rate=1e-5)),
    "simpo": (DPOTrainer, dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, learning_rate=1e-5)),
    "orpo": (DPOTrainer, dict(loss_type="orpo", orpo_lambda=0.1, learning_rate=3e-4)),
}


def held_out_pairs() -> list[dict]:
    return arithmetic.preference_rows(arithmetic.eval_problems(200), seed=1)


def accuracies(model, tokenizer) -> tuple[float, float]:
    return preference_accuracy(model, tokenizer, held_out_pairs()), answer_accuracy(model, tokenizer, arithmetic.eval_rows(100))


@pytest.fixture(scope="module")
def start(sft_path) -> tuple[float, float]:
    """(preference accuracy, exact match) of the starting SFT policy."""
    return accuracies(load_causal_lm(sft_path, trainable=False), load_tokenizer(sft_path))


@pytest.mark.parametrize("algorithm", list(RUNS))
def test_preference_training_raises_held_out_preference_accuracy_without_collapsing_answers(sft_path, start, algorithm):
    cls, settings = RUNS[algorithm]
    t0 = time.perf_counter()
    trainer = cls(str(sft_path), train_dataset=arithmetic.preference_rows(arithmetic.train_problems(STEPS * BATCH)),
                  max_steps=STEPS, batch_size=BATCH, progress=False, logging_steps=10, **settings)
    trainer.train()
    seconds = time.perf_counter() - t0
    pref, exact = accuracies(trainer.engine.unwrapped, trainer.tokenizer)
    report = (f"{algorithm}: preference {start[0]:.3f} -> {pref:.3f}, exact match {start[1]:.2f} -> {exact:.2f}, "
              f"train {seconds:.0f}s")
    print(report)
    assert pref > start[0], report
    assert exact >= 0.5 * start[1], report
