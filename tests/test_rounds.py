"""Online preference optimisation in rounds (verl_core.algorithms.rounds): which prompts a round
samples, and that a round trains from the previous round's policy on its own samples."""

from __future__ import annotations

import pytest

from verl_core.algorithms.rounds import IterativeDPOConfig, IterativeDPOTrainer, RFTConfig, RFTTrainer, round_prompts
from verl_core.bundled import arithmetic
from verl_core.config import ConfigError
from verl_core.data.fingerprint import fingerprint_path

TINY = dict(max_steps=2, batch_size=4, save_steps=1, progress=False, rounds=2, prompts_per_round=16, mixed_precision="no")


def test_round_prompts_move_a_window_through_the_prompt_list():
    rows = [{"prompt": str(i)} for i in range(10)]
    cfg = IterativeDPOConfig(prompts_per_round=4)
    assert [r["prompt"] for r in round_prompts(rows, cfg, 1)] == ["0", "1", "2", "3"]
    assert [r["prompt"] for r in round_prompts(rows, cfg, 3)] == ["8", "9", "0", "1"]  # wraps around
    assert round_prompts(rows, IterativeDPOConfig(), 2) == rows  # unset: every prompt, every round


def test_rounds_settings_keep_the_trainer_settings_and_reject_unknown_keys():
    cfg = RFTConfig(rounds=2, min_score=0.5, learning_rate=3e-4)
    assert cfg.rounds == 2 and cfg.learning_rate == 3e-4 and cfg.generation.n_samples == 4
    with pytest.raises(ConfigError, match="unknown key"):
        IterativeDPOConfig(round=2)


@pytest.mark.parametrize("trainer_cls", [IterativeDPOTrainer, RFTTrainer])
def test_each_round_trains_from_the_previous_rounds_policy(trainer_cls, sft_path, tmp_path):
    result = trainer_cls(str(sft_path), prompts=arithmetic.prompt_rows(32), output_dir=str(tmp_path), **TINY).train()
    rounds = [tmp_path / f"round-{k:02d}" for k in (1, 2)]
    assert result.output_dir == str(rounds[1] / "model") and result.steps == 2
    fingerprints = {fingerprint_path(sft_path), *(fingerprint_path(r / "model") for r in rounds)}
    assert len(fingerprints) == 3  # every round changed the policy
    assert all((r / "data" / "provenance.json").is_file() for r in rounds)  # each sampled its own data


def test_a_rounds_trainer_needs_an_output_dir(tiny_path):
    with pytest.raises(ConfigError, match="output_dir"):
        IterativeDPOTrainer(str(tiny_path), prompts=arithmetic.prompt_rows(8), rounds=1)
