"""The choices people make on a deployment's form, turned into the pipeline's config.

A Prefect deployment of :func:`~flows.pipeline.rlhf_pipeline` renders the whole ``PipelineConfig`` as its
parameter form: 932 leaf fields, the algorithm ~14,000 px down. The form flow
(:func:`~flows.pipeline.rlhf_pipeline_form`) instead takes the few choices below, each a config key, plus
``overrides``: ``key=value`` lines read as ``verl-core run --set`` reads them, so every other setting stays
reachable. Both build the same :class:`PipelineConfig` (the config file, then the form's choices, then the
overrides) that the pipeline runs; an empty choice leaves the config file's value.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from verl_core.pipeline.config import PipelineConfig, load_pipeline_config

DEFAULT_CONFIG_FILE = "configs/default.yaml"
FROM_CONFIG = "from config file"  # a choice left at this (or empty, or 0) keeps the config file's value

# form parameter -> the config key it sets ("{algorithm}": the chosen algorithm's section)
FORM_KEYS: dict[str, str] = {
    "algorithm": "policy_optimisation.algorithm",
    "base_model": "base_model",
    "sft_data": "sft.data.path",
    "preference_pairs": "preference_data.path",
    "prompts": "policy_optimisation.prompts.path",
    "evaluation_data": "evaluation.data.path",
    "sft_max_steps": "sft.max_steps",
    "policy_max_steps": "policy_optimisation.{algorithm}.max_steps",
    "launcher": "launcher.kind",
    "num_processes": "launcher.num_processes",
    "workdir": "workdir",
}


def config_file_or_default(given: str | Path | None) -> str | Path | None:
    """``given``, else ``configs/default.yaml`` when it exists (what the CLI and the form both read)."""
    return given or (DEFAULT_CONFIG_FILE if Path(DEFAULT_CONFIG_FILE).is_file() else None)


def _given(value: Any) -> bool:
    return value not in (None, "", 0, FROM_CONFIG)


def override_lines(overrides: str | list[str] | None) -> list[str]:
    """``key=value`` items from the form's text (separated by ``;`` or new lines) or a list."""
    if isinstance(overrides, str):
        overrides = re.split(r"[;\n]", overrides)
    return [item.strip() for item in overrides or [] if item.strip()]


def form_config(
    choices: dict[str, Any], overrides: str | list[str] | None = None, config_file: str | None = None
) -> PipelineConfig:
    """The config file (``configs/default.yaml`` when it exists), then each choice given, then ``overrides``."""
    path = config_file_or_default(config_file or None)
    overrides = override_lines(overrides)
    choices = {k: v for k, v in choices.items() if _given(v)}
    # the config is read a first time only to learn which algorithm's section the step count belongs to
    algorithm = choices.get("algorithm") or (
        load_pipeline_config(path, list(overrides or [])).policy_optimisation.algorithm if "policy_max_steps" in choices else None
    )
    sets = [f"{FORM_KEYS[name].format(algorithm=algorithm)}={json.dumps(value)}" for name, value in choices.items()]
    return load_pipeline_config(path, [*sets, *(overrides or [])])
