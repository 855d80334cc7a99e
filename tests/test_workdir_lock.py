"""One writer per workdir, stale locks, and ending what killed processes left RUNNING (issue 18)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verl_core.errors import WorkdirError
from verl_core.pipeline.workdir_lock import LOCK_FILE, exclusive, owner_gone, owner_tags, workdir_lock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _hold_lock_in_a_subprocess(path, seconds: float) -> subprocess.Popen:
    """Another live process holding the lock, written the way ``exclusive`` writes it (plain Python:
    importing verl_core in the child would only add seconds)."""
    code = (
        "import json, os, socket, sys, time\n"
        f"path = {str(path)!r}\n"
        "fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'since': time.time()}).encode())\n"
        "os.close(fd); print('held', flush=True)\n"
        f"time.sleep({seconds}); os.unlink(path)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    holder = _hold_lock_in_a_subprocess(tmp_path / LOCK_FILE, 30)
    try:
        start = time.monotonic()
        with pytest.raises(WorkdirError, match=rf"in use by process {holder.pid} on .*lock file .*{LOCK_FILE}"):
            with workdir_lock(tmp_path, wait=False, timeout=60):
                pass
        assert time.monotonic() - start < 30  # at once: not the 60 s wait a waiting writer would take
    finally:
        holder.kill()
        holder.wait()


def test_a_waiting_writer_gets_the_lock_when_the_holder_finishes(tmp_path, capsys):
    holder = _hold_lock_in_a_subprocess(tmp_path / LOCK_FILE, 2)
    with workdir_lock(tmp_path, wait=True, timeout=60) as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert holder.wait() == 0
    assert "waiting for it to finish" in capsys.readouterr().out
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_of_a_killed_process_is_stale_and_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "since": 0}))
    with workdir_lock(tmp_path, wait=False, timeout=1):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "since": 0}))
    with pytest.raises(WorkdirError, match="on elsewhere.*delete the lock file"):
        with workdir_lock(tmp_path, wait=False, timeout=1):
            pass


def test_threads_of_one_process_do_not_share_a_held_lock(tmp_path):
    errors = []

    def second():
        try:
            with exclusive(tmp_path / "x.lock", "stage folder x", wait=False):
                pass
        except WorkdirError as err:
            errors.append(err)

    with exclusive(tmp_path / "x.lock", "stage folder x", wait=False):
        t = threading.Thread(target=second)
        t.start()
        t.join()
    assert len(errors) == 1


def test_owner_tags_tell_a_dead_process_from_a_live_one():
    assert not owner_gone(owner_tags())  # this process
    assert owner_gone({**owner_tags(), "verl_core.pid": str(_dead_pid())})
    assert not owner_gone({**owner_tags(), "verl_core.pid": str(_dead_pid()), "verl_core.host": "elsewhere"})
    # a PID reused by another process: the recorded start time does not match
    assert owner_gone({**owner_tags(), "verl_core.pid": "1", "verl_core.pid_start": "0"})


@pytest.mark.slow  # creating a fresh MLflow SQLite store (schema migrations) takes seconds
def test_runs_left_running_by_a_dead_process_are_ended_killed_with_a_note(tmp_path):
    from verl_core.pipeline import tracking
    from verl_core.pipeline.config import load_pipeline_config
    from verl_core.pipeline.reconcile import end_runs_of_dead_processes

    cfg = load_pipeline_config(None, [f"workdir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"])
    c, exp = tracking.client(cfg), tracking.experiment_id(cfg)
    dead = c.create_run(exp, tags={**owner_tags(), "verl_core.pid": str(_dead_pid())}).info.run_id
    alive = c.create_run(exp, tags=owner_tags()).info.run_id
    untagged = c.create_run(exp).info.run_id
    assert end_runs_of_dead_processes(cfg) == [dead]
    run = c.get_run(dead)
    assert run.info.status == "KILLED" and "is gone" in run.data.tags["mlflow.note.content"]
    assert c.get_run(alive).info.status == c.get_run(untagged).info.status == "RUNNING"


def _race_for_a_stale_lock(path, barrier, holders, most, rounds: int) -> None:
    import logging
    import traceback

    logging.getLogger("verl_core").setLevel(logging.ERROR)  # one "removing the stale lock" line per round is noise here
    try:
        _race_rounds(path, barrier, holders, most, rounds)
    except BaseException:
        # the parent only sees an exit code: leave the reason where its assertion prints it
        Path(f"{path}.error-{os.getpid()}").write_text(traceback.format_exc())
        barrier.abort()
        raise


def _race_rounds(path, barrier, holders, most, rounds: int) -> None:
    for _ in range(rounds):
        barrier.wait()  # the parent has planted a stale lock; everyone tries at once
        try:
            with exclusive(path, "workdir race", wait=False):
                with holders.get_lock():
                    holders.value += 1
                    most.value = max(most.value, holders.value)
                time.sleep(0.01)
                with holders.get_lock():
                    holders.value -= 1
        except WorkdirError:
            pass
        barrier.wait()  # round over


@pytest.mark.parametrize("processes", [2, 4])
def test_processes_racing_for_a_stale_lock_never_both_hold_it(tmp_path, processes):
    import multiprocessing

    # spawn, not fork: a child forked from a long test session inherits its threads and handlers
    ctx = multiprocessing.get_context("spawn")
    rounds, path = 100, tmp_path / LOCK_FILE
    barrier, holders, most = ctx.Barrier(processes + 1), ctx.Value("i", 0), ctx.Value("i", 0)
    procs = [ctx.Process(target=_race_for_a_stale_lock, args=(path, barrier, holders, most, rounds)) for _ in range(processes)]
    for p in procs:
        p.start()
    dead = _dead_pid()
    for _ in range(rounds):
        path.unlink(missing_ok=True)
        path.write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "since": 0}))
        barrier.wait(120)
        barrier.wait(120)
    for p in procs:
        p.join(60)
    errors = [f.read_text() for f in tmp_path.glob(f"{LOCK_FILE}.error-*")]
    assert all(p.exitcode == 0 for p in procs), ([p.exitcode for p in procs], errors)
    assert most.value == 1  # never two holders at once, in any of the rounds
