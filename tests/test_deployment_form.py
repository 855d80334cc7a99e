"""A deployment form a person can use: the choices people make on the first screen, each described,
everything else as key=value overrides; the same PipelineConfig the pipeline takes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.fast


def _leaves(schema: dict, defs: dict, seen: frozenset = frozenset()) -> int:
    """Form inputs Prefect renders: leaf fields, following $refs (the UI expands nested models)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return 0 if name in seen else _leaves(defs[name], defs, seen | {name})
    if "properties" in schema:
        return sum(_leaves(s, defs, seen) for s in schema["properties"].values())
    if "anyOf" in schema:
        return max(_leaves(s, defs, seen) for s in schema["anyOf"])
    if "allOf" in schema:
        return sum(_leaves(s, defs, seen) for s in schema["allOf"])
    return 1


def _schema(fn) -> dict:
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(fn).model_dump_for_openapi()


def test_the_form_has_the_usual_choices_first_each_described_and_no_const_field():
    from flows import rlhf_pipeline, rlhf_pipeline_form
    from verl_core.algorithms.registry import ALGORITHMS

    form, whole = _schema(rlhf_pipeline_form.fn), _schema(rlhf_pipeline.fn)
    inputs, before = _leaves(form, form.get("definitions", {})), _leaves(whole, whole.get("definitions", {}))
    print(f"deployment form inputs: {before} (the whole PipelineConfig) -> {inputs}")
    assert inputs <= 15 < before
    props = form["properties"]
    assert list(props)[0] == "algorithm" and set(ALGORITHMS) <= set(json.dumps(props["algorithm"]).split('"'))
    assert all(p.get("description") for p in props.values()), [k for k, p in props.items() if not p.get("description")]
    assert '"const"' not in json.dumps(form)
    assert '"null"' not in json.dumps(form)  # no None toggle in front of an input: every choice has a plain default


def test_the_form_builds_the_config_the_cli_would(tmp_path):
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.form import form_config

    pairs = tmp_path / "pairs.jsonl"
    choices = {"algorithm": "kto", "preference_pairs": str(pairs), "policy_max_steps": 7, "launcher": "torchrun", "sft_data": ""}
    overrides = ["sft.learning_rate=1e-4", "policy_optimisation.kto.beta=0.2"]
    got = form_config(
        {**choices, "sft_max_steps": 0, "launcher": "torchrun"}, " sft.learning_rate=1e-4;\npolicy_optimisation.kto.beta=0.2\n"
    )
    assert got == form_config(choices, overrides)
    cli = load_pipeline_config(
        "configs/default.yaml",
        [
            "policy_optimisation.algorithm=kto",
            f"preference_data.path={pairs}",
            "policy_optimisation.kto.max_steps=7",
            "launcher.kind=torchrun",
            *overrides,
        ],
    )
    assert got == cli
