"""Sampling, scoring, resumable shards and the written datasets (see the package docstring)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from verl_core.data import tokenize_prompts
from verl_core.data.fingerprint import fingerprint_path
from verl_core.policies import LLMPolicy
from verl_core.preference_data.config import (
    COLUMNS,
    FORMAT_VERSION,
    WEIGHT_SUFFIXES,
    PreferenceDataConfig,
    PreferenceDataResult,
    ShardMismatchError,
)
from verl_core.preference_data.rows import build_rows
from verl_core.rewards.model import RewardModel, RewardSource, RewardSourceConfig, UserRewards
from verl_core.rollout.contract import SamplingParams, decode_responses
from verl_core.rollout.registry import build_rollout_backend, close_backend


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``parts`` (e.g. the shard index)."""
    blob = ":".join(str(int(p)) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.sha256(b"preference-data:" + blob).digest()[:8], "big") >> 1


def fingerprint_weights(path: str | os.PathLike) -> dict[str, Any]:
    """sha256 of the weight files in a model folder (or of one file), and their names; a hub id hashes its name."""
    p = Path(path)
    if not p.exists():
        return {"sha256": fingerprint_path(path), "files": [], "remote": True}
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    return {
        "sha256": fingerprint_path(p, WEIGHT_SUFFIXES),
        "files": [str(f.relative_to(p)) if p.is_dir() else f.name for f in files],
    }


def fingerprint_module(model: torch.nn.Module) -> dict[str, Any]:
    """sha256 over the names and fp32 values of a live model's state dict."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0")
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return {"sha256": h.hexdigest(), "files": []}


def _json_hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _describe_source(source: RewardSource, config: RewardSourceConfig) -> dict[str, Any]:
    rm = source.reward_model
    out: dict[str, Any] = {
        "rules": dict(source.rules),
        "functions": {n: w for n, (_, w) in source.functions.items()},
        "reward_model": None,
    }
    if rm is not None:
        path = config.reward_model_path or getattr(rm.model.config, "_name_or_path", None)
        out["reward_model"] = {
            "path": str(path) if path else None,
            "weight": source.reward_model_weight,
            "fingerprint": fingerprint_module(rm.model)["sha256"],
        }
    return out


def generate_preference_data(
    policy_path: str | os.PathLike | LLMPolicy,
    prompts: Any,
    config: PreferenceDataConfig | dict | None,
    output_dir: str | os.PathLike,
    reward_model: RewardModel | str | os.PathLike | None = None,
    reward_functions: UserRewards = None,
    overwrite: bool = False,
    on_shard_end: Callable[[int, Path], None] | None = None,
) -> PreferenceDataResult:
    """Sample, score, pair and label; write datasets, shards and provenance under ``output_dir``.

    ``prompts``: anything :func:`~verl_core.data.load_rows` reads, with ``prompt`` (text or message
    list) and optional ``ground_truth`` per row. ``reward_model`` / ``reward_functions`` join the
    rules of ``config.reward`` (see :class:`~verl_core.rewards.RewardSource`). Finished shards found
    in ``output_dir`` are reused when they were made with the same settings; otherwise
    :class:`ShardMismatchError`, unless ``overwrite`` deletes them. ``on_shard_end(index, path)``
    runs after each shard is written (progress reporting, tests).
    """
    from verl_core.train.progress import progress_bar

    if not isinstance(config, PreferenceDataConfig):
        config = PreferenceDataConfig.from_dict(dict(config or {}), source="generate_preference_data")
    out = Path(output_dir)
    shard_dir = out / "shards"
    device = torch.device(
        "cuda" if config.device == "auto" and torch.cuda.is_available() else ("cpu" if config.device == "auto" else config.device)
    )
    if isinstance(policy_path, LLMPolicy):
        policy, policy_fp = policy_path, fingerprint_module(policy_path.model)
    else:
        policy_fp = fingerprint_weights(policy_path)
        policy = LLMPolicy.from_pretrained(policy_path, dtype=config.dtype)
    policy.model.to(device)
    source = RewardSource.build(config.reward, reward_model, reward_functions, default_rules={"exact_match": 1.0})
    if source.reward_model is not None:
        source.reward_model.to(device)
    examples = tokenize_prompts(prompts, policy.tokenizer, max_prompt_length=config.max_prompt_length)
    params = config.sampling_params()
    manifest = {
        "format": FORMAT_VERSION,
        "policy_fingerprint": policy_fp["sha256"],
        "device": device.type,
        "dtype": config.dtype,
        "prompts_fingerprint": _json_hash([[e["prompt"], e["ground_truth"]] for e in examples]),
        "sampling": params.model_dump(mode="json"),
        "rollout_backend": config.rollout.backend,
        "seed": config.seed,
        "shard_size": config.shard_size,
        "batch_size": config.batch_size,
        "max_prompt_length": config.max_prompt_length,
        "reward": _describe_source(source, config.reward),
    }
    _prepare_shard_dir(shard_dir, _relative_paths(manifest, out), overwrite)

    n_shards = math.ceil(len(examples) / config.shard_size)
    todo = [i for i in range(n_shards) if _read_shard(shard_dir, i, _shard_range(i, config, len(examples)), params.n) is None]
    done_prompts = len(examples) - sum(len(range(*_shard_range(i, config, len(examples)))) for i in todo)
    backend = build_rollout_backend(config.rollout, policy.model, policy.tokenizer) if todo else None
    try:
        with progress_bar(len(examples), done_prompts, "preference data", "prompt", disable=not config.progress) as bar:
            for shard in todo:
                start, stop = _shard_range(shard, config, len(examples))
                records: list[dict] = []
                for b, lo in enumerate(range(start, stop, config.batch_size)):
                    chunk = examples[lo : min(lo + config.batch_size, stop)]
                    records += _sample_and_score(
                        backend, policy.tokenizer, source, chunk, lo, params, derive_seed(config.seed, shard, b)
                    )
                    bar.update(len(chunk))
                path = _shard_path(shard_dir, shard)
                _write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
                if on_shard_end is not None:
                    on_shard_end(shard, path)
    finally:
        close_backend(backend)

    samples = [r for i in range(n_shards) for r in _read_shard(shard_dir, i, _shard_range(i, config, len(examples)), params.n)]
    rows, counts, stats = build_rows(samples, config)
    paths = {"shards": shard_dir}
    with _datasets_progress(config.progress):
        for kind in config.outputs:
            paths.update(_write_dataset(rows[kind], COLUMNS[kind], out, kind, config.formats))
    provenance = {
        "format": FORMAT_VERSION,
        "policy": {"path": str(policy.source if isinstance(policy_path, LLMPolicy) else policy_path), **policy_fp},
        "reward": manifest["reward"],
        "sampling": manifest["sampling"],
        "seed": config.seed,
        "device": device.type,
        "prompts_fingerprint": manifest["prompts_fingerprint"],
        "config": config.model_dump(mode="json"),
        "counts": counts,
        "stats": stats,
        "shards": n_shards,
    }
    paths["provenance"] = out / "provenance.json"
    provenance = _relative_paths(provenance, out)  # a moved workdir keeps the output's bytes and fingerprint
    _write_atomic(paths["provenance"], json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    return PreferenceDataResult(out, paths, counts, stats, provenance)


def _shard_range(shard: int, config: PreferenceDataConfig, n_prompts: int) -> tuple[int, int]:
    return shard * config.shard_size, min((shard + 1) * config.shard_size, n_prompts)


def _shard_path(shard_dir: Path, shard: int) -> Path:
    return shard_dir / f"shard-{shard:05d}.jsonl"


def _prepare_shard_dir(shard_dir: Path, manifest: dict, overwrite: bool) -> None:
    """Create ``shards/`` with its manifest; check an existing one matches; drop half-written files."""
    path = shard_dir / "manifest.json"
    if overwrite and shard_dir.exists():
        shutil.rmtree(shard_dir)
    if path.exists():
        old = json.loads(path.read_text())
        if old != json.loads(json.dumps(manifest)):
            diff = sorted(k for k in set(old) | set(manifest) if old.get(k) != json.loads(json.dumps(manifest)).get(k))
            raise ShardMismatchError(
                f"{shard_dir} holds shards sampled with other settings (differ: {diff}); use another output_dir or overwrite=True"
            )
    shard_dir.mkdir(parents=True, exist_ok=True)
    for stale in shard_dir.glob(".*.tmp-*"):
        stale.unlink()
    if not path.exists():
        _write_atomic(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _read_shard(shard_dir: Path, shard: int, span: tuple[int, int], n: int) -> list[dict] | None:
    """The shard's records, or None when it is missing or not the complete expected prompt range."""
    path = _shard_path(shard_dir, shard)
    if not path.exists():
        return None
    try:
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]
    except json.JSONDecodeError:
        return None
    expected = [(i, j) for i in range(*span) for j in range(n)]
    if [(r.get("prompt_index"), r.get("sample_index")) for r in records] != expected:
        return None
    return records


def _sample_and_score(
    backend, tokenizer, source: RewardSource, chunk: list[dict], first_index: int, params: SamplingParams, seed: int
) -> list[dict]:
    """One generate call for ``chunk``; a record per sample with its text and scores."""
    batch = backend.generate([e["prompt_ids"] for e in chunk], params, seed=seed)
    texts = decode_responses(tokenizer, batch)
    owners = [chunk[g] for g in batch.group_index.tolist()]
    scores = source.score([e["prompt"] for e in owners], texts, [e["ground_truth"] for e in owners])
    lengths, finished = batch.response_lengths.tolist(), batch.finished.tolist()
    logprobs = (batch.logprobs * batch.response_mask).sum(-1).tolist()
    records = []
    for k, (text, owner) in enumerate(zip(texts, owners)):
        records.append(
            {
                "prompt_index": first_index + k // params.n,
                "sample_index": k % params.n,
                "prompt": owner["prompt"],
                "ground_truth": owner["ground_truth"],
                "completion": text,
                "score": float(scores.total[k]),
                "components": {n: float(v[k]) for n, v in scores.components.items()},
                "finished": bool(finished[k]),
                "num_tokens": int(lengths[k]),
                "logprob": float(logprobs[k]),
            }
        )
    return records


@contextlib.contextmanager
def _datasets_progress(enabled: bool) -> Iterator[None]:
    """Silence the ``datasets`` progress bars while writing when ``enabled`` is False."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            ds_logging.enable_progress_bar()


def _write_dataset(rows: list[dict], columns: list[str], out: Path, kind: str, formats: Sequence[str]) -> dict[str, Path]:
    """``out/kind/`` (save_to_disk) and/or ``out/kind.parquet``, each replaced atomically."""
    import datasets

    ds = datasets.Dataset.from_list(rows) if rows else datasets.Dataset.from_dict({c: [] for c in columns})
    paths: dict[str, Path] = {}
    if "arrow" in formats:
        target, tmp = out / kind, out / f".{kind}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        ds.save_to_disk(str(tmp))
        old = out / f".{kind}.old-{os.getpid()}"
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
        paths[kind] = target
    if "parquet" in formats:
        target, tmp = out / f"{kind}.parquet", out / f".{kind}.parquet.tmp-{os.getpid()}"
        ds.to_parquet(str(tmp))
        os.replace(tmp, target)
        paths[f"{kind}_parquet"] = target
    return paths


def _relative_paths(data: Any, out: Path) -> Any:
    """``data`` with every absolute path that exists written relative to ``out`` (the output folder)."""

    if isinstance(data, dict):
        return {k: _relative_paths(v, out) for k, v in data.items()}
    if isinstance(data, list):
        return [_relative_paths(v, out) for v in data]
    if isinstance(data, str) and os.path.isabs(data) and Path(data).exists():
        return os.path.relpath(Path(data).resolve(), out.resolve())
    return data
