"""Register a stage's model exactly once, even across killed attempts and reused outputs.

A kill during registration used to lose it: the rerun reused the stage's complete output and
logged nothing. Now a reused output still carries its ``model_to_log`` (kept in the record), and
registration first looks for a version of the registered model made from the same stage output:
one whose version tag ``verl_core.cache_key`` equals the stage's key, or whose source run carries
that key (which also covers a kill between creating the version and tagging it). Only when none
exists is the model logged and registered.
"""

from __future__ import annotations

import logging

from verl_core.pipeline import tracking
from verl_core.pipeline.config import PipelineConfig

log = logging.getLogger("verl_core")
KEY_TAG = "verl_core.cache_key"


def registered_version(config: PipelineConfig, cache_key: str) -> str | None:
    """The version of the registered model made from the stage output with ``cache_key``, if any."""
    name = config.tracking.registered_model_name
    if not name:
        return None
    c = tracking.client(config)
    for version in c.search_model_versions(f"name='{name}'"):
        if version.tags.get(KEY_TAG) == cache_key:
            return str(version.version)
        try:
            source_key = c.get_run(version.run_id).data.tags.get(KEY_TAG) if version.run_id else None
        except Exception:  # the source run was deleted
            source_key = None
        if source_key == cache_key:
            return str(version.version)
    return None


def log_model_once(config: PipelineConfig, run_id: str, model_path: str, cache_key: str) -> str | None:
    """Log and register ``model_path`` unless a version from this stage output exists; returns the version."""
    c, name = tracking.client(config), config.tracking.registered_model_name
    existing = registered_version(config, cache_key)
    if existing is not None:
        log.info("model %s version %s already registered from this output; not registering again", name, existing)
        c.set_tag(run_id, "verl_core.registered_version", existing)
        return existing
    version = tracking.log_model(config, run_id, model_path, name)
    if version is not None and name:
        c.set_model_version_tag(name, version, KEY_TAG, cache_key)
        c.set_tag(run_id, "verl_core.registered_version", version)
    return version
