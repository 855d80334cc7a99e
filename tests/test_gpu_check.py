"""The GPU check (bench/gpu_check.sh, bench/gpu_check*.py): its environment check, table and run loop, and
its CPU dry run end to end, so that the one-shot script a GPU machine gets cannot rot between loans."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import gpu_check  # noqa: E402
import gpu_check_child  # noqa: E402
import gpu_check_env  # noqa: E402
import gpu_check_table  # noqa: E402

gpu_check_child.register_shapes()
import realistic_models  # noqa: E402


def _script(*args: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
    )


def test_environment_check_names_a_missing_module_instead_of_a_traceback():
    proc = _script(
        "--check-only", "--dry-run", "--rollout", "hf", "--no-trl", "--require", "no_such_module_gpu_check", timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "MISSING  no_such_module_gpu_check (ModuleNotFoundError" in out
    assert "cannot run: missing no_such_module_gpu_check" in out and ".whl/" in out
    assert "Traceback" not in out


def test_a_module_that_breaks_on_import_is_reported_with_its_error(tmp_path, monkeypatch):
    (tmp_path / "broken_gpu_check_module.py").write_text("raise RuntimeError('built for another CUDA')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    items, _ = gpu_check_env.check("cpu", trl=False, vllm=False, extra=("broken_gpu_check_module",))
    broken = next(i for i in items if i.module == "broken_gpu_check_module")
    assert not broken.ok and "RuntimeError: built for another CUDA" in broken.detail
    assert "cannot run: missing broken_gpu_check_module" in gpu_check_env.report(items)
    assert all(i.ok for i in items if i.module != "broken_gpu_check_module")


def test_vllm_and_trl_are_required_only_for_the_sides_that_use_them():
    assert "vllm" not in gpu_check_env.required_modules(trl=True, vllm=False)
    assert {"trl", "vllm"} <= gpu_check_env.required_modules(trl=True, vllm=True).keys()


def _spec(**kw):
    return realistic_models.RealSpec(**{**gpu_check.DRY, **kw})


def _rec(after_first_s: float, mem: float, **extra) -> dict:
    return {"after_first_step_s": after_first_s, "first_step_s": 5.0, "max_rss_mb": mem, "cuda_peak_mb": None, **extra}


TOKENS = {a: {"tokens_per_unit": 100.0, "max_tokens": 200} for a in ("sft", "dpo", "grpo")}


def test_table_gives_tokens_per_second_ratios_and_the_reason_a_run_failed():
    spec = _spec()  # batch 4, 3 steps: steps 2..3 carry 2 x 4 units of 100 tokens; GRPO 2 x 8 samples
    runs = {
        "sft": {"ours": _rec(0.5, 600), "trl": _rec(1.0, 800)},
        "dpo": {"ours": _rec(0.5, 600, precompute_s=0.75), "trl": {"error": "CUDA out of memory\nmore"}},
        "grpo": {"ours": _rec(1.0, 700), "trl": {"skipped": "trl not installed"}},
    }
    table, failed = gpu_check_table.render(spec, runs, TOKENS, {"torch": "x"}, "cpu", 10.0)
    assert "| sft | 1,600 | 800 | 2.00× | 600 | 800 | 0.75× | ok |" in table
    # a precompute over the 3 steps' rows adds its 2/3 share to the 2 measured steps: 800 / (0.5 + 0.5) tokens/s
    assert "| dpo | 800 | — | — | 600 | — | — | TRL FAILED: CUDA out of memory |" in table
    assert "| grpo | 1,600 | — | — | 700 | — | — | TRL skipped: trl not installed |" in table
    assert failed  # the TRL DPO run failed; a side left out is not a failure
    assert not gpu_check_table.render(spec, {"grpo": runs["grpo"]}, TOKENS, {}, "cpu", 1.0)[1]


def _fsdp(kind: str, version: int | None, losses: list[float]) -> dict:
    fell = losses[-1] < losses[0]
    return _rec(
        1.0,
        900,
        distributed_type=kind,
        fsdp_version=version,
        model_class="FSDPLlamaForCausalLM",
        losses=losses,
        loss_fell=fell,
        ok=version == 2 and fell,
        cuda_peak_mb=900.0,
    )


def test_fsdp2_row_passes_only_when_sharded_with_fsdp2_and_the_loss_fell():
    spec = _spec()
    table, failed = gpu_check_table.render(spec, {"fsdp2": {"ours": _fsdp("FSDP", 2, [10.4, 9.0, 8.1])}}, TOKENS, {}, "cuda", 1)
    assert "ok: accelerate launch fsdp2.yaml, 1 process, FSDP v2, loss 10.400 → 8.100 over 3 steps" in table and not failed
    for rec in (_fsdp("MULTI_GPU", None, [10.4, 9.0, 8.1]), _fsdp("FSDP", 2, [10.4, 10.5, 10.6])):
        table, failed = gpu_check_table.render(spec, {"fsdp2": {"ours": rec}}, TOKENS, {}, "cuda", 1)
        assert failed and "FAILED: accelerate launch fsdp2.yaml" in table
    table, failed = gpu_check_table.render(spec, {"fsdp2": {"ours": _fsdp("MULTI_CPU", None, [7.0, 6.9])}}, TOKENS, {}, "cpu", 1)
    assert "skipped: FSDP2 needs CUDA: accelerate gave MULTI_CPU" in table and not failed


def test_plan_runs_trl_grpo_with_colocated_vllm_on_a_gpu_only():
    gpu = gpu_check.parse_args(["--only", "sft,grpo,fsdp2"])
    assert gpu_check.plan(gpu, "vllm", with_trl=True) == [
        ("sft", "ours", "real-ours"),
        ("sft", "trl", "real-trl"),
        ("grpo", "ours", "real-ours"),
        ("grpo", "trl", "real-trl-vllm"),
        ("fsdp2", "ours", "fsdp2"),
    ]
    dry = gpu_check.parse_args(["--dry-run", "--only", "grpo"])
    assert gpu_check.plan(dry, "vllm", with_trl=True) == [("grpo", "ours", "real-ours"), ("grpo", "trl", "real-trl")]
    assert gpu_check.plan(gpu, "hf", with_trl=False)[1] == ("grpo", "ours", "real-ours")
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "kto"])


def test_a_failed_trl_vllm_run_is_rerun_without_vllm_and_runs_past_the_budget_are_skipped(tmp_path, monkeypatch):
    calls = []

    def fake(cmd, log, result, timeout):
        calls.append(cmd[2])  # gpu_check_child.py SIDE ...
        log.write_text("log\n")
        if cmd[2] == "real-trl-vllm":
            return {"error": "AttributeError: 'Parameter' object has no attribute 'weight_loader'", "wall_s": 1.0}
        return {**_rec(1.0, 500), "features": "trl defaults", "wall_s": 1.0}

    monkeypatch.setattr(gpu_check, "run_process", fake)
    runs, logs = {"grpo": {}}, []
    gpu_check.execute([("grpo", "trl", "real-trl-vllm")], runs, _spec(), TOKENS, tmp_path, time.perf_counter() + 60, 30, logs)
    assert calls == ["real-trl-vllm", "real-trl"] and len(logs) == 2
    assert runs["grpo"]["trl"]["features"] == "trl defaults"
    assert "TRL vLLM colocate failed (AttributeError: 'Parameter'" in runs["grpo"]["notes"][0]
    runs = {"sft": {}}
    gpu_check.execute([("sft", "ours", "real-ours")], runs, _spec(), TOKENS, tmp_path, time.perf_counter() + 5, 30, [])
    assert runs["sft"]["ours"]["skipped"].startswith("out of time") and len(calls) == 2
    assert gpu_check_table.render(_spec(), runs, TOKENS, {}, "cpu", 1)[1]  # a run cut by the budget fails the check


def test_gpu_mode_runs_the_real_model_and_the_dry_run_a_built_one():
    gpu = gpu_check.spec_for(gpu_check.parse_args([]), "vllm")
    assert gpu.shape == "smollm2" and gpu.shape in realistic_models.REAL_MODELS
    assert (gpu.num_hidden_layers, gpu.hidden_size, gpu.vocab_size, gpu.dtype) == (30, 576, 49_152, "bf16")
    assert realistic_models.describe_shape(gpu).startswith("SmolLM2-135M-Instruct, the real pretrained model")
    dry = gpu_check.spec_for(gpu_check.parse_args(["--dry-run"]), "hf")
    assert dry.shape == "gpu-dry" and dry.shape not in realistic_models.REAL_MODELS and dry.vocab_size == 1024
    assert "gpu" not in realistic_models.SHAPES  # the built GPU shape is gone: GPU mode is the real model


def test_a_carried_model_is_found_and_its_pieces_joined_and_checked(tmp_path):
    import hashlib

    name = gpu_check_env.SMOLLM2_GGUF
    assert gpu_check_env.carried_model(tmp_path) is None
    (tmp_path / ".models-b").mkdir()
    (tmp_path / ".models-a").mkdir()
    (tmp_path / ".models-b" / f"{name}.part-01").write_bytes(b"world")  # pieces from two calls' folders
    (tmp_path / ".models-a" / f"{name}.part-00").write_bytes(b"hello ")
    sha = hashlib.sha256(b"hello world").hexdigest()
    joined = gpu_check_env.carried_model(tmp_path, tmp_path / "scratch", sha256=sha)
    assert joined == tmp_path / "scratch" / name and joined.read_bytes() == b"hello world"
    with pytest.raises(ValueError, match="do not join into"):
        gpu_check_env.carried_model(tmp_path, tmp_path / "scratch", sha256="0" * 64)
    assert not (tmp_path / "scratch" / name).exists()  # a bad join is not left to be converted
    (tmp_path / ".models-b" / name).write_bytes(b"whole")
    assert gpu_check_env.carried_model(tmp_path) == tmp_path / ".models-b" / name
    (tmp_path / ".models" / "smollm2").mkdir(parents=True)
    (tmp_path / ".models" / "smollm2" / "config.json").write_text("{}")
    assert gpu_check_env.carried_model(tmp_path) == tmp_path / ".models" / "smollm2"


def test_the_model_check_says_where_the_real_model_comes_from(tmp_path, monkeypatch):
    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setenv(realistic_models.SMOLLM2_ENV, str(folder))
    [item] = gpu_check_env.model_item(REPO)
    assert item.ok and f"converted folder {folder}" in item.detail
    monkeypatch.setenv(realistic_models.SMOLLM2_ENV, str(tmp_path / "nothing-here"))
    items = gpu_check_env.model_item(REPO)
    assert not items[0].ok and "neither a model folder" in items[0].detail
    assert ".models/smollm2/" in gpu_check_env.report(items)


def _need_data():
    if not (realistic_models.DATA_DIR / realistic_models.HH_FILE).is_file():
        pytest.skip(f"shared data not found in {realistic_models.DATA_DIR}")


def _rows(table: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells
        for line in table.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])[0] in gpu_check.ALGOS
    }


@pytest.mark.slow
def test_dry_run_prints_and_writes_the_table(tmp_path):
    """The check on CPU, as the GPU machine runs it but for the model and the HF rollout (a vLLM engine's start
    is the exhaustive variant below): each row, our tokens/s measured, TRL's when TRL is installed, FSDP2
    launched and skipped with the reason. DPO is left out to keep this near a minute: it runs the same child
    and sides as SFT with another algorithm name (bench/realistic.py's smoke test runs our DPO side)."""
    _need_data()
    out = tmp_path / "out"
    out.mkdir()
    proc = _script("--dry-run", "--rollout", "hf", "--threads", "1", "--only", "sft,grpo,fsdp2", timeout=600, OUT=str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = (out / "gpu_check.md").read_text()
    assert table.strip() in proc.stdout  # printed as written
    rows = _rows(table)
    assert list(rows) == ["sft", "grpo", "fsdp2"]
    for algo, cells in rows.items():
        assert float(cells[1].replace(",", "")) > 0, cells  # ours tokens/s
        if algo != "fsdp2" and importlib.util.find_spec("trl") is None:
            assert "TRL skipped: trl not installed" in cells[7]
        elif algo != "fsdp2":
            assert float(cells[2].replace(",", "")) > 0 and cells[3].endswith("×"), cells
    assert "skipped: FSDP2 needs CUDA: accelerate gave MULTI_CPU" in rows["fsdp2"][7]
    assert (out / "gpu_check.json").is_file() and "===== fsdp2 fsdp2" in (out / "gpu_check_logs.txt").read_text()


@pytest.mark.slow
@pytest.mark.exhaustive
def test_dry_run_grpo_with_the_vllm_backend(tmp_path):
    _need_data()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm not installed (the [vllm] extra)")
    out = tmp_path / "out"
    out.mkdir()
    proc = _script("--dry-run", "--rollout", "vllm", "--only", "grpo", "--no-trl", "--threads", "1", timeout=600, OUT=str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    cells = _rows((out / "gpu_check.md").read_text())["grpo"]
    assert float(cells[1].replace(",", "")) > 0 and "rollout.backend vllm" in (out / "gpu_check.md").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
