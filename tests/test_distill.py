"""On-policy distillation (verl_core.algorithms.distill): the teacher checks, the reverse KL to the
teacher falling during training (reverse_kl and jsd), teacher rows (GKD's 1 - λ), exact resume, and
the layer-dropped student of verl_core.modeling.student."""

from __future__ import annotations

import pytest
import torch

from verl_core.agents.environments import EpisodeSampler
from verl_core.config import ConfigError
from verl_core.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


@pytest.fixture(scope="module")
def teacher_path(tiny_path, tmp_path_factory):
    """The default tiny model after 30 SFT steps on the bundled task (~2 s): a peaked teacher with
    the student's tokenizer, far (several nats of reverse KL) from the untrained student."""
    from accelerate.state import AcceleratorState

    from verl_core.algorithms.sft import SFTTrainer
    from verl_core.bundled import arithmetic

    out = tmp_path_factory.mktemp("teacher")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before one_thread
    SFTTrainer(
        str(tiny_path),
        train_dataset=arithmetic.sft_rows(480),
        max_steps=30,
        batch_size=16,
        learning_rate=5e-3,
        mixed_precision="no",
        progress=False,
        logging_steps=100,
        output_dir=str(out),
    ).train()
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(reset_partial_state=False)
    return out / "model"


def _trainer(student, teacher, **overrides):
    from verl_core.algorithms.distill import DistillTrainer
    from verl_core.policies import LLMPolicy

    settings = dict(
        teacher_model=str(teacher),
        batch_size=16,
        max_steps=6,
        learning_rate=3e-3,
        max_new_tokens=12,
        mixed_precision="no",
        progress=False,
        logging_steps=1,
    )
    settings.update(overrides)
    return DistillTrainer(policy=LLMPolicy.from_pretrained(str(student)), **settings)


def test_a_teacher_is_required_and_a_different_vocabulary_is_refused_by_name(tiny_path, tmp_path):
    from verl_core.algorithms.distill import DistillConfig
    from verl_core.bundled.tiny_model import TinyModelConfig, tiny_model_path

    with pytest.raises(ConfigError, match="needs a teacher: set teacher_model"):
        _trainer(tiny_path, None, teacher_model=None)
    other = tiny_model_path(TinyModelConfig(vocab_size=320), cache_dir=tmp_path)  # the default's BPE stops at 377 tokens
    with pytest.raises(ConfigError) as err:
        _trainer(tiny_path, other)
    message = str(err.value)
    assert str(other) in message and str(tiny_path) in message and "first difference at id" in message
    assert "377 vs 320 tokens" in message, message
    with pytest.raises(ConfigError, match="jsd_beta"):
        DistillConfig.from_dict({"jsd_beta": 1.5})
    with pytest.raises(ConfigError, match="max_staleness"):
        DistillConfig.from_dict({"teacher_forced_fraction": 0.5, "async_rollout": {"max_staleness": 1}})
    with pytest.raises(ConfigError, match="entropy_coef apply to 'reverse_kl' only"):
        DistillConfig.from_dict({"loss": "jsd", "kl_coef": 0.1})
    assert DistillConfig().kl_coef == 0 and DistillConfig().num_generations == 1 and DistillConfig().loss == "reverse_kl"


def test_same_tokenizer_with_other_weights_is_accepted_and_needs_no_reward(tiny_path, tmp_path):
    from verl_core.bundled.tiny_model import TinyModelConfig, tiny_model_path

    teacher = tiny_model_path(TinyModelConfig(seed=1), cache_dir=tmp_path)  # same tokenizer, other weights
    trainer = _trainer(tiny_path, teacher)
    assert trainer.rewards is None and not any(p.requires_grad for p in trainer.teacher.parameters())
    assert _trainer(tiny_path, teacher, reward_rules={"exact_match": 1.0}).rewards.rules == {"exact_match": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_distillation_lowers_the_reverse_kl_to_the_teacher(tiny_path, teacher_path, loss):
    result = _trainer(
        tiny_path, teacher_path, loss=loss, max_steps=12, learning_rate=1e-2, reward_rules={"exact_match": 1.0}
    ).train()
    kl = [v for _, v in result.history["distill/reverse_kl"]]
    print(f"{loss}: distill/reverse_kl per step {[round(x, 3) for x in kl]}")
    assert len(kl) == 12 and kl[0] > 3.0  # the untrained student is far from the teacher (3.6 nats)
    assert sum(kl[-2:]) / 2 < 0.5 * kl[0], kl  # measured: 3.60 -> 0.92 (reverse_kl), 0.74 (jsd)
    assert "reward/mean" in result.history  # a configured reward is logged, not trained on
    if loss == "jsd":
        jsd = [v for _, v in result.history["distill/jsd"]]
        assert jsd[-1] < jsd[0], jsd


class _CrashAfterStep2(Callback):
    def on_step_end(self, step: int) -> None:
        if step == 2:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_a_resumed_distillation_equals_the_uninterrupted_run(tiny_path, teacher_path, tmp_path):
    settings = dict(max_steps=4, save_steps=1, teacher_forced_fraction=0.25, mini_batch_size=8)
    straight = _trainer(tiny_path, teacher_path, **settings).train().history
    assert [v for _, v in straight["distill/teacher_rows"]] == [0.25] * 4
    crashed = _trainer(tiny_path, teacher_path, output_dir=str(tmp_path), callbacks=[_CrashAfterStep2()], **settings)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    result = _trainer(tiny_path, teacher_path, output_dir=str(tmp_path), **settings).train()
    assert result.resumed_from_step == 2 and result.steps == 4 and len(result.history["loss"]) == 2
    for key in ("distill/reverse_kl", "distill/teacher_logp", "loss", "grad_norm"):
        assert result.history[key] == straight[key][2:], key


class _Updates(Callback):
    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_update(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)


@pytest.mark.slow
def test_jsd_from_hidden_states_in_chunks_equals_the_jsd_of_the_full_logits(tiny_path, teacher_path):
    runs = []
    for fused in (True, False):
        updates = _Updates()
        _trainer(tiny_path, teacher_path, loss="jsd", jsd_beta=0.3, max_steps=2, fused_lm_head=fused, callbacks=[updates]).train()
        runs.append([u["distill/jsd"] for u in updates.metrics])
    assert runs[0] == pytest.approx(runs[1], rel=1e-5), runs


@pytest.mark.slow
def test_agent_episodes_distill_with_teacher_episodes(tiny_path, teacher_path):
    trainer = _trainer(
        tiny_path, teacher_path, environment="calculator_arithmetic", max_steps=2, teacher_forced_fraction=0.5, loss="jsd"
    )
    result = trainer.train()
    assert isinstance(trainer.teacher_backend, EpisodeSampler)  # the teacher's rows are episodes too
    assert [v for _, v in result.history["distill/teacher_rows"]] == [0.5, 0.5]
    assert all(v > 0 for _, v in result.history["distill/reverse_kl"])


def test_student_from_teacher_keeps_the_first_layers(tiny_path, tmp_path):
    from verl_core.modeling.loading import load_causal_lm
    from verl_core.modeling.student import student_from_teacher
    from verl_core.policies import LLMPolicy

    folder = student_from_teacher(str(tiny_path), num_layers=2, output_dir=tmp_path / "student")
    student = LLMPolicy.from_pretrained(folder)
    assert student.model.config.num_hidden_layers == 2 and len(student.model.model.layers) == 2
    teacher = load_causal_lm(tiny_path, trainable=False)
    ids = torch.tensor([student.tokenizer.encode("What is 3 + 4? Answer: 7")])
    with torch.no_grad():
        t = teacher(ids, output_hidden_states=True).hidden_states
        s = student.model.eval()(ids, output_hidden_states=True)
    assert torch.equal(s.hidden_states[0], t[0]) and torch.allclose(s.hidden_states[1], t[1], atol=1e-6)
    final = teacher.model.norm(t[2])  # the student's last hidden state: the teacher's norm after layer 2 of 3
    assert torch.allclose(s.hidden_states[2], final, atol=1e-6)
    assert torch.allclose(s.logits, teacher.lm_head(final), atol=1e-5)
    assert student.tokenizer.get_vocab() == LLMPolicy.from_pretrained(tiny_path).tokenizer.get_vocab()
    with pytest.raises(ConfigError, match="num_layers must be in 1..3"):
        student_from_teacher(str(tiny_path), num_layers=4, output_dir=tmp_path / "too-deep")
    assert not (tmp_path / "too-deep").exists()
