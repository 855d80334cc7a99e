"""DAPO: overlong shaping, dynamic sampling (drops, fills, cap, metrics), resumability, the recipe."""

from __future__ import annotations

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


def _odd_only(completions, truths):
    """Constant 0 for prompts with an even answer (their groups are all-equal); otherwise a score
    that differs between samples (the completion's distinct characters)."""
    return [0.0 if int(t) % 2 == 0 else len(set(c)) / 10 for c, t in zip(completions, truths)]


def _trainer(path, cls_name="DAPOTrainer", **overrides):
    from verl_core.algorithms import dapo, grpo
    from verl_core.bundled import arithmetic
    from verl_core.policies import LLMPolicy

    settings = dict(
        batch_size=16,
        num_generations=4,
        max_steps=1,
        learning_rate=1e-4,
        max_new_tokens=12,
        overlong_buffer=4,
        progress=False,
        logging_steps=1,
        prompts=arithmetic.prompt_rows(64),
        reward_fns=[_odd_only],
    )
    settings.update(overrides)
    cls = getattr(dapo, cls_name, None) or getattr(grpo, cls_name)
    return cls(policy=LLMPolicy.from_pretrained(str(path)), **settings)


def _capture(trainer):
    """Record what each rollout step trains on: (rollout, scores, metrics) of ``collect``."""
    seen = []
    collect = trainer.collect

    def wrapped(step):
        out = collect(step)
        seen.append(out)
        return out

    trainer.collect = wrapped
    return seen


def _even_groups_at_round_0(trainer, step=0):
    from verl_core.algorithms.sampling import round_prompt_indices

    idx = round_prompt_indices(len(trainer.prompts), step, 0, trainer.config, 0, 1)
    return sum(int(trainer.prompts[i]["ground_truth"]) % 2 == 0 for i in idx)


def test_overlong_penalty_hand_computed():
    from verl_core.algorithms.sampling import overlong_penalty

    lengths = torch.tensor([10, 18, 19, 21, 24, 30])
    # L_max 24, L_cache 6: 0 up to 18 tokens, then (18 - |y|) / 6, -1 at 24 and beyond (eq. 13)
    expected = torch.tensor([0.0, 0.0, -1 / 6, -3 / 6, -1.0, -1.0])
    assert torch.allclose(overlong_penalty(lengths, 24, 6), expected)
    assert torch.allclose(overlong_penalty(lengths, 24, 6, penalty=0.5), 0.5 * expected)
    assert torch.equal(overlong_penalty(lengths, 24, 24)[:1], torch.tensor([-10 / 24]))
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 24, 25)


def test_overlong_shaping_is_added_to_the_score(tiny_path):
    from verl_core.rollout.contract import RolloutBatch

    trainer = _trainer(tiny_path, "GRPOTrainer", max_new_tokens=8, overlong_buffer=4, reward_fns=[lambda c, t: [1.0] * len(c)])
    lengths = torch.tensor([2, 4, 5, 6, 7, 8])
    mask = (torch.arange(8)[None] < lengths[:, None]).long()
    rollout = RolloutBatch(
        prompt_ids=torch.ones(6, 3, dtype=torch.long),
        prompt_mask=torch.ones(6, 3, dtype=torch.long),
        response_ids=torch.full((6, 8), 5) * mask,
        response_mask=mask,
        logprobs=torch.zeros(6, 8),
        group_index=torch.arange(6),
        finished=lengths < 8,
    )
    examples = [{"prompt": "q", "ground_truth": "1"}] * 6
    raw, raw_metrics = trainer.score(rollout, examples)
    assert torch.equal(raw, torch.ones(6)) and raw_metrics["reward/mean"] == 1.0
    scores, metrics = trainer.shape_scores(rollout, raw, raw_metrics)
    # 0 up to 8 - 4 = 4 tokens, then (4 - |y|) / 4
    expected = torch.tensor([1.0, 1.0, 0.75, 0.5, 0.25, 0.0])
    assert torch.allclose(scores, expected)
    assert metrics["reward/mean"] == pytest.approx(expected.mean().item())
    assert metrics["reward/overlong_penalty"] == pytest.approx(-(0.25 + 0.5 + 0.75 + 1.0) / 6)
    with pytest.raises(ConfigError, match="overlong_buffer 9 must be <= max_new_tokens 8"):
        _trainer(tiny_path, max_new_tokens=8, overlong_buffer=9)


def test_extra_rounds_are_a_pure_function_of_seed_step_round():
    from verl_core.algorithms.grpo import GRPOConfig
    from verl_core.algorithms.sampling import round_prompt_indices

    c = GRPOConfig(batch_size=16, num_generations=4, seed=5)
    rounds = [round_prompt_indices(20, 3, r, c, 0, 1) for r in range(6)]
    assert rounds == [round_prompt_indices(20, 3, r, c, 0, 1) for r in range(6)]
    assert all(len(r) == 4 for r in rounds)
    assert len(set(sum(rounds[:5], []))) == 20  # 5 rounds x 4 prompts: no repeat before all 20 were used
    assert round_prompt_indices(20, 4, 1, c, 0, 1) != rounds[1]  # another step, other prompts
    # two processes share each round's prompts
    halves = [round_prompt_indices(20, 3, 2, c, rank, 2) for rank in range(2)]
    assert halves[0] + halves[1] == rounds[2]


def test_select_and_concat_rollout_groups():
    from verl_core.rollout.contract import RolloutBatch, concat_rollouts

    def batch(p_len, r_lens):
        n = len(r_lens)
        r_max = max(r_lens)
        mask = (torch.arange(r_max)[None] < torch.tensor(r_lens)[:, None]).long()
        return RolloutBatch(
            prompt_ids=torch.arange(n * p_len).view(n, p_len),
            prompt_mask=torch.ones(n, p_len, dtype=torch.long),
            response_ids=(torch.arange(n * r_max).view(n, r_max) + 100) * mask,
            response_mask=mask,
            logprobs=-mask.float(),
            group_index=torch.arange(n) // 2,
            finished=torch.ones(n, dtype=torch.bool),
        )

    a = batch(3, [1, 4, 2, 2, 5, 1])
    assert a.select_groups([0, 1, 2]).response_ids.equal(a.response_ids)  # all groups in order: the same batch
    sub = a.select_groups([2, 0])
    assert sub.group_index.tolist() == [0, 0, 1, 1] and sub.response_ids.shape[1] == 5
    assert sub.response_ids[0].equal(a.response_ids[4]) and sub.response_ids[3].equal(a.response_ids[1])
    tight = a.select_groups([1])
    assert tight.response_ids.shape[1] == 2  # trailing padding nobody needs is dropped
    b = batch(5, [3, 3])
    both = concat_rollouts([sub, b], pad_id=0)
    assert both.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert both.prompt_ids.shape == (6, 5) and both.prompt_mask[0].tolist() == [0, 0, 1, 1, 1]
    assert both.response_mask.sum(-1).tolist() == [5, 1, 1, 4, 3, 3]
    with pytest.raises(ValueError, match="groups of this batch"):
        a.select_groups([3])


def test_dynamic_sampling_drops_all_equal_groups_and_fills_the_batch(tiny_path):
    trainer = _trainer(tiny_path)
    seen = _capture(trainer)
    even = _even_groups_at_round_0(trainer)
    assert even > 0, "the test needs an even answer among the first prompts"
    result = trainer.train()
    rollout, scores, metrics = seen[0]
    assert len(rollout) == 16 and rollout.group_index.tolist() == [g for g in range(4) for _ in range(4)]
    per_group = scores.view(4, 4)
    assert bool((per_group.max(-1).values > per_group.min(-1).values).all()), "a constant group was trained on"
    assert metrics["sampling/rounds"] >= 2 and metrics["sampling/dropped_groups"] >= even
    assert metrics["sampling/filler_groups"] == 0
    assert result.metrics["groups/mixed_fraction"] == 1.0
    for key in ("sampling/rounds", "sampling/dropped_groups", "sampling/filler_groups"):
        assert result.history[key][0][1] == metrics[key], key


def test_dynamic_sampling_respects_the_cap_and_trains_on_what_there_is(tiny_path):
    trainer = _trainer(tiny_path, max_sampling_rounds=0)
    seen = _capture(trainer)
    even = _even_groups_at_round_0(trainer)
    trainer.train()
    rollout, scores, metrics = seen[0]
    assert metrics["sampling/rounds"] == 1
    assert metrics["sampling/dropped_groups"] == even and metrics["sampling/filler_groups"] == even
    assert len(rollout) == 16  # topped up with the dropped groups: the batch keeps its shape


def test_all_groups_constant_hits_the_cap_and_leaves_the_policy_unchanged(tiny_path):
    trainer = _trainer(tiny_path, max_sampling_rounds=2, overlong_buffer=None, reward_fns=[lambda c, t: [1.0] * len(c)])
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    result = trainer.train()
    assert result.metrics["sampling/rounds"] == 3
    assert result.metrics["sampling/dropped_groups"] == 12 and result.metrics["sampling/filler_groups"] == 4
    assert result.metrics["grad_norm"] == 0.0
    after = trainer.policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_without_dynamic_sampling_dapo_options_reduce_to_grpo(tiny_path):
    """dynamic_sampling with nothing to drop samples exactly what GRPO samples."""
    keep_all = [lambda c, t: [len(set(x)) / 10 + 0.01 * i for i, x in enumerate(c)]]  # never constant
    runs = [
        _trainer(tiny_path, "GRPOTrainer", dynamic_sampling=ds, reward_fns=keep_all, max_steps=2).train().history
        for ds in (False, True)
    ]
    for key in ("reward/mean", "loss", "grad_norm"):
        assert runs[0][key] == runs[1][key], key
    assert [v for _, v in runs[1]["sampling/rounds"]] == [1.0, 1.0]


def test_dapo_recipe_defaults_and_registration():
    from verl_core.algorithms.dapo import DAPOConfig, DAPOTrainer
    from verl_core.algorithms.registry import ALGORITHMS
    from verl_core.pipeline.config import RECIPE, load_pipeline_config

    c = DAPOConfig()
    assert (c.clip_range, c.clip_range_high, c.loss_agg, c.kl_coef) == (0.2, 0.28, "token-mean", 0.0)
    assert c.dynamic_sampling and c.overlong_buffer == 8 and c.overlong_buffer < c.max_new_tokens
    assert c.advantage_estimator == "grpo" and c.policy_loss == "vanilla"
    a = ALGORITHMS["dapo"]
    assert a.trainer is DAPOTrainer and a.kind == "online" and a.data == "prompts"
    section = load_pipeline_config(None, ["policy_optimisation.algorithm=dapo"]).policy_optimisation.dapo
    grpo = load_pipeline_config(None, []).policy_optimisation.grpo
    for key in ("batch_size", "num_generations", "mini_batch_size", "ppo_epochs", "max_steps", "max_new_tokens"):
        assert getattr(section, key) == getattr(grpo, key), key
    assert section.overlong_buffer == RECIPE["dapo"]["overlong_buffer"] < section.max_new_tokens


class _CrashAfterStep2(Callback):
    def on_step_end(self, step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_a_resumed_dapo_run_equals_an_uninterrupted_one(tiny_path, tmp_path):
    settings = dict(max_steps=3, save_steps=1, mini_batch_size=8, ppo_epochs=2)
    straight = _trainer(tiny_path, **settings).train().history
    assert sum(v for _, v in straight["sampling/rounds"]) > 3, "the run must sample extra rounds to test them"
    crashed = _trainer(tiny_path, output_dir=str(tmp_path), callbacks=[_CrashAfterStep2()], **settings)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    result = _trainer(tiny_path, output_dir=str(tmp_path), **settings).train()  # from the step-2 checkpoint
    assert result.resumed_from_step == 2 and result.steps == 3
    for key in ("reward/mean", "loss", "grad_norm", "sampling/rounds", "sampling/dropped_groups", "policy/clip_fraction"):
        assert result.history[key] == straight[key][2:], key
