"""Cache keys and content fingerprints.

A stage's key is its name, its code version, its resolved config section (other variants'
sub-sections dropped) and the content fingerprints of its inputs and data; never run ids,
output paths or the source text of the code. Same key, same folder: a retried or re-run
training stage finds its checkpoints there and resumes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from verl_core.data.fingerprint import fingerprint_path
from verl_core.pipeline.config import DataSource, PipelineConfig
from verl_core.pipeline.records import PREVIOUS_ROUND, Stage, StageRecord
from verl_core.pipeline.registry import STEPS
from verl_core.rewards.judge import JudgeConfig
from verl_core.train.precision import resolve_mixed_precision

# Fields that change how a run looks, not what it computes: kept out of cache keys (batch sizes
# are global, so the launcher changes where a stage trains, not its result).
VOLATILE_FIELDS = {"progress", "output_dir", "resume", "model_path", "path", "enabled", "launcher"}


def rows_fingerprint(rows: list[dict] | None) -> str | None:
    return None if rows is None else hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def section_for_key(config: PipelineConfig, name: str) -> dict[str, Any]:
    """The resolved config that determines a step's output (other variants' sections dropped)."""
    section = getattr(config, name)
    selector = STEPS[name].selector
    drop: set[str] = set()
    if selector:
        variants = {s.name.split(":", 1)[1] for s in STEPS[name].stages}
        drop = (variants - {getattr(section, selector)}) & set(type(section).model_fields)
    dumped = _resolved(section.model_dump(mode="json", exclude=drop | VOLATILE_FIELDS))
    if name == "evaluation":  # registration is part of evaluate-and-register
        dumped["_tracking"] = config.tracking.model_dump(mode="json", include={"registered_model_name"})
    return dumped


def _resolved(data: Any) -> Any:
    """``mixed_precision: auto`` as this host resolves it: a bf16 result is not an fp32 one."""
    if isinstance(data, dict):
        return {
            k: resolve_mixed_precision(v) if k == "mixed_precision" and isinstance(v, str) else _resolved(v)
            for k, v in data.items()
        }
    return data


Leaf = Callable[[str, Any], "dict[str, str] | None"]


def _fingerprints(section: Any, leaf: Leaf) -> dict[str, str]:
    """``leaf(field, value)`` over a config section, nested sections included (keys ``a.b.c``): the
    fingerprints a field gives, or None for a field it does not fingerprint (a section is then entered)."""
    out = {}
    for fname in type(section).model_fields:
        value = getattr(section, fname)
        found = leaf(fname, value)
        if found is not None:
            out.update(found)
        elif isinstance(value, BaseModel) and not isinstance(value, DataSource):
            out.update({f"{fname}.{k}": v for k, v in _fingerprints(value, leaf).items()})
    return out


def _data_file(fname: str, value: Any) -> dict[str, str] | None:
    """A DataSource's local file (a hub id hashes its name)."""
    if not isinstance(value, DataSource):
        return None
    return {fname: fingerprint_path(value.path)} if value.path is not None else {}


def _data_fingerprints(section: Any) -> dict[str, str]:
    """Content fingerprints of local files named by DataSource fields (hub ids hash their name)."""
    return _fingerprints(section, _data_file)


MODEL_FIELDS = ("teacher_model", "reward_model_path")  # models a section loads besides its input stages


def _model(fname: str, value: Any) -> dict[str, str] | None:
    """A model a section names besides its inputs: a teacher, a reward model, a judge."""
    if fname in MODEL_FIELDS and isinstance(value, str):
        return {fname: fingerprint_path(value)}
    if isinstance(value, JudgeConfig):
        return {f"{fname}.model": fingerprint_path(value.model)}
    return None


def _model_fingerprints(section: Any) -> dict[str, str]:
    """Content fingerprints of the models a section names: a model retrained in place under the same path
    must not reuse the output it gave before."""
    return _fingerprints(section, _model)


def stage_key(config: PipelineConfig, stage: Stage, inputs: dict[str, StageRecord | None], round: int | None = None) -> str:
    """Cache key of ``stage`` (its step's selected variant): stage + code version + resolved config + input and data
    fingerprints."""
    name = stage.step
    used = stage.input_names(config) + stage.optional + (PREVIOUS_ROUND,) * bool(round and round > 1)
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "config": section_for_key(config, name),
        "data": _data_fingerprints(getattr(config, name)),
        "inputs": {k: (inputs[k].fingerprint if inputs.get(k) is not None else None) for k in sorted(used)},
        "bundled": rows_fingerprint(stage.bundled(config)) if stage.bundled else None,
    }
    models = _model_fingerprints(getattr(config, name))
    if models:  # absent when none is named, so that the keys of stages loading no such model stay as they were
        payload["models"] = models
    if round is not None:
        payload["round"] = round
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def stage_dir(config: PipelineConfig, name: str, variant: str | None, key: str, round: int | None = None) -> Path:
    label = (f"{name}-{variant}" if variant else name) + (f"-round{round}" if round is not None else "")
    return config.workdir_path / "stages" / f"{label}-{key[:16]}"
