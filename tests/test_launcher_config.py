"""The ``launcher`` section (validation, per-stage override, cache keys), the commands it makes,
the accelerate config files of ``deployments/`` and how a failed job's error is named. No job runs here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from verl_core.config import ConfigError
from verl_core.pipeline import PipelineConfig, load_pipeline_config
from verl_core.pipeline.launch import failure, torchrun_command
from verl_core.pipeline.launcher_config import LauncherConfig, launcher_for
from verl_core.pipeline.plan import plan_stage
from verl_core.pipeline.registry import base_model_record

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parents[1]


def test_the_default_launcher_is_local_for_every_stage():
    cfg = load_pipeline_config(ROOT / "configs" / "default.yaml")
    assert {launcher_for(cfg, s).kind for s in ("sft", "reward_model", "policy_optimisation", "evaluation")} == {"local"}


def test_a_stage_launcher_overrides_the_pipeline_default():
    cfg = load_pipeline_config(
        None,
        ["launcher.kind=torchrun", "launcher.num_processes=4", "sft.launcher.kind=ray", "sft.launcher.num_processes=2"],
    )
    assert (launcher_for(cfg, "sft").kind, launcher_for(cfg, "sft").num_processes) == ("ray", 2)
    assert (launcher_for(cfg, "reward_model").kind, launcher_for(cfg, "reward_model").num_processes) == ("torchrun", 4)
    assert launcher_for(cfg, "preference_data").kind == "torchrun"  # the default; run_stage_launched runs it in-process


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launcher.num_processes=2"], "kind 'local' trains in the flow-run process"),
        (["launcher.kind=mpi"], "kind: Input should be 'local', 'torchrun' or 'ray'"),
        (["launcher.kind=torchrun", "launcher.nproc=2"], "unknown key 'launcher.nproc'"),
        (["launcher.kind=torchrun", "launcher.num_machines=2"], "needs rdzv_endpoint"),
        (["launcher.kind=torchrun", "launcher.ray_address=auto"], "ray_address is a ray setting"),
        (["launcher.kind=ray", "launcher.accelerate_config=x.yaml"], "accelerate_config is a torchrun setting"),
        (
            ["launcher.kind=torchrun", "launcher.num_machines=2", "launcher.machine_rank=2", "launcher.rdzv_endpoint=h:1"],
            "rank 2",
        ),
        (["sft.launcher.kind=ray", "sft.launcher.cpus_per_worker=0"], "cpus_per_worker"),
    ],
)
def test_bad_launcher_settings_are_rejected_naming_the_setting(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_pipeline_config(None, overrides)


def test_the_launcher_is_not_part_of_the_cache_key():
    local = PipelineConfig()
    spread = load_pipeline_config(None, ["launcher.kind=torchrun", "launcher.num_processes=8", "sft.launcher.kind=ray"])
    inputs = {"base": base_model_record(local)}
    assert plan_stage(local, "sft", inputs).key == plan_stage(spread, "sft", inputs).key


def test_torchrun_commands_single_and_multi_machine(tmp_path):
    one = torchrun_command(LauncherConfig(kind="torchrun", num_processes=2), tmp_path / "r.json")
    # one machine: the rendezvous store on loopback (torch's --standalone binds every interface)
    assert one[:4] == [sys.executable, "-m", "verl_core.pipeline.launch", "torch.distributed.run"]
    assert "--rdzv_endpoint=127.0.0.1:0" in one and "--standalone" not in one
    assert one[-3:] == ["-m", "verl_core.pipeline.worker", str(tmp_path / "r.json")]
    many = LauncherConfig(kind="torchrun", num_processes=8, num_machines=2, machine_rank=1, rdzv_endpoint="node0:29400")
    cmd = torchrun_command(many, tmp_path / "r.json")
    assert "--standalone" not in cmd and {"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=node0:29400"} <= set(cmd)
    assert many.world_size == 16


@pytest.mark.parametrize(
    "name, expected",
    [
        ("ddp.yaml", {}),
        ("fsdp2.yaml", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}),
        (
            "deepspeed-zero3-offload.yaml",
            {
                "ACCELERATE_USE_DEEPSPEED": "true",
                "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu",
            },
        ),
    ],
)
def test_the_accelerate_config_files_mean_what_accelerate_launch_makes_of_them(name, expected):
    from verl_core.pipeline.accelerate_env import accelerate_environment

    path = ROOT / "deployments" / "accelerate" / name
    env = accelerate_environment(LauncherConfig(kind="torchrun", num_processes=2, accelerate_config=str(path)))
    assert expected.items() <= env.items()
    if not expected:
        assert not {k for k in env if k.startswith(("ACCELERATE_USE_", "FSDP_"))}
    assert "ACCELERATE_MIXED_PRECISION" not in env  # the stage's mixed_precision decides


def test_the_scale_deployments_hold_valid_pipeline_configs():
    spec = yaml.safe_load((ROOT / "deployments" / "prefect-scale.yaml").read_text())
    for deployment in spec["deployments"]:
        cfg = PipelineConfig.from_dict(deployment["parameters"]["config"], source=deployment["name"])
        assert cfg.launcher.kind in ("torchrun", "ray")
        if cfg.launcher.accelerate_config:
            assert (ROOT / cfg.launcher.accelerate_config).is_file()


TORCHRUN_SUMMARY = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
verl_core.pipeline.worker FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-03_13:57:05
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 3828)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 3828
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-03_13:57:04
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 3829)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 3829
============================================================"""


def _error_file(folder: Path, rank: int, message: str, at: float) -> None:
    trace = f"Traceback\nRuntimeError: {message}"
    error = {"rank": rank, "type": "RuntimeError", "message": message, "traceback": trace, "time": at}
    (folder / f"rank-{rank}.error.json").write_text(json.dumps(error))


def test_a_rank_killed_by_a_signal_is_named_not_the_rank_that_then_lost_its_peer(tmp_path):
    _error_file(tmp_path, 0, "Connection closed by peer [127.0.0.1]:1234", 2.0)
    message = failure(tmp_path, 1, TORCHRUN_SUMMARY.format(code=-9).splitlines())
    assert message.startswith("rank 1 was killed by SIGKILL") and "then rank 0: RuntimeError: Connection closed" in message


def test_a_rank_that_raised_is_named_with_its_error(tmp_path):
    _error_file(tmp_path, 1, "non-finite loss at step 3", 1.0)
    _error_file(tmp_path, 0, "Connection closed by peer", 2.0)
    message = failure(tmp_path, 1, TORCHRUN_SUMMARY.format(code=1).splitlines())
    assert message.startswith("rank 1 failed: RuntimeError: non-finite loss at step 3")


def test_a_job_that_fails_without_any_rank_error_shows_its_last_lines(tmp_path):
    message = failure(tmp_path, 2, ["usage: torchrun ...", "error: unrecognized arguments: --bogus"])
    assert "exited with code 2" in message and "unrecognized arguments" in message


def test_a_job_is_streamed_line_by_line_and_killed_at_its_timeout():
    import os

    from verl_core.pipeline.launch import stream

    lines: list[str] = []
    # 10 s for a bare interpreter to print one line: generous on a loaded machine, short next to the 600 s sleep
    script = "import time\nprint('first', flush=True)\ntime.sleep(600)\nprint('never')"
    code, tail = stream([sys.executable, "-c", script], dict(os.environ), lines.append, timeout=10)
    assert lines == ["first"] and code != 0
    assert tail[-1].startswith("the job was killed after its timeout of 10")
