"""This host's processes and addresses: whether a writer died or is still at work, a cached folder written
by one process while the others wait (build once, under a temporary name, renamed into place), and
whether an address reaches only this host (the loopback default of the launchers and of the reward service)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 (brackets allowed)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def remove_partial_writes(target: Path) -> None:
    """Delete ``.<name>-<pid>-*`` folders that a killed save of ``target`` left (their process is gone)."""
    for partial in target.parent.glob(f".{target.name}-*"):
        pid = partial.name[len(target.name) + 2 :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def _folder_lock(target: Path) -> Iterator[None]:
    """An exclusive file lock beside ``target`` (``.<name>.lock``): one builder of it at a time."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: the atomic rename alone keeps the folder sound
        yield
        return
    with open(target.parent / f".{target.name}.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_folder_once(
    target: str | os.PathLike, build: Callable[[Path], None], done: Callable[[Path], bool] | None = None
) -> Path:
    """``target``, built by ``build(folder)`` unless ``done(target)`` (default: it is a folder) already holds.

    ``build`` writes into a temporary sibling (``.<name>-<pid>-*``) that is renamed to ``target`` only when
    it returns, so a failed or killed build leaves no folder that looks complete (a killed one's leftovers
    go at the next build, :func:`remove_partial_writes`). Processes that ask at once wait on a file lock and
    the later ones find the folder done: it is built once. A ``target`` that exists but is not ``done``
    (an interrupted copy by hand) is replaced."""
    target = Path(target)
    done = done or Path.is_dir
    if done(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(target):
        if done(target):  # another process built it while this one waited
            return target
        return write_then_rename(target, build)


def write_then_rename(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """``write(folder)`` into a temporary sibling ``.<name>-<pid>-*``, then rename it to ``target`` (replacing
    what was there): a crash mid-write leaves no folder at ``target``, and leftovers of killed writers go."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_partial_writes(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-{os.getpid()}-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
