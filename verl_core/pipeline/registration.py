"""Register a stage's model exactly once, even across killed attempts and reused outputs.

A kill during registration used to lose it: the rerun reused the stage's complete output and
logged nothing. Now a reused output still carries its ``model_to_log`` (kept in the record), and
registration first looks for a version of the registered model made from the same stage output:
one whose version tag ``verl_core.cache_key`` equals the stage's key, or whose source run carries
that key (which also covers a kill between creating the version and tagging it). Only when none
exists is the model logged and registered.
"""

from __future__ import annotations

KEY_TAG = "verl_core.cache_key"


def registered_version(client, name: str | None, cache_key: str) -> str | None:
    """The version of registered model ``name`` made from the stage output with ``cache_key``, if any."""
    if not name:
        return None
    for version in client.search_model_versions(f"name='{name}'"):
        if version.tags.get(KEY_TAG) == cache_key:
            return str(version.version)
        try:
            source_key = client.get_run(version.run_id).data.tags.get(KEY_TAG) if version.run_id else None
        except Exception:  # the source run was deleted
            source_key = None
        if source_key == cache_key:
            return str(version.version)
    return None
