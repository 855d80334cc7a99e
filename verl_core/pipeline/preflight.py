"""Checks that fail in seconds, before any training: the workdir, the MLflow tracking URI, every model
path the run will load and every data file it will read (:mod:`.data_checks`).

Without them a read-only workdir failed after minutes of training (at the first checkpoint) and an
unreachable tracking server after MLflow's own retries (~4 minutes). Each failure is a
:class:`~verl_core.errors.WorkdirError` or :class:`~verl_core.errors.TrackingError` naming the
path or URI. Creating a fresh SQLite store is done here under a lock next to the database, since
two processes creating its schema at once crash inside MLflow.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from verl_core.errors import TrackingError, WorkdirError
from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.data_checks import check_data
from verl_core.pipeline.workdir_lock import exclusive

TRACKING_TIMEOUT_S = 5.0
log = logging.getLogger("verl_core")


def writable_folder(path: Path, what: str) -> None:
    if path.exists() and not path.is_dir():
        raise WorkdirError(f"{what} {path} is a file, not a folder; choose another path or move the file")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise WorkdirError(
            f"{what} {path} is not writable ({err.strerror or err}); check its permissions and free space"
        ) from None


def check_workdir(config: PipelineConfig) -> None:
    writable_folder(config.workdir_path, "workdir")
    writable_folder(config.result_storage_path, "orchestration.result_storage")


def check_tracking(config: PipelineConfig) -> None:
    """Reach the tracking server (HTTP: its /health within a few seconds) or create the SQLite store."""
    uri = tracking.tracking_uri(config)
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=TRACKING_TIMEOUT_S) as resp:
                if resp.status >= 500:
                    raise TrackingError(f"MLflow tracking server {uri} answers {resp.status}; check the server")
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise TrackingError(
                f"MLflow tracking URI {uri} cannot be reached within {TRACKING_TIMEOUT_S:.0f}s ({reason}); start the "
                "server (`verl-core servers`), fix tracking.uri / MLFLOW_TRACKING_URI, or unset them to use a "
                "SQLite store in the workdir"
            ) from None
    elif uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        writable_folder(db.parent, "MLflow store folder")
        with exclusive(db.with_name(db.name + ".lock"), f"MLflow store {db}"):
            if db.exists() and _half_created(db):
                aside = db.with_name(f"{db.name}.half-created-{int(time.time())}")
                db.replace(aside)
                log.warning("MLflow store %s was left half-created by a killed run (no runs in it); moved to %s", db, aside)
            if not db.exists():
                _create_store(config, db)
            try:
                tracking.experiment_id(config)
            except Exception as err:
                raise TrackingError(f"MLflow store {uri} cannot be opened: {type(err).__name__}: {err}") from None


def _create_store(config: PipelineConfig, db: Path) -> None:
    """A new SQLite store, its schema and the experiment created under a temporary name, then renamed: MLflow
    creates the schema in ~40 migrations, and a run killed among them left a store no later run could open."""
    tmp = db.with_name(f".tmp-{os.getpid()}-{db.name}")
    tmp.unlink(missing_ok=True)
    try:
        tracking.experiment_id(config.updated(tracking={**config.tracking.model_dump(), "uri": f"sqlite:///{tmp}"}))
        tmp.replace(db)
    finally:
        tmp.unlink(missing_ok=True)


def _half_created(db: Path) -> bool:
    """A store whose schema a killed run left unfinished: MLflow's migrations did not reach the end, and it
    holds no run (so moving it aside loses nothing)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "runs" in tables and con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] > 0:
                return False
            return not _migrations_complete(con, tables)
    except sqlite3.DatabaseError:
        return db.stat().st_size == 0


def _migrations_complete(con, tables: set[str]) -> bool:
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config  # the migrations of the MLflow that writes the store

    if "alembic_version" not in tables:
        return False
    heads = set(ScriptDirectory.from_config(_get_alembic_config("sqlite://")).get_heads())
    return {r[0] for r in con.execute("SELECT version_num FROM alembic_version")} == heads


def model_paths(config: PipelineConfig) -> dict[str, str]:
    """Config key -> every model folder (or hub id) the enabled stages will load that the user gave."""
    po = config.policy_optimisation
    section = getattr(po, po.algorithm, None)
    scoring = config.preference_data.sample_and_score.reward if config.preference_data.method == "sample_and_score" else None
    paths = {
        "base_model": config.base_model,
        "sft.model_path": config.sft.model_path,
        "reward_model.model_path": config.reward_model.model_path,
        "policy_optimisation.model_path": po.model_path,
        f"policy_optimisation.{po.algorithm}.teacher_model": getattr(section, "teacher_model", None),
        **_reward_models(f"policy_optimisation.{po.algorithm}", section),
        **_reward_models("preference_data.sample_and_score.reward", scoring),
    }
    return {k: v for k, v in paths.items() if v is not None}


def _reward_models(key: str, reward) -> dict[str, str | None]:
    """The models a reward section loads: its reward model and its judge."""
    judge = getattr(reward, "judge", None)
    return {f"{key}.reward_model_path": getattr(reward, "reward_model_path", None), f"{key}.judge.model": judge and judge.model}


def check_models(config: PipelineConfig) -> None:
    from verl_core.config import ConfigError
    from verl_core.modeling.loading import check_model_source
    from verl_core.modeling.model_files import ModelLoadError

    po = config.policy_optimisation
    if getattr(getattr(po, po.algorithm, None), "teacher_model", "") is None:
        raise ConfigError(
            f"policy_optimisation.{po.algorithm}.teacher_model: {po.algorithm} needs a teacher "
            "(a model folder, a .gguf file or bundled:smollm2)"
        )
    for key, path in model_paths(config).items():
        try:
            check_model_source(path)
        except ModelLoadError as err:
            raise ModelLoadError(f"{key}: {err}") from None


def preflight(config: PipelineConfig) -> None:
    check_workdir(config)
    check_models(config)
    check_data(config)
    check_tracking(config)
