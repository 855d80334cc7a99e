"""Stage functions without Prefect: config, records, fingerprints, cache keys, skipping, reuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_core.config import ConfigError
from verl_core.data.fingerprint import fingerprint_path
from verl_core.pipeline import STAGES, PipelineConfig, StageRecord, given_record, load_pipeline_config, run_stage
from verl_core.pipeline.keys import stage_dir, stage_key
from verl_core.pipeline.registry import stage_enabled, stage_for

ROOT = Path(__file__).resolve().parents[1]


def key_of(cfg, name, inputs, round=None):
    return stage_key(cfg, stage_for(cfg, name), inputs, round)


def _record(stage: str, fp: str) -> StageRecord:
    return StageRecord(stage=stage, output_path=f"/x/{stage}", fingerprint=fp)


def _inputs(**fps: str) -> dict[str, StageRecord]:
    base = {"base": "b0", "sft": "s0", "preference_data": "p0", "reward_model": "r0"}
    base.update(fps)
    return {k: _record(k, v) for k, v in base.items()}


def test_default_yaml_loads_into_the_pipeline_config_and_matches_its_defaults():
    from_yaml = load_pipeline_config(ROOT / "configs" / "default.yaml")
    assert from_yaml == PipelineConfig()


def test_pipeline_sections_take_their_defaults_from_the_trainer_configs_except_the_recipe():
    """One source of defaults: a pipeline section's default is its trainer config's, unless the
    recipe (verl_core/pipeline/config.py:RECIPE) names it; nothing else overrides."""
    from verl_core.algorithms.registry import ALGORITHMS
    from verl_core.pipeline.config import RECIPE

    cfg = PipelineConfig()
    for name, algorithm in ALGORITHMS.items():
        section, plain = getattr(cfg.policy_optimisation, name), algorithm.config_cls()
        # num_epochs is derived (1.0 when max_steps is unset), not a default
        differs = {k for k in type(plain).model_fields if getattr(section, k) != getattr(plain, k)} - {"num_epochs"}
        assert differs <= set(RECIPE.get(name, {})), (name, differs - set(RECIPE.get(name, {})))
        assert isinstance(section, algorithm.config_cls)
    assert cfg.policy_optimisation.dpo.beta == RECIPE["dpo"]["beta"] != ALGORITHMS["dpo"].config_cls().beta
    # a partial override keeps the recipe's other values
    cfg = load_pipeline_config(None, ["policy_optimisation.dpo.max_steps=3"])
    assert cfg.policy_optimisation.dpo.beta == RECIPE["dpo"]["beta"] and cfg.policy_optimisation.dpo.max_steps == 3


def test_dotted_overrides_are_typed_and_unknown_keys_rejected():
    cfg = load_pipeline_config(
        ROOT / "configs" / "default.yaml", ["sft.max_steps=7", "sft.model_path=null", "reward_model.enabled=false"]
    )
    assert cfg.sft.max_steps == 7 and cfg.sft.model_path is None and cfg.reward_model.enabled is False
    with pytest.raises(ConfigError, match="unknown key"):
        load_pipeline_config(None, ["sft.max_stepz=7"])


def test_every_selectable_variant_has_a_config_section_and_a_registered_stage():
    from typing import get_args

    from verl_core.pipeline.config import PolicyAlgorithm, PreferenceMethod

    for name in get_args(PolicyAlgorithm):
        cfg = load_pipeline_config(None, [f"policy_optimisation.algorithm={name}"])
        if name != "none":
            assert stage_for(cfg, "policy_optimisation").name == f"policy_optimisation:{name}"
    for method in get_args(PreferenceMethod):
        assert (
            stage_for(load_pipeline_config(None, [f"preference_data.method={method}"]), "preference_data").name
            == f"preference_data:{method}"
        )
    with pytest.raises(ConfigError, match="algorithm"):
        load_pipeline_config(None, ["policy_optimisation.algorithm=reinforce"])


def test_only_the_selected_algorithms_section_enters_the_policy_stage_key():
    inputs = _inputs()
    dpo = load_pipeline_config(None, ["policy_optimisation.algorithm=dpo"])
    other_changed = load_pipeline_config(None, ["policy_optimisation.algorithm=dpo", "policy_optimisation.grpo.max_steps=99"])
    own_changed = load_pipeline_config(None, ["policy_optimisation.algorithm=dpo", "policy_optimisation.dpo.beta=0.3"])
    key = key_of(dpo, "policy_optimisation", inputs)
    assert key_of(other_changed, "policy_optimisation", inputs) == key
    assert key_of(own_changed, "policy_optimisation", inputs) != key


def test_stage_record_round_trips_through_json():
    rec = StageRecord(
        stage="sft",
        output_path="/a/model",
        fingerprint="f" * 64,
        metrics={"loss": 0.5},
        mlflow_run_id="abc",
        cache_key="k",
        extra={"steps": 3},
    )
    assert StageRecord.model_validate_json(rec.model_dump_json()) == rec


def test_fingerprint_depends_on_file_contents_and_names_only(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "x.txt").write_text("one")
        (d / "sub" / "y.bin").write_bytes(b"\x00\x01")
    assert fingerprint_path(a) == fingerprint_path(b)
    (b / "x.txt").write_text("two")
    assert fingerprint_path(a) != fingerprint_path(b)
    assert len(fingerprint_path(a / "x.txt")) == 64


def test_cache_key_changes_with_own_config_and_inputs_but_not_with_volatile_fields_or_run_ids():
    cfg = PipelineConfig()
    k = key_of(cfg, "reward_model", _inputs())
    assert key_of(cfg, "reward_model", _inputs()) == k
    assert key_of(cfg.updated(reward_model={"learning_rate": 5e-4}), "reward_model", _inputs()) != k
    assert key_of(cfg, "reward_model", _inputs(sft="s1")) != k  # upstream content changed
    assert key_of(cfg.updated(sft={"max_steps": 3}), "reward_model", _inputs()) == k  # only through the sft fingerprint
    assert key_of(cfg.updated(reward_model={"progress": False}), "reward_model", _inputs()) == k
    rec = _inputs()
    rec["sft"] = rec["sft"].model_copy(update={"mlflow_run_id": "another-run"})
    assert key_of(cfg, "reward_model", rec) == k


def test_cache_key_of_a_local_data_file_follows_its_content(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    cfg = PipelineConfig().updated(sft={"data": {"path": str(data)}})
    k = key_of(cfg, "sft", _inputs())
    data.write_text(json.dumps({"prompt": "a", "completion": "c"}) + "\n")
    assert key_of(cfg, "sft", _inputs()) != k


def test_output_folder_is_deterministic_from_the_key(tmp_path):
    cfg = PipelineConfig(workdir=str(tmp_path))
    key = key_of(cfg, "sft", _inputs())
    assert stage_dir(cfg, "sft", None, key) == stage_dir(cfg, "sft", None, key_of(cfg, "sft", _inputs()))
    assert stage_dir(cfg, "sft", None, key).parent == tmp_path / "stages"


def test_given_outputs_skip_their_stage(tmp_path):
    model = tmp_path / "my-sft"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_pipeline_config(
        None, [f"sft.model_path={model}", "reward_model.enabled=false", "policy_optimisation.algorithm=none"]
    )
    rec = given_record(cfg, "sft")
    assert rec.given and rec.output_path == str(model) and rec.fingerprint == fingerprint_path(model)
    assert given_record(cfg, "preference_data") is None
    assert not stage_enabled(cfg, "reward_model") and not stage_enabled(cfg, "policy_optimisation")


def test_registry_dispatches_variants_by_the_selector_field():
    cfg = PipelineConfig()
    assert stage_for(cfg, "preference_data").name == "preference_data:bundled"
    assert stage_for(cfg, "sft").name == "sft"
    assert {"sft", "reward_model", "evaluation", "preference_data:bundled"} <= set(STAGES)


def test_bundled_preference_stage_writes_pairs_and_reuses_a_complete_output(tmp_path):
    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", "preference_data.num_prompts=8"])
    first = run_stage(cfg, "preference_data", {})
    rows = [json.loads(line) for line in (Path(first.record.output_path) / "pairs.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {"prompt", "chosen", "rejected"} <= set(rows[0])
    assert first.record.metrics["pairs"] == 8 and not first.reused
    again = run_stage(cfg, "preference_data", {})
    assert again.reused and again.record == first.record


def test_missing_required_input_is_reported():
    with pytest.raises(ConfigError, match="needs the output of 'preference_data'"):
        run_stage(PipelineConfig(), "reward_model", {"sft": _record("sft", "s")})


def test_a_change_of_the_bundled_task_changes_the_key_of_stages_that_read_it(monkeypatch):
    from verl_core.bundled import arithmetic

    cfg = PipelineConfig()
    before = {name: key_of(cfg, name, _inputs()) for name in ("sft", "preference_data", "evaluation", "reward_model")}
    real = arithmetic.preference_rows
    monkeypatch.setattr(arithmetic, "preference_rows", lambda problems, seed=0: real(problems, seed + 1))
    after = {name: key_of(cfg, name, _inputs()) for name in before}
    assert [name for name in before if before[name] != after[name]] == ["preference_data"]


def test_a_given_final_policy_enables_the_policy_stage_as_given_output(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_pipeline_config(None, [f"policy_optimisation.model_path={tmp_path}"])
    assert stage_enabled(cfg, "policy_optimisation")
    rec = given_record(cfg, "policy_optimisation")
    assert rec.given and rec.stage == "policy_optimisation"
    # the evaluation key follows which policy is final
    inputs = _inputs()
    assert key_of(cfg, "evaluation", {**inputs, "policy_optimisation": rec}) != key_of(cfg, "evaluation", inputs)
