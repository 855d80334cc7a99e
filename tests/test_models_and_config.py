"""Model loading, the embedded default, and typed configs."""

from __future__ import annotations

import pytest
import torch

from verl_core.algorithms.sft import SFTConfig, SFTTrainer
from verl_core.bundled.tiny_model import TinyModelConfig, tiny_model_path
from verl_core.config import ConfigError
from verl_core.modeling.loading import LoraSettings, load_causal_lm, load_reward_model, load_tokenizer
from verl_core.modeling.model_files import ModelLoadError


def test_tiny_default_is_deterministic_and_loads_with_from_pretrained(tmp_path):
    a = tiny_model_path(cache_dir=tmp_path / "a")
    b = tiny_model_path(cache_dir=tmp_path / "b")
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    ma, mb = load_causal_lm(a), load_causal_lm(b)
    assert all(torch.equal(x, y) for x, y in zip(ma.state_dict().values(), mb.state_dict().values()))
    tok = load_tokenizer(a)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|end|>" and tok.chat_template
    assert tiny_model_path(cache_dir=tmp_path / "a") == a  # cached, not rebuilt


def test_bad_model_paths_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="model path does not exist"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_causal_lm(tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="does not exist: someone/some-model .*hf://"):
        load_tokenizer("someone/some-model")  # never a download: a local path unless marked or allowed
    with pytest.raises(ModelLoadError, match="hub downloads are off"):
        load_tokenizer("hf://someone/some-model")


def test_reward_model_has_one_output_and_lora_wraps(tiny_path):
    rm = load_reward_model(tiny_path)
    assert rm.config.num_labels == 1
    lm = load_causal_lm(tiny_path, lora=LoraSettings(r=4))
    trainable = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in lm.parameters()) / 5
    ref = load_causal_lm(tiny_path, dtype="bfloat16", trainable=False)
    assert not any(p.requires_grad for p in ref.parameters()) and next(ref.parameters()).dtype == torch.bfloat16


def test_unknown_config_keys_and_bad_values_are_rejected(tiny_path, tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'learning_rte'"):
        SFTTrainer(str(tiny_path), train_dataset=[{"text": "x"}], learning_rte=1e-3)
    with pytest.raises(ConfigError, match="learning_rate"):
        SFTConfig.from_dict({"learning_rate": -1})
    (tmp_path / "c.yaml").write_text("learning_rate: 0.01\nmax_steps: 5\n")
    cfg = SFTConfig.from_yaml(tmp_path / "c.yaml", overrides={"batch_size": 4})
    assert (cfg.learning_rate, cfg.max_steps, cfg.batch_size) == (0.01, 5, 4)
    (tmp_path / "bad.yaml").write_text("learning_rate: 0.01\nwarmup: 5\n")
    with pytest.raises(ConfigError, match="unknown key 'warmup'"):
        SFTConfig.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError):
        TinyModelConfig(hidden_sizes=3)


def test_a_reward_model_from_a_causal_lm_prints_no_coloured_load_report(tiny_path, capfd, caplog):
    """transformers' "LOAD REPORT ... score.weight MISSING" (raw ANSI codes in a log) becomes one plain line."""
    import logging

    from verl_core.modeling.loading import load_reward_model

    with caplog.at_level(logging.INFO, logger="verl_core"):
        load_reward_model(tiny_path)
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err and "\x1b[" not in out + err
    assert any("a new score head" in r.getMessage() for r in caplog.records)
