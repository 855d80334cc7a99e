"""The vLLM rollout backend against the HF one: same tokens greedily, same log-probs, in-place weight sync."""

from __future__ import annotations

import sys

import pytest
import torch

from verl_core.bundled import arithmetic
from verl_core.data import tokenize_prompts
from verl_core.modeling.forward import response_logprobs
from verl_core.modeling.loading import load_causal_lm, load_tokenizer
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.hf_backend import HFRolloutBackend
from verl_core.rollout.registry import RolloutConfig, build_rollout_backend
from verl_core.rollout.vllm_backend import vllm_installed

# Measured on a 600-step SFT model of the embedded default, fp32, 2 cores, 64 prompts x 4 samples (3.9k
# tokens): the largest |vLLM - HF| sampled-token log-prob was 2.3e-5 at T=1 and 2.2e-5 at T=0.7 (mean
# 4e-7; other matmul and attention kernels); the tests allow 1e-4.
LOGP_TOL = 1e-4


needs_vllm = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed (pip install 'verl_core[vllm]')")


def test_the_vllm_backend_without_vllm_names_the_extra(monkeypatch, tiny_path, tok):
    from verl_core.rollout.vllm_backend import VLLMUnavailableError

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    model = load_causal_lm(tiny_path, trainable=False)
    with pytest.raises(VLLMUnavailableError, match=r"verl_core\[vllm\]"):
        build_rollout_backend(RolloutConfig(backend="vllm"), model, tok)


@needs_vllm
def test_a_head_size_vllm_cannot_run_on_cpu_is_refused_before_an_engine_starts(small_lm, tok):
    from verl_core.rollout.vllm_backend import VLLMUnavailableError

    model = small_lm("llama", len(tok))  # head size 16
    with pytest.raises(VLLMUnavailableError, match="head size 16"):
        build_rollout_backend(RolloutConfig(backend="vllm"), model, tok)


@needs_vllm
def test_gpu_only_engine_options_are_refused_on_a_cpu_machine_before_an_engine_starts(tiny_path, tok):
    from verl_core.config import ConfigError

    if torch.cuda.is_available():
        pytest.skip("a GPU machine takes these options")
    model = load_causal_lm(tiny_path, trainable=False)
    with pytest.raises(ConfigError, match="no GPU"):
        build_rollout_backend(RolloutConfig(backend="vllm", vllm={"sleep_between_rollouts": True}), model, tok)
    with pytest.raises(ConfigError, match="one training process; this run has 2"):
        build_rollout_backend(RolloutConfig(backend="vllm"), model, tok, processes=2)


def test_the_embedded_default_has_a_head_size_vllm_runs_on_cpu(tiny_path):
    from verl_core.rollout.vllm_backend import vllm_skip_reason

    assert vllm_skip_reason(load_causal_lm(tiny_path, trainable=False).config, "cpu") is None


@pytest.fixture(scope="module")
def policy(sft_path):
    return load_causal_lm(sft_path, trainable=False), load_tokenizer(sft_path)


@pytest.fixture(scope="module")
def engine(policy):
    model, tok = policy
    backend = build_rollout_backend(RolloutConfig(backend="vllm"), model, tok)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompts(policy):
    _, tok = policy
    return [e["prompt_ids"] for e in tokenize_prompts(arithmetic.eval_rows(32), tok, 256)]


def _hf_logprobs(model, batch, temperature):
    return response_logprobs(model, batch.training_inputs(), 1.0 / temperature)[0]


@needs_vllm
def test_greedy_vllm_equals_the_hf_backend_token_for_token(policy, engine, prompts):
    model, tok = policy
    params = SamplingParams(max_new_tokens=24, temperature=0)
    hf = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, params)
    v = engine.generate(prompts, params)
    assert v.response_lists() == hf.response_lists()
    assert v.finished.tolist() == hf.finished.tolist() and v.finished.any()
    assert v.prompt_lists() == hf.prompt_lists() and v.group_index.tolist() == hf.group_index.tolist()
    torch.testing.assert_close(v.logprobs, hf.logprobs, atol=LOGP_TOL, rtol=0)  # greedy reports T = 1 log-probs


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_token_logprobs_are_the_policys_at_the_sampling_temperature(policy, engine, prompts, temperature):
    model, _ = policy
    # 256 requests of ~23 prompt tokens: more than one engine step's token budget (4096), so the
    # scheduler splits them over steps (the case that needs whole-prompt prefill with seeded requests)
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=temperature, n=8), seed=3)
    assert len(batch) == 256 and batch.group_index.tolist() == [i for i in range(32) for _ in range(8)]
    assert len({tuple(r) for r in batch.response_lists()}) > 32  # samples of a prompt differ
    mask = batch.response_mask.bool()
    diff = (batch.logprobs - _hf_logprobs(model, batch, temperature))[mask].abs().max().item()
    assert diff < LOGP_TOL, diff
    assert (batch.logprobs[~mask] == 0).all()


@needs_vllm
def test_top_k_samples_stay_in_the_top_k_and_report_log_probs_before_truncation(policy, engine, prompts):
    model, _ = policy
    batch = engine.generate(prompts[:8], SamplingParams(max_new_tokens=16, temperature=1.0, top_k=2, n=2), seed=1)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.logprobs[mask], _hf_logprobs(model, batch, 1.0)[mask], atol=LOGP_TOL, rtol=0)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    r = batch.response_ids.shape[1]
    top2 = logits[:, -r - 1 : -1].topk(2, dim=-1).indices
    assert (top2 == batch.response_ids[..., None]).any(-1)[mask].all()


@needs_vllm
def test_seeded_samples_repeat_and_a_prompts_samples_do_not_depend_on_the_other_prompts(engine, prompts):
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2)
    seeds = [11, 12, 13, 14]
    full = engine.generate(prompts[:4], params, seed=seeds).response_lists()
    assert engine.generate(prompts[:4], params, seed=seeds).response_lists() == full
    alone = engine.generate(prompts[2:3], params, seed=seeds[2:3]).response_lists()
    assert alone == full[4:6]
    assert engine.generate(prompts[:4], params, seed=[21, 22, 23, 24]).response_lists() != full


@needs_vllm
def test_after_an_optimizer_step_and_sync_weights_greedy_vllm_equals_hf_on_the_updated_model(sft_path, engine, prompts):
    model = load_causal_lm(sft_path)  # a trainable copy: the fixture's model stays as the engine's reference
    tok = load_tokenizer(sft_path)
    params = SamplingParams(max_new_tokens=24, temperature=0)
    before = engine.generate(prompts, params).response_lists()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ids = torch.tensor([prompts[0] + [tok.eos_token_id] * 4])
    for _ in range(3):  # push the model toward EOS right after the prompt: its greedy answers change
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    try:
        engine.sync_weights(model)
        after = engine.generate(prompts, params).response_lists()
        hf = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, params).response_lists()
        assert after != before
        assert after == hf
    finally:
        engine.sync_weights(load_causal_lm(sft_path, trainable=False))
    assert engine.generate(prompts, params).response_lists() == before


@needs_vllm
def test_a_lora_policy_is_synced_with_its_adapters_merged(sft_path, engine, prompts):
    from verl_core.modeling.loading import LoraSettings

    model = load_causal_lm(sft_path, lora=LoraSettings(r=4, alpha=8))
    tok = load_tokenizer(sft_path)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: non-zero B
    params = SamplingParams(max_new_tokens=24, temperature=0)
    try:
        engine.sync_weights(model)
        hf = HFRolloutBackend(model, tok.eos_token_id, tok.pad_token_id).generate(prompts, params).response_lists()
        assert engine.generate(prompts, params).response_lists() == hf
        assert not any(getattr(m, "merged", False) for m in model.modules())  # the adapters were unmerged again
    finally:
        engine.sync_weights(load_causal_lm(sft_path, trainable=False))


# GRPO on the default task, the same recipe with either backend: 20 rollout steps of 32 prompts x 4
# samples, two epochs of two mini-batches, lr 1e-4, fp32. Measured from a 900-step SFT policy (exact
# match 0.365 on 200 held-out problems): HF 0.545, vLLM 0.590, vLLM + TIS 0.590 (the mismatch is ~4e-7
# per token in fp32, so the TIS weights are 1 to six digits).
GRPO_RECIPE = dict(
    learning_rate=1e-4,
    batch_size=128,
    num_generations=4,
    mini_batch_size=64,
    ppo_epochs=2,
    max_steps=20,
    max_new_tokens=24,
    mixed_precision="no",
    progress=False,
    logging_steps=5,
    seed=0,
)


BACKENDS = {
    "hf": {},
    "vllm": {"rollout": {"backend": "vllm", "vllm": {"enforce_eager": True}}},  # eager: starts in seconds
    "vllm+tis": {"rollout": {"backend": "vllm", "vllm": {"enforce_eager": True}}, "rollout_correction": "tis"},
}


def _grpo_gains(sft_path, names):
    """Held-out exact match gain (200 problems) of the GRPO recipe over the SFT policy, and the run's history,
    per backend setting in ``names``."""
    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.evaluation import answer_accuracy

    rows = arithmetic.eval_rows(200)
    tok = load_tokenizer(sft_path)
    before = answer_accuracy(load_causal_lm(sft_path, trainable=False), tok, rows, max_new_tokens=24)
    gains, histories = {}, {}
    for name in names:
        trainer = GRPOTrainer(str(sft_path), **GRPO_RECIPE, **BACKENDS[name])
        histories[name] = trainer.train().history
        gains[name] = answer_accuracy(trainer.policy.model, tok, rows, max_new_tokens=24) - before
        assert trainer.backend is None  # the engine the run started was closed
    assert all(g >= 0.05 for g in gains.values()), gains
    for name in names:
        if name.startswith("vllm"):
            assert max(v for _, v in histories[name]["mismatch/logp_abs_diff_mean"]) < 1e-4
    return histories


@needs_vllm
def test_grpo_with_vllm_raises_held_out_exact_match_like_the_hf_backend_with_tis(sft_path):
    histories = _grpo_gains(sft_path, ["hf", "vllm+tis"])
    assert "mismatch/kl" not in histories["hf"]  # the HF backend samples from the training model itself
    assert "mismatch/tis_weight_mean" in histories["vllm+tis"]


@needs_vllm
@pytest.mark.exhaustive  # vLLM without TIS: the run above with the same engine, its TIS weights (1 to six digits) left out
def test_grpo_with_vllm_raises_held_out_exact_match_without_tis(sft_path):
    histories = _grpo_gains(sft_path, ["vllm"])
    assert "mismatch/tis_weight_mean" not in histories["vllm"]


def test_the_rollout_setting_reaches_every_sampling_stage_from_the_cli_overrides():
    from verl_core.config import ConfigError
    from verl_core.pipeline import load_pipeline_config

    cfg = load_pipeline_config(
        None,
        [
            "policy_optimisation.grpo.rollout.backend=vllm",
            "policy_optimisation.grpo.rollout_correction=tis",
            "preference_data.sample_and_score.rollout.backend=vllm",
            "evaluation.rollout.backend=vllm",
        ],
    )
    assert cfg.policy_optimisation.grpo.rollout.backend == "vllm" and cfg.policy_optimisation.grpo.rollout_correction == "tis"
    assert cfg.preference_data.sample_and_score.rollout.backend == "vllm" and cfg.evaluation.rollout.backend == "vllm"
    assert cfg.policy_optimisation.ppo.rollout.backend == "hf"  # the default stays hf
    with pytest.raises(ConfigError, match="sglang"):
        load_pipeline_config(None, ["policy_optimisation.grpo.rollout.backend=sglang"])
    with pytest.raises(ConfigError, match="kv_cache_gb"):
        load_pipeline_config(None, ["policy_optimisation.grpo.rollout.kv_cache_gb=2"])


@needs_vllm
def test_preference_data_sampled_by_vllm_pairs_and_resumes(sft_path, tmp_path):
    from verl_core.preference_data import PreferenceDataConfig, ShardMismatchError, generate_preference_data

    settings = dict(
        n_samples=4, sampling={"max_new_tokens": 24}, shard_size=8, batch_size=8, tie_break="logprob",
        rollout={"backend": "vllm", "vllm": {"enforce_eager": True}}, formats=["arrow"], progress=False,
    )  # fmt: skip
    out = tmp_path / "pref"
    result = generate_preference_data(sft_path, arithmetic.prompt_rows(16), PreferenceDataConfig(**settings), out)
    assert result.counts["pairs"] > 0 and result.provenance["sampling"]["max_new_tokens"] == 24
    again = generate_preference_data(sft_path, arithmetic.prompt_rows(16), PreferenceDataConfig(**settings), out)
    assert again.counts == result.counts  # every shard reused: no engine was needed
    with pytest.raises(ShardMismatchError):  # shards sampled by vLLM are not reused for the HF backend
        generate_preference_data(sft_path, arithmetic.prompt_rows(16), PreferenceDataConfig(**{**settings, "rollout": {}}), out)


@needs_vllm
def test_the_evaluation_stage_scores_the_same_greedy_answers_with_either_backend(sft_path):
    from verl_core.pipeline.evaluation import score_policy

    rows = arithmetic.eval_rows(64)
    hf = score_policy(str(sft_path), rows, "exact_match", 24, None)
    vllm = score_policy(
        str(sft_path), rows, "exact_match", 24, None, rollout=RolloutConfig(backend="vllm", vllm={"enforce_eager": True})
    )
    assert vllm == hf and 0 < hf.metrics["accuracy"] < 1


@pytest.mark.fast
def test_engine_dtype_auto_follows_mixed_precision_on_a_gpu_and_the_policy_elsewhere():
    from verl_core.rollout.registry import _auto_dtype

    fp32 = torch.nn.Linear(2, 2)
    assert _auto_dtype(fp32, torch.bfloat16, "cuda") == "bfloat16"  # fp32 master weights, bf16 forwards: sample in bf16
    assert _auto_dtype(fp32, None, "cuda") == "float32"
    assert _auto_dtype(fp32, torch.bfloat16, "cpu") == "float32"  # on CPU the engine samples what the trainer scores
    assert _auto_dtype(fp32.to(torch.bfloat16), None, "cpu") == "bfloat16"
