"""Asynchronous RL (``async_rollout``): config checks, max_staleness=0 is the synchronous loop bit for bit,
the staleness bound, worker death and hangs, kill -9 and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.errors import TrainingError
from verl_core.rollout.worker import FAULT_ENV
from verl_core.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset
ROOT = Path(__file__).resolve().parents[1]


def _reward(completions, truths):  # varies within a group: the untrained tiny model gets gradients
    return [float(len(c) % 3) for c in completions]


class _Logged(Callback):
    def __init__(self):
        self.rows: list[dict[str, float]] = []

    def on_log(self, step, metrics):
        self.rows.append(dict(metrics))


def _trainer(path, callbacks=(), **overrides):
    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.policies import LLMPolicy

    settings = dict(
        batch_size=8,
        num_generations=4,
        max_steps=4,
        learning_rate=1e-3,
        max_new_tokens=8,
        progress=False,
        logging_steps=1,
        mixed_precision="no",
    )
    settings.update(overrides)
    return GRPOTrainer(policy=LLMPolicy.from_pretrained(str(path)), reward_fns=[_reward], callbacks=list(callbacks), **settings)


def test_async_settings_are_checked():
    from verl_core.algorithms.grpo import GRPOConfig
    from verl_core.pipeline.config import load_pipeline_config

    assert GRPOConfig().async_rollout.max_staleness == 0 and not GRPOConfig().async_rollout.enabled
    with pytest.raises(ConfigError, match="async_rollout.max_staleness > 0 with dynamic_sampling"):
        GRPOConfig.from_dict({"dynamic_sampling": True, "async_rollout": {"max_staleness": 1}})
    with pytest.raises(ConfigError, match="async_rollout.max_staleness > 0 with environment"):
        GRPOConfig.from_dict({"environment": "calculator_arithmetic", "async_rollout": {"max_staleness": 1}})
    with pytest.raises(ConfigError, match="max_staleness"):
        GRPOConfig.from_dict({"async_rollout": {"max_staleness": -1}})
    # TIS needs the trainer's own old log-probs; with the behaviour ones the clipped ratio already corrects
    assert GRPOConfig().async_rollout.old_logprobs == "behaviour"
    with pytest.raises(ConfigError, match="rollout_correction 'tis' with async_rollout.old_logprobs 'behaviour'"):
        GRPOConfig.from_dict({"rollout_correction": "tis", "async_rollout": {"max_staleness": 1}})
    GRPOConfig.from_dict({"rollout_correction": "tis", "async_rollout": {"max_staleness": 1, "old_logprobs": "recompute"}})
    with pytest.raises(ConfigError, match="old_logprobs"):
        GRPOConfig.from_dict({"async_rollout": {"max_staleness": 1, "old_logprobs": "newest"}})
    # the pipeline section derives from the trainer config; the launcher check names the combination
    base = ["policy_optimisation.algorithm=grpo", "policy_optimisation.grpo.async_rollout.max_staleness=2"]
    assert load_pipeline_config(None, base).policy_optimisation.grpo.async_rollout.max_staleness == 2
    load_pipeline_config(None, [*base, "launcher={kind: ray, num_processes: 1}"])  # the workers: Ray actors
    with pytest.raises(ConfigError, match=r"async_rollout.max_staleness > 0 with launcher.kind 'ray' and 2 process"):
        load_pipeline_config(None, [*base, "launcher={kind: ray, num_processes: 2}"])
    with pytest.raises(ConfigError, match=r"launcher.kind 'torchrun' and 2 process"):
        load_pipeline_config(None, [*base, "policy_optimisation.launcher={kind: torchrun, num_processes: 2}"])


def test_max_staleness_zero_is_the_synchronous_run_bit_for_bit(tiny_path):
    runs = []
    for extra in ({}, {"async_rollout": {"max_staleness": 0, "workers": 3}}):
        logged = _Logged()
        trainer = _trainer(tiny_path, [logged], **extra)
        trainer.train()
        assert type(trainer.backend).__name__ != "AsyncRolloutBackend"
        runs.append((trainer.policy.model.state_dict(), logged.rows))
    (w0, rows0), (w1, rows1) = runs
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows0] == [
        {k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows1
    ]
    assert not any(k.startswith("async/") for r in rows0 for k in r)


@pytest.mark.slow  # spawns rollout worker processes and trains
@pytest.mark.parametrize("staleness,workers", [(1, 1), pytest.param(2, 2, marks=pytest.mark.exhaustive)])
def test_staleness_never_exceeds_the_bound(tiny_path, staleness, workers):
    logged = _Logged()
    settings = {"max_staleness": staleness, "workers": workers, "sample_while_starting": False}  # every step from workers
    trainer = _trainer(tiny_path, [logged], max_steps=6, async_rollout=settings)
    result = trainer.train()
    assert result.steps == 6 and trainer.engine.optimizer_steps == 6
    rows = [r for r in logged.rows if "async/staleness" in r]
    assert len(rows) == 6 and all(r["async/in_process_steps"] == 0 for r in rows)
    seen = [r["async/staleness"] for r in rows]
    assert all(0 <= s <= staleness for s in seen) and max(seen) == staleness  # the overlap happened
    assert rows[0]["async/staleness"] == 0  # step 0: the initial weights are version 0
    assert result.metrics["async/staleness_max"] <= staleness
    # the worker's sampled log-probs are the old ones of the ratio: at staleness 0 they are the trainer's own
    # (the same weights; float noise only), one update behind they measurably differ (mismatch/* of the loss)
    assert all(r["mismatch/logp_abs_diff_mean"] < 1e-4 for r in rows if r["async/staleness"] == 0)
    assert any(r["mismatch/logp_abs_diff_mean"] > 1e-4 for r in rows if r["async/staleness"] > 0)


@pytest.mark.slow  # spawns a rollout worker and trains
def test_the_trainer_samples_in_process_while_the_worker_starts(tiny_path):
    logged = _Logged()

    class WaitForTheWorker(Callback):  # after step 0, wait until the worker is up: the hand-over happens at step 1
        def on_step_end(self, step):
            deadline = time.monotonic() + 300
            while step == 1 and not trainer.backend._all_ready() and time.monotonic() < deadline:
                time.sleep(0.1)

    trainer = _trainer(tiny_path, [logged, WaitForTheWorker()], max_steps=5, async_rollout={"max_staleness": 1})
    result = trainer.train()
    assert result.steps == 5 and trainer.engine.optimizer_steps == 5
    rows = [r for r in logged.rows if "async/staleness" in r]
    # step 0 is sampled by the trainer (the worker was spawned a moment before), every later step by the worker
    assert [r["async/in_process_steps"] for r in rows] == [1, 1, 1, 1, 1]
    assert rows[0]["async/staleness"] == 0 and rows[0]["async/worker_gen_seconds"] == 0
    assert all(r["async/worker_gen_seconds"] > 0 and 0 <= r["async/staleness"] <= 1 for r in rows[1:])


@pytest.mark.slow  # spawns rollout workers
def test_a_worker_that_dies_while_starting_fails_the_stage_with_the_main_guard_hint(tiny_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "exit:start:always")

    class WaitForTheDeath(Callback):  # the trainer samples in-process meanwhile: let the worker die first
        def on_step_end(self, step):
            deadline = time.monotonic() + 300
            while step == 1 and trainer.backend.workers[0].handle.alive() and time.monotonic() < deadline:
                time.sleep(0.1)

    settings = {"max_staleness": 1, "max_restarts": 0}
    trainer = _trainer(tiny_path, [WaitForTheDeath()], max_steps=4, async_rollout=settings)
    with pytest.raises(TrainingError, match=r"rollout worker 0 exited with code 3 while starting .*__main__"):
        trainer.train()


@pytest.mark.slow  # spawns rollout worker processes and trains
def test_behaviour_logprobs_feed_tis(tiny_path):
    logged = _Logged()
    settings = {"max_staleness": 1, "old_logprobs": "recompute", "sample_while_starting": False}
    trainer = _trainer(tiny_path, [logged], async_rollout=settings, rollout_correction="tis")
    trainer.train()
    stale = [r for r in logged.rows if r.get("async/staleness") == 1]
    assert stale and all(0 < r["mismatch/tis_weight_mean"] <= 2.0 for r in stale)
    assert any(r["mismatch/logp_abs_diff_mean"] > 1e-4 for r in stale)  # one update behind: a real mismatch


@pytest.mark.slow  # spawns rollout worker processes and trains
def test_a_worker_that_dies_is_restarted(tiny_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "exit:2")  # first incarnation only
    trainer = _trainer(tiny_path, async_rollout={"max_staleness": 1, "sample_while_starting": False, "max_restarts": 1})
    result = trainer.train()
    assert result.steps == 4 and trainer.engine.optimizer_steps == 4
    assert result.metrics["async/restarts"] == 1


@pytest.mark.slow  # spawns rollout worker processes and trains
def test_a_worker_that_keeps_dying_fails_the_stage_naming_it(tiny_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "exit:0:always")
    trainer = _trainer(tiny_path, async_rollout={"max_staleness": 1, "sample_while_starting": False, "max_restarts": 1})
    with pytest.raises(TrainingError, match=r"rollout worker 0 exited with code 3 at step 0, after 1 restarts"):
        trainer.train()


@pytest.mark.exhaustive
def test_a_worker_error_reaches_the_trainer(tiny_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise:0:always")
    trainer = _trainer(tiny_path, async_rollout={"max_staleness": 1, "sample_while_starting": False, "max_restarts": 0})
    with pytest.raises(TrainingError, match=r"rollout worker 0 failed \(exited with code 1\).*injected rollout worker fault"):
        trainer.train()


@pytest.mark.slow  # spawns rollout worker processes and trains
def test_a_hanging_worker_fails_within_the_queue_timeout(tiny_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:2")
    trainer = _trainer(tiny_path, async_rollout={"max_staleness": 1, "sample_while_starting": False, "queue_timeout_s": 4})
    t0 = time.monotonic()
    with pytest.raises(TrainingError, match=r"no batch for step 2 within async_rollout.queue_timeout_s=4s"):
        trainer.train()
    assert time.monotonic() - t0 < 120  # includes the run up to step 2; the wait itself is bounded by 4 s


def _child(out: Path, staleness: int, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(FAULT_ENV, None)
    cmd = [sys.executable, str(ROOT / "tests" / "async_resume_child.py"), str(out), str(staleness), mode]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _gone(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [1, pytest.param(0, marks=pytest.mark.exhaustive)])
def test_kill_9_mid_run_then_resume_trains_each_step_once(tmp_path, staleness):
    killed = _child(tmp_path / "a", staleness, "kill")
    assert killed.returncode == -9, killed.stderr[-2000:]
    done = _child(tmp_path / "a", staleness, "run")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["steps"], summary["resumed"], summary["updates"]) == (5, 2, 5)
    rows = [json.loads(line) for line in (tmp_path / "a" / "updates.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3, 4, 5]  # no update repeated, none missing
    first_pid = rows[0]["pid"]
    assert [r["update"] for r in rows if r["pid"] == first_pid] == [1, 2]
    if staleness:
        deadline = time.monotonic() + 30  # the killed trainer's worker notices and exits
        while not all(_gone(p) for p in rows[0]["workers"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert all(_gone(p) for p in rows[0]["workers"])
    else:  # the synchronous path resumes exactly: the final weights equal the uninterrupted run's
        from safetensors.torch import load_file

        whole = _child(tmp_path / "b", staleness, "run")
        ref = json.loads(whole.stdout.strip().splitlines()[-1])
        a = load_file(str(Path(summary["model"]) / "model.safetensors"))
        b = load_file(str(Path(ref["model"]) / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)
