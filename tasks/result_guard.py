"""Cached stage results hold data, never code.

Prefect reads a cached result with the serializer named *inside* the result file, so a file in the
result storage rewritten to name ``pickle`` (or a JSON decoder hook that builds arbitrary objects)
would run code on the next cached run. Before Prefect looks a stage's cache key up,
:func:`refuse_foreign_result` checks that file: the serializer must be Prefect's plain JSON one and
the payload a :class:`~verl_core.pipeline.records.StageRecord` and nothing else. Anything else is moved
aside to ``<file>.refused`` with a warning naming it, so the lookup is a cache miss and the stage runs
again (its record is small: rerunning is the cost, never executing the file).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from verl_core.pipeline.records import StageRecord

log = logging.getLogger("verl_core")
RECORD_CLASS = f"{StageRecord.__module__}.{StageRecord.__qualname__}"
JSON_SERIALIZER = {
    "type": "json",
    "jsonlib": "json",
    "object_encoder": "prefect.serializers.prefect_json_object_encoder",
    "object_decoder": "prefect.serializers.prefect_json_object_decoder",
    "dumps_kwargs": {},
    "loads_kwargs": {},
}


def _hooks_in(value: Any) -> bool:
    """Whether a decoded JSON value holds a key Prefect's decoder turns into an object."""
    if isinstance(value, dict):
        return any(k in ("__class__", "__exc_type__") for k in value) or any(_hooks_in(v) for v in value.values())
    if isinstance(value, list):
        return any(_hooks_in(v) for v in value)
    return False


def foreign_reason(path: Path) -> str | None:
    """Why the result file ``path`` is not a plain JSON stage record (None when it is one)."""
    try:
        content = json.loads(path.read_bytes())  # plain json: no hooks run here
        metadata, payload = content["metadata"], content["result"]
        serializer = metadata["serializer"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"not a Prefect JSON result record ({type(err).__name__}: {err})"
    if serializer != JSON_SERIALIZER:
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        return f"names serializer {kind!r} with other settings than Prefect's plain JSON"
    try:
        record = json.loads(payload) if isinstance(payload, str) else None
    except ValueError:
        record = None
    if not (isinstance(record, dict) and record.get("__class__") == RECORD_CLASS and set(record) == {"__class__", "data"}):
        return "its result is not a stage record"
    if _hooks_in(record["data"]):
        return "its stage record holds encoded objects"
    try:
        StageRecord.model_validate(record["data"])
    except ValueError as err:
        return f"its stage record does not validate ({str(err).splitlines()[0]})"
    return None


def refuse_foreign_result(path: Path) -> bool:
    """Move a result file that is not a plain JSON stage record out of Prefect's way; True if it was moved."""
    if not path.is_file():
        return False
    reason = foreign_reason(path)
    if reason is None:
        return False
    refused = path.with_name(path.name + ".refused")
    path.replace(refused)
    log.warning("refused the cached result %s: %s; moved to %s, the stage runs again", path, reason, refused)
    return True
