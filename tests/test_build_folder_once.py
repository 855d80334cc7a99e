"""verl_core.processes.build_folder_once: the one build-then-rename of a cached folder (tiny model, GGUF, benches, tests)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from verl_core.processes import build_folder_once


def _slow_build(folder: Path, log: Path) -> None:
    with open(log, "a") as fh:
        fh.write("built\n")
    time.sleep(0.5)  # long enough for the other process to be waiting on the lock
    (folder / "config.json").write_text("{}")


def _ask(target: str, log: str) -> None:
    build_folder_once(Path(target), lambda f: _slow_build(f, Path(log)), done=lambda t: (t / "config.json").is_file())


def test_processes_asking_at_once_build_the_folder_once(tmp_path):
    target, log = tmp_path / "cache" / "model", tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ask, args=(str(target), str(log))) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "built\n" and (target / "config.json").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == [".model.lock", "model"]  # no temporary folder left


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    target = tmp_path / "model"

    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_folder_once(target, broken)
    assert not target.exists() and [p.name for p in tmp_path.iterdir()] == [".model.lock"]
    assert build_folder_once(target, lambda f: (f / "ok").write_text("1")) == target and (target / "ok").is_file()


def test_a_folder_that_is_not_done_is_replaced(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "half-copied.bin").write_text("x")
    build_folder_once(target, lambda f: (f / "config.json").write_text("{}"), done=lambda t: (t / "config.json").is_file())
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
