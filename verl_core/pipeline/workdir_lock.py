"""One writer per workdir, and per stage folder.

A lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local file systems) holding its
owner's PID, host and start time as JSON. A second run finds it and either waits, printing who
holds it, or fails at once with :class:`~verl_core.errors.WorkdirError` (``orchestration.busy_workdir``).
A lock whose owner is on this host and no longer alive (a ``kill -9``) is stale: it is removed and
taken over, under an OS file lock on ``<lock>.takeover`` held while the lock is read again, removed and
created anew, so that of several processes finding the same stale lock exactly one takes it (the others
then find the new owner alive). A lock held by another host is never taken over automatically (its PID means nothing
here); the error says which file to delete once that run is known to be gone.

The pipeline run holds ``<workdir>/.lock``; each stage additionally holds
``<workdir>/.locks/<stage folder name>.lock`` while it writes (outside the folder, so the lock never
enters the output's fingerprint), so a stage run on its own (a distributed worker, ``run_stage`` from Python)
cannot write into a folder a pipeline run is filling.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from verl_core.errors import WorkdirError
from verl_core.processes import pid_alive

log = logging.getLogger("verl_core")
LOCK_FILE = ".lock"


def owner() -> dict[str, str | int | float]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}


def _read_owner(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_stale(info: dict | None, path: Path) -> bool:
    if info is None:  # unreadable: a writer died between create and write, or it was just released
        try:
            return time.time() - path.stat().st_mtime > 5
        except FileNotFoundError:
            return True
    return info.get("host") == socket.gethostname() and not pid_alive(int(info.get("pid", -1)))


def _try_create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(owner(), f)
    return True


def _take_over_stale(path: Path) -> bool:
    """Replace a stale lock by this process's, with no window in which two processes both decide it is
    stale: the decision, the removal and the create happen under an OS lock on ``<lock>.takeover``."""
    guard = os.open(f"{path}.takeover", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies holding it
        info = _read_owner(path)
        if not _is_stale(info, path):
            return False  # another process took it over meanwhile: it is alive now
        log.warning("removing the stale lock %s of a run that is gone (%s)", path, info)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return _try_create(path)
    finally:
        os.close(guard)


@contextlib.contextmanager
def exclusive(path: Path, what: str, wait: bool = True, timeout: float = 3600.0, poll: float = 1.0) -> Iterator[Path]:
    """Hold the lock file ``path`` for the block; ``what`` names the locked thing in messages."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline, announced = time.monotonic() + timeout, False
    while not _try_create(path):
        info = _read_owner(path)
        if _is_stale(info, path):
            if _take_over_stale(path):
                break
            continue
        holder = f"process {info.get('pid')} on {info.get('host')}" if info else "another process"
        if info and int(info.get("pid", -1)) == os.getpid() and info.get("host") == socket.gethostname():
            raise WorkdirError(f"{what} is already locked by this process ({path}): a run inside a run on the same folder")
        if not wait or time.monotonic() > deadline:
            raise WorkdirError(
                f"{what} is in use by {holder} (lock file {path}). One run writes a workdir at a time: wait "
                "for it to finish, use another workdir, or set orchestration.busy_workdir=wait. If that run is gone "
                "(another machine), delete the lock file."
            )
        if not announced:
            log.warning("%s is in use by %s; waiting for it to finish (lock file %s)", what, holder, path)
            print(f"verl-core: {what} is in use by {holder}; waiting for it to finish (lock file {path})", flush=True)
            announced = True
        time.sleep(poll)
    try:
        yield path
    finally:
        info = _read_owner(path)
        if info and info.get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def workdir_lock(workdir: Path, wait: bool, timeout: float) -> contextlib.AbstractContextManager[Path]:
    return exclusive(workdir / LOCK_FILE, f"workdir {workdir}", wait, timeout)


def stage_lock(workdir: Path, stage_folder: Path, wait: bool, timeout: float) -> contextlib.AbstractContextManager:
    """The lock of one stage folder. In a multi-process job (torchrun sets ``RANK``) only rank 0 takes
    it: the other ranks write into the same folder under rank 0's lock, and waiting there would deadlock."""
    if int(os.environ.get("RANK", "0")) > 0:
        return contextlib.nullcontext()
    name = f"stage folder {stage_folder}"
    return exclusive(workdir / ".locks" / f"{stage_folder.name}.lock", name, wait, timeout)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), which tells a live process from a reused PID."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tags() -> dict[str, str]:
    """Tags that name the process writing a run, so a later run can tell whether it is still alive."""
    return {
        "verl_core.pid": str(os.getpid()),
        "verl_core.host": socket.gethostname(),
        "verl_core.pid_start": _start_time(os.getpid()) or "",
    }


def owner_gone(tags: dict[str, str]) -> bool:
    """Whether the process ``tags`` (from :func:`owner_tags`) name is gone; False when unknown or on another host."""
    pid, host = tags.get("verl_core.pid"), tags.get("verl_core.host")
    if not pid or host != socket.gethostname() or int(pid) == os.getpid():
        return False
    if not pid_alive(int(pid)):
        return True
    started = tags.get("verl_core.pid_start")
    return bool(started) and _start_time(int(pid)) not in (None, started)  # the PID now belongs to another process
