"""Pipeline stages as plain Python: ``(PipelineConfig, input records) -> StageRecord``.

No Prefect here. ``run_stage`` is the one entry point; Prefect tasks (``tasks/``) and
tests call it the same way. A stage is a registered function ``fn(ctx) -> StageOutput``;
stages with variants are registered as ``"<stage>:<variant>"`` and picked by the
section's selector field (``policy_optimisation.algorithm``, ``preference_data.method``).

A stage writes into ``<workdir>/stages/<stage>[-<variant>]-<key>`` where ``key`` is its
cache key (:func:`stage_key`): the stage name, its code version, its resolved config
section and the content fingerprints of its inputs. Same key, same folder: a retried or
re-run training stage finds its checkpoints there and resumes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, get_args

from pydantic import BaseModel, Field

from verl_core import arithmetic
from verl_core.callbacks import Callback
from verl_core.config import ConfigError
from verl_core.pipeline_config import DataSource, PipelineConfig

log = logging.getLogger("verl_core")
RECORD_FILE = "record.json"
HISTORY_FILE = "history.json"
FAULT_ENV = "VERL_CORE_TEST_FAULT"  # test hook: "<stage>[,<stage>...]" raises once, after the first checkpoint
# Selector field of stages that have variants.
VARIANT_FIELDS = {"preference_data": "method", "policy_optimisation": "algorithm"}
# Fields that change how a run looks, not what it computes: kept out of cache keys.
VOLATILE_FIELDS = {"progress", "output_dir", "resume", "model_path", "path", "enabled"}


class StageRecord(BaseModel):
    """What a stage hands downstream: where its output is and what it contains."""

    stage: str
    output_path: str
    fingerprint: str
    metrics: dict[str, float] = Field(default_factory=dict)
    mlflow_run_id: str | None = None
    variant: str | None = None
    cache_key: str | None = None
    given: bool = Field(False, description="output supplied by the config, not computed")
    extra: dict[str, Any] = Field(default_factory=dict)


@dataclass
class DatasetUse:
    """A dataset a stage read or wrote, for tracking (MLflow dataset inputs)."""

    name: str
    rows: list[dict]
    context: str  # "training" | "evaluation" | "output"
    source: str


@dataclass
class StageOutput:
    """What a stage function returns; ``run_stage`` turns it into a :class:`StageRecord`."""

    output_path: Path
    metrics: dict[str, float] = field(default_factory=dict)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    datasets: list[DatasetUse] = field(default_factory=list)
    artifacts: list[Path] = field(default_factory=list)
    tables: dict[str, list[dict]] = field(default_factory=dict)
    model_to_log: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageResult:
    record: StageRecord
    output: StageOutput
    reused: bool = False  # a complete output with the same key was already on disk


@dataclass
class StageContext:
    config: PipelineConfig
    name: str
    variant: str | None
    inputs: dict[str, StageRecord]
    output_dir: Path
    callbacks: list[Callback]

    @property
    def section(self) -> Any:
        return getattr(self.config, self.name)

    def input_path(self, name: str) -> str:
        if self.inputs.get(name) is None:
            raise ConfigError(f"stage {self.name!r} needs the output of {name!r}, which is missing")
        return self.inputs[name].output_path


@dataclass(frozen=True)
class Stage:
    name: str  # "sft" or "policy_optimisation:dpo"
    version: str  # bump when the stage computes something different
    fn: Callable[[StageContext], StageOutput]
    inputs: tuple[str, ...] | Callable[[PipelineConfig], tuple[str, ...]] = ()
    optional: tuple[str, ...] = ()
    bundled: Callable[[PipelineConfig], list[dict] | None] | None = None  # built-in rows it reads (hashed into the key)

    def input_names(self, config: PipelineConfig) -> tuple[str, ...]:
        return self.inputs(config) if callable(self.inputs) else self.inputs


STAGES: dict[str, Stage] = {}


def register_stage(name: str, *, version: str, inputs=(), optional: tuple[str, ...] = (), bundled=None):
    """Decorator: ``@register_stage("policy_optimisation:dpo", version="1", inputs=("sft", "preference_data"))``.

    ``inputs``: upstream stages whose records it needs (a tuple, or a function of the config);
    ``optional``: upstream stages it uses when present; ``bundled``: config -> the built-in rows
    it reads, if any (their content enters the cache key, so a change of the bundled task reruns it).
    """

    def deco(fn: Callable[[StageContext], StageOutput]):
        if name in STAGES:
            raise ValueError(f"stage {name!r} is already registered")
        STAGES[name] = Stage(name, version, fn, inputs, optional, bundled)
        return fn

    return deco


def variant_of(config: PipelineConfig, name: str) -> str | None:
    selector = VARIANT_FIELDS.get(name)
    return getattr(getattr(config, name), selector) if selector else None


def stage_for(config: PipelineConfig, name: str) -> Stage:
    variant = variant_of(config, name)
    key = f"{name}:{variant}" if variant else name
    if key not in STAGES:
        raise ConfigError(f"no stage registered for {key!r}; registered: {sorted(STAGES)}")
    return STAGES[key]


def stage_enabled(config: PipelineConfig, name: str) -> bool:
    """Whether the pipeline has this stage at all (computed or given)."""
    if name == "reward_model":
        return config.reward_model.enabled or config.reward_model.model_path is not None
    if name == "policy_optimisation":
        return config.policy_optimisation.algorithm != "none" or config.policy_optimisation.model_path is not None
    return True


# -- fingerprints and keys ------------------------------------------------------------------
def fingerprint_path(path: str | os.PathLike) -> str:
    """sha256 over (relative path, content) of every file under ``path``, sorted; a hub id hashes its name."""
    p = Path(path).expanduser()
    h = hashlib.sha256()
    if p.is_file():
        files = [p]
        base = p.parent
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith(".tmp"))
        base = p
    else:
        return hashlib.sha256(f"remote:{path}".encode()).hexdigest()
    for f in files:
        h.update(str(f.relative_to(base)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def section_for_key(config: PipelineConfig, name: str) -> dict[str, Any]:
    """The resolved config that determines a stage's output (other variants' sections dropped)."""
    section = getattr(config, name)
    selector = VARIANT_FIELDS.get(name)
    variants = set(get_args(type(section).model_fields[selector].annotation)) if selector else set()
    drop = (variants - {getattr(section, selector)}) & set(type(section).model_fields) if selector else set()
    dumped = section.model_dump(mode="json", exclude=drop | VOLATILE_FIELDS)
    if name == "evaluation":  # registration is part of evaluate-and-register
        dumped["_tracking"] = config.tracking.model_dump(mode="json", include={"log_model", "registered_model_name"})
    return dumped


def rows_fingerprint(rows: list[dict] | None) -> str | None:
    return None if rows is None else hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def _data_fingerprints(section: Any) -> dict[str, str]:
    """Content fingerprints of local files named by DataSource fields (hub ids hash their name)."""
    out = {}
    for fname in type(section).model_fields:
        value = getattr(section, fname)
        if isinstance(value, DataSource) and value.path is not None:
            out[fname] = fingerprint_path(value.path)
        elif isinstance(value, BaseModel) and not isinstance(value, DataSource):
            out.update({f"{fname}.{k}": v for k, v in _data_fingerprints(value).items()})
    return out


def stage_key(config: PipelineConfig, name: str, inputs: dict[str, StageRecord | None]) -> str:
    """Cache key: stage + code version + resolved config + input and data fingerprints.

    Never run ids, paths of outputs, or source text of the code.
    """
    stage = stage_for(config, name)
    used = stage.input_names(config) + stage.optional
    payload = {
        "stage": stage.name,
        "version": stage.version,
        "config": section_for_key(config, name),
        "data": _data_fingerprints(getattr(config, name)),
        "inputs": {k: (inputs[k].fingerprint if inputs.get(k) is not None else None) for k in sorted(used)},
        "bundled": rows_fingerprint(stage.bundled(config)) if stage.bundled else None,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def stage_dir(config: PipelineConfig, name: str, key: str) -> Path:
    variant = variant_of(config, name)
    label = f"{name}-{variant}" if variant else name
    return config.workdir_path / "stages" / f"{label}-{key[:16]}"


# -- given outputs --------------------------------------------------------------------------
GIVEN_FIELDS = {"sft": "model_path", "preference_data": "path", "reward_model": "model_path", "policy_optimisation": "model_path"}


def base_model_record(config: PipelineConfig) -> StageRecord:
    """The base model as a record: the configured folder/hub id, or the embedded tiny model."""
    from verl_core.tiny import tiny_model_path

    path = config.base_model or str(tiny_model_path())
    return StageRecord(stage="base", output_path=str(path), fingerprint=fingerprint_path(path), given=True)


def given_record(config: PipelineConfig, name: str) -> StageRecord | None:
    """A record for a stage output named in the config (the stage is then skipped)."""
    if name == "base":
        return base_model_record(config)
    path = getattr(getattr(config, name), GIVEN_FIELDS[name], None) if name in GIVEN_FIELDS else None
    if path is None:
        return None
    return StageRecord(stage=name, output_path=str(path), fingerprint=fingerprint_path(path), given=True)


# -- running a stage ------------------------------------------------------------------------
def run_stage(config: PipelineConfig, name: str, inputs: dict[str, StageRecord | None],
              callbacks: Sequence[Callback] = (), run_id: str | None = None) -> StageResult:
    """Run stage ``name`` into its deterministic folder and return its record.

    A folder that already holds a complete record with the same key is reused as is.
    """
    stage = stage_for(config, name)
    for needed in stage.input_names(config):
        if inputs.get(needed) is None:
            raise ConfigError(f"stage {name!r} needs the output of {needed!r}")
    key = stage_key(config, name, inputs)
    out_dir = stage_dir(config, name, key)
    done = out_dir / RECORD_FILE
    if done.is_file():
        record = StageRecord.model_validate_json(done.read_text())
        if record.cache_key == key and Path(record.output_path).exists():
            hist = out_dir / HISTORY_FILE
            history = json.loads(hist.read_text()) if hist.is_file() else {}
            return StageResult(record, StageOutput(Path(record.output_path), record.metrics, history), reused=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = StageContext(config, name, variant_of(config, name), {k: v for k, v in inputs.items() if v is not None},
                       out_dir, list(callbacks) + _fault_callbacks(name, out_dir))
    _maybe_fault(name, out_dir, when="start")
    output = stage.fn(ctx)
    metrics = {k: float(v) for k, v in output.metrics.items() if isinstance(v, (int, float))}
    record = StageRecord(stage=name, variant=ctx.variant, output_path=str(output.output_path),
                         fingerprint=fingerprint_path(output.output_path), metrics=metrics,
                         mlflow_run_id=run_id, cache_key=key, extra=output.extra)
    if output.history:
        (out_dir / HISTORY_FILE).write_text(json.dumps(output.history))
        record.extra["history"] = str(out_dir / HISTORY_FILE)
    tmp = out_dir / f".tmp-{RECORD_FILE}"
    tmp.write_text(record.model_dump_json(indent=2))
    tmp.replace(done)
    return StageResult(record, output)


# -- test hook: fail once after the first checkpoint (or at the start of a stage that has none)
class InjectedFault(RuntimeError):
    """Raised by the test hook ``VERL_CORE_TEST_FAULT``."""


def _fault_armed(name: str, out_dir: Path) -> bool:
    wanted = {s.strip() for s in os.environ.get(FAULT_ENV, "").split(",") if s.strip()}
    return name in wanted and not (out_dir / ".fault-fired").exists()


def _maybe_fault(name: str, out_dir: Path, when: str) -> None:
    if when == "start" and name in ("sft", "reward_model", "policy_optimisation"):
        return  # training stages fail after a checkpoint instead
    if _fault_armed(name, out_dir):
        (out_dir / ".fault-fired").touch()
        raise InjectedFault(f"injected fault in stage {name!r} ({when}; {FAULT_ENV})")


class _FaultAfterCheckpoint(Callback):
    def __init__(self, name: str, out_dir: Path):
        self.name, self.out_dir = name, out_dir

    def on_checkpoint(self, step: int, path: str) -> None:
        _maybe_fault(self.name, self.out_dir, when=f"after checkpoint step {step}")


def _fault_callbacks(name: str, out_dir: Path) -> list[Callback]:
    return [_FaultAfterCheckpoint(name, out_dir)] if _fault_armed(name, out_dir) else []


# -- helpers for stage functions ------------------------------------------------------------
def load_data(source: DataSource, bundled: Callable[[int | None], list[dict]] | None = None) -> list[dict]:
    """Rows of ``source``; ``bundled(limit)`` when it names no path."""
    if source.path is None:
        if bundled is None:
            raise ConfigError("this data source needs a path")
        return bundled(source.limit)
    from verl_core.data import load_rows

    rows = load_rows(source.path, source.split).to_list()
    return rows[: source.limit] if source.limit else rows


def data_label(source: DataSource, bundled: str) -> str:
    return source.path or f"bundled:arithmetic/{bundled}"


def latest_checkpoint_step(out_dir: Path) -> int:
    root = out_dir / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / "engine_state.json").is_file()) if root.is_dir() else []
    return json.loads((done[-1] / "engine_state.json").read_text())["step"] if done else 0


def train_in_stage(ctx: StageContext, trainer_cls, settings: BaseModel, build: Callable[[Any], Any],
                   datasets: Sequence[DatasetUse] = (), source: str | None = None) -> StageOutput:
    """Train into ``ctx.output_dir`` (resuming its checkpoints) and describe the result.

    ``settings``' fields that ``trainer_cls.config_cls`` knows become its config; ``build(config)``
    makes the trainer (offline and online trainers take their data differently).
    """
    cfg_cls = trainer_cls.config_cls
    values = {k: v for k, v in settings.model_dump().items() if k in cfg_cls.model_fields}
    values.update(output_dir=str(ctx.output_dir), resume=True)
    resumed = latest_checkpoint_step(ctx.output_dir)
    result = build(cfg_cls.from_dict(values, source=source or f"{ctx.name} settings")).train()
    if not ctx.config.orchestration.keep_checkpoints:
        shutil.rmtree(ctx.output_dir / "checkpoints", ignore_errors=True)
    return StageOutput(output_path=Path(result.output_dir), metrics=result.metrics, history=result.history,
                       datasets=list(datasets), extra={"steps": result.steps, "resumed_from_step": resumed})


def train_offline(ctx: StageContext, trainer_cls, settings: BaseModel, model: str, rows: list[dict],
                  eval_rows: list[dict] | None = None, datasets: Sequence[DatasetUse] = ()) -> StageOutput:
    """:func:`train_in_stage` for a trainer that reads rows (SFT, reward model, DPO family, KTO)."""
    return train_in_stage(ctx, trainer_cls, settings, datasets=datasets, build=lambda config: trainer_cls(
        model, train_dataset=rows, eval_dataset=eval_rows or None, config=config, callbacks=ctx.callbacks))


# -- the stages -----------------------------------------------------------------------------
def _bundled_sft(cfg: PipelineConfig) -> list[dict] | None:
    return arithmetic.sft_rows(cfg.sft.data.limit or 2000) if cfg.sft.data.path is None else None


def _bundled_pairs(cfg: PipelineConfig) -> list[dict]:
    c = cfg.preference_data
    return arithmetic.preference_rows(arithmetic.prompt_problems(c.num_prompts), seed=c.seed)


def _bundled_eval(cfg: PipelineConfig) -> list[dict] | None:
    c = cfg.evaluation
    return arithmetic.eval_rows(c.data.limit or c.num_rows)[: c.num_rows] if c.data.path is None else None


@register_stage("sft", version="sft-1", inputs=("base",), bundled=_bundled_sft)
def sft_stage(ctx: StageContext) -> StageOutput:
    from verl_core.algorithms.sft import SFTTrainer

    c = ctx.section
    rows = _bundled_sft(ctx.config) or load_data(c.data, None)
    return train_offline(ctx, SFTTrainer, c, ctx.input_path("base"), rows,
                         datasets=[DatasetUse("sft-train", rows, "training", data_label(c.data, "sft"))])


@register_stage("preference_data:bundled", version="pairs-1", bundled=_bundled_pairs)
def bundled_preference_stage(ctx: StageContext) -> StageOutput:
    rows = _bundled_pairs(ctx.config)
    data = ctx.output_dir / "data"
    data.mkdir(exist_ok=True)
    with open(data / "pairs.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    return StageOutput(output_path=data, metrics={"pairs": len(rows)},
                       datasets=[DatasetUse("preference-pairs", rows, "output", "bundled:arithmetic/pairs")])


def preference_rows_of(record: StageRecord) -> list[dict]:
    """Pairs from a preference-data record: its ``pairs.jsonl``, its ``pairs/`` ``save_to_disk`` folder
    (what ``verl_core.preference_data`` writes), or the record's path itself (any loadable file/folder)."""
    from verl_core.data import load_rows

    path = Path(record.output_path)
    for candidate in (path / "pairs.jsonl", path / "pairs"):
        if candidate.exists():
            return load_rows(str(candidate)).to_list()
    return load_rows(str(path)).to_list()


@register_stage("reward_model", version="rm-1", inputs=lambda cfg: (cfg.reward_model.init_from, "preference_data"))
def reward_model_stage(ctx: StageContext) -> StageOutput:
    from verl_core.algorithms.reward_model import RewardTrainer

    c = ctx.section
    rows = preference_rows_of(ctx.inputs["preference_data"])
    n_eval = int(len(rows) * c.eval_fraction)
    train, held = (rows[:-n_eval], rows[-n_eval:]) if n_eval else (rows, [])
    source = ctx.inputs["preference_data"].output_path
    uses = [DatasetUse("rm-train", train, "training", source)] + ([DatasetUse("rm-eval", held, "evaluation", source)] if held else [])
    return train_offline(ctx, RewardTrainer, c, ctx.input_path(c.init_from), train, eval_rows=held, datasets=uses)


@register_stage("evaluation", version="eval-1", inputs=("base", "sft"), optional=("policy_optimisation", "reward_model"),
                bundled=_bundled_eval)
def evaluation_stage(ctx: StageContext) -> StageOutput:
    c = ctx.section
    rows = (_bundled_eval(ctx.config) or load_data(c.data, None))[: c.num_rows]
    final = ctx.inputs.get("policy_optimisation") or ctx.inputs["sft"]
    policies = ([("base", ctx.inputs["base"])] if c.include_base else []) + [("sft", ctx.inputs["sft"]), ("final", final)]
    rm = ctx.inputs.get("reward_model")
    scored: dict[str, dict[str, float]] = {}
    table = []
    for label, rec in policies:
        if rec.fingerprint not in scored:
            scored[rec.fingerprint] = score_policy(rec.output_path, rows, c.reward, c.max_new_tokens, rm.output_path if rm else None)
        table.append({"policy": label, "stage": rec.stage, **scored[rec.fingerprint]})
    metrics = {f"{k}/{row['policy']}": row[k] for row in table for k in ("accuracy", "reward_score") if k in row}
    metrics["accuracy_gain"] = metrics["accuracy/final"] - metrics["accuracy/sft"]
    report = ctx.output_dir / "report"
    report.mkdir(exist_ok=True)
    (report / "results.json").write_text(json.dumps({"table": table, "metrics": metrics}, indent=2))
    _write_csv(report / "evaluation.csv", table)
    curves = {r.stage: json.loads(Path(r.extra["history"]).read_text()) for r in ctx.inputs.values()
              if r is not None and r.extra.get("history") and Path(r.extra["history"]).is_file()}
    plot = plot_report(table, curves, report / "accuracy.png")
    return StageOutput(output_path=report, metrics=metrics, tables={"evaluation": table},
                       artifacts=[plot, report / "evaluation.csv", report / "results.json"], model_to_log=final.output_path,
                       datasets=[DatasetUse("eval", rows, "evaluation", data_label(c.data, "eval"))],
                       extra={"final_stage": final.stage, "final_path": final.output_path})


def score_policy(path: str, rows: list[dict], reward: str, max_new_tokens: int, reward_model: str | None) -> dict[str, float]:
    """Greedy answers of the policy at ``path``: mean rule reward, and mean reward-model score."""
    import torch

    from verl_core.data import collate_sequences, tokenize_prompts
    from verl_core.evaluation import greedy_completions
    from verl_core.models import load_causal_lm, load_reward_model, load_tokenizer
    from verl_core.rewards.rules import get_rule_reward

    tok = load_tokenizer(path)
    examples = tokenize_prompts(rows, tok)
    texts = greedy_completions(load_causal_lm(path, trainable=False), tok, [e["prompt_ids"] for e in examples], max_new_tokens)
    scores = get_rule_reward(reward)(texts, [e["ground_truth"] for e in examples])
    out = {"accuracy": sum(scores) / len(scores)}
    if reward_model is not None:
        rm, rtok = load_reward_model(reward_model, trainable=False), load_tokenizer(reward_model)
        prompts = [e["prompt_ids"] for e in tokenize_prompts(rows, rtok)]
        completions = [rtok(t, add_special_tokens=False)["input_ids"] + [rtok.eos_token_id] for t in texts]
        values = []
        with torch.no_grad():
            for i in range(0, len(prompts), 64):
                batch = collate_sequences(prompts[i:i + 64], completions[i:i + 64], rtok.pad_token_id)
                values += rm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].float().tolist()
        out["reward_score"] = sum(values) / len(values)
    return out


def _write_csv(path: Path, table: list[dict]) -> None:
    import csv

    keys = list(dict.fromkeys(k for row in table for k in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, keys)
        writer.writeheader()
        writer.writerows(table)


def plot_report(table: list[dict], curves: dict[str, dict[str, list]], path: Path) -> Path:
    """Accuracy per policy (bars) and each training stage's loss curve, as one PNG (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar([r["policy"] for r in table], [r["accuracy"] for r in table], color="tab:blue")
    axes[0].set(title="held-out accuracy", ylabel="exact match", ylim=(0, 1))
    for stage, hist in curves.items():
        if hist.get("loss"):
            steps, values = zip(*hist["loss"])
            axes[1].plot(steps, values, label=stage)
    axes[1].set(title="training loss", xlabel="step")
    if curves:
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# Stages with variants that train or sample from the SFT policy register themselves on import.
from verl_core import policy_stages  # noqa: E402,F401
