"""A cached Prefect result is data: a result file rewritten to run code is refused, never executed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.result_guard import foreign_reason, refuse_foreign_result
from verl_core.pipeline.records import StageRecord

pytestmark = pytest.mark.fast


class _Planted:
    """Unpickling this runs a shell command (what an attacker would plant)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _record_file(tmp_path: Path, result, serializer) -> Path:
    from prefect.results import ResultRecord, ResultRecordMetadata

    path = tmp_path / "evaluation-0123"
    meta = ResultRecordMetadata(storage_key=str(path), serializer=serializer)
    path.write_bytes(ResultRecord(result=result, metadata=meta).serialize())
    return path


def _good(tmp_path: Path) -> Path:
    from prefect.serializers import JSONSerializer

    return _record_file(tmp_path, StageRecord(stage="evaluation", output_path="/x", fingerprint="f"), JSONSerializer())


def test_a_planted_pickle_result_would_run_code_in_prefect_and_is_refused_here(tmp_path):
    from prefect.results import ResultRecord
    from prefect.serializers import PickleSerializer

    marker = tmp_path / "pwned"
    planted = _record_file(tmp_path, _Planted(marker), PickleSerializer())
    ResultRecord.deserialize(planted.read_bytes())  # what Prefect does with the file on a cache hit
    assert marker.exists()  # the threat is real
    marker.unlink()
    assert "pickle" in foreign_reason(planted)
    assert refuse_foreign_result(planted)
    assert not planted.exists() and planted.with_name(planted.name + ".refused").exists() and not marker.exists()


def test_json_results_that_build_objects_or_name_other_hooks_are_refused(tmp_path):
    good = _good(tmp_path)
    assert foreign_reason(good) is None and not refuse_foreign_result(good)
    content = json.loads(good.read_text())
    hooked = {**content["metadata"], "serializer": {**content["metadata"]["serializer"], "object_decoder": "os.system"}}
    variants = {
        "exception hook": {**content, "result": json.dumps({"__exc_type__": "builtins.SystemExit", "message": "x"})},
        "other class": {**content, "result": json.dumps({"__class__": "os.PathLike", "data": {}})},
        "nested class": {
            **content,
            "result": json.dumps({"__class__": StageRecord.__module__ + ".StageRecord", "data": {"extra": {"__class__": "x"}}}),
        },
        "decoder": {**content, "metadata": hooked},
        "not json": None,
    }
    for name, body in variants.items():
        path = tmp_path / f"r-{name.replace(' ', '-')}"
        path.write_text("\x80garbage" if body is None else json.dumps(body))
        assert foreign_reason(path) is not None, name
